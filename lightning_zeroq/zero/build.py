"""The engine's parts, composed once in small named steps (``build``), as torchtitan's ``parallelize_*``
composes ``apply_*``: each step takes what the earlier ones made and returns its own part; none reads
the ``ZeroConfig`` (the policies are made from it first, ``policies.from_config``) and none receives
the engine. ``ZeroEngine`` holds the result, ``Parts``, and the ``Stepper`` made on it (``step.py``).

1. ``_agree_and_plan``: every rank the same settings and unit plan, or one error on all (``agreement.py``);
   activation checkpointing applied (and what activation offload names checked); the host memory read before
   any rank allocates.
2. ``hybrid.topology``: the shard and replica groups.
3. ``_placement``: the host's worker (``offload/host_worker.py``: a thread with speculative or
   asynchronous host steps, else none), where masters and optimizer state live (``offload/``), how
   shards travel (``wire.py``) and, stage 3, where a transient unit's payload rests; checked against
   host memory.
4. ``_units``: the module's parameters flattened into units, broadcast from rank 0, sharded, each
   published (stage 3: stored and freed) as it is built (``unit.py``, ``gather.py``); stage 3's frozen
   parameters with them, as each unit's frozen part (``frozen.py``).
5. ``_hooks``: stage 3's module hooks (``stage3.py``), the asynchronous step (``offload/async_step.py``)
   and the gradient hooks (``reducer.py``); then activation offload's (``activation_offload.py``), outside
   every other wrapper of a module's forward.

The worker is handed to each part that gives it work or waits for it when that part is made (the host
placement, the gatherers, the asynchronous step); none of them is told about it later.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import activation_checkpoint, activation_offload, comm, hybrid, loss_scaler
from lightning_zeroq.zero import frozen as frozen_parts
from lightning_zeroq.zero.agreement import BuildAgreement, describe_plan
from lightning_zeroq.zero.frozen import FrozenCodec, FrozenNeed, FrozenParts
from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.hybrid import Topology
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.loss_scaler import DynamicLossScaler
from lightning_zeroq.zero.materialize import sync_replicated_state, target_device
from lightning_zeroq.zero.memory.device import NO_FROZEN
from lightning_zeroq.zero.memory.host import HostBudget
from lightning_zeroq.zero.offload.async_step import AsyncHostStep
from lightning_zeroq.zero.offload.device import OptimizerHome
from lightning_zeroq.zero.offload.host_worker import HostWorker
from lightning_zeroq.zero.offload.select import host_part, optimizer_home, shard_store
from lightning_zeroq.zero.offload.stores import MasterAlias, ShardStore
from lightning_zeroq.zero.policies import ModuleUnits, Nvme, OnDevice, Policies
from lightning_zeroq.zero.reducer import NoListener, Reducer
from lightning_zeroq.zero.stage3 import Stage3Coordinator
from lightning_zeroq.zero.unit import Unit, build_units, plan_layouts, trainable_parameters
from lightning_zeroq.zero.unit_plan import UnitSpec, frozen_only_specs, unit_plan
from lightning_zeroq.zero.wire import FullWidth, Int8, Wire


@dataclass(eq=False)
class Parts:
    """Everything a built engine is made of. The parts are fixed once built; ``retired`` and ``closed``
    are the engine's lifecycle (``release_module`` handed the module back; ``close`` released the state)."""

    module: nn.Module
    policies: Policies
    param_dtype: torch.dtype
    topology: Topology
    device: torch.device
    host_memory: HostBudget
    placement: OptimizerHome
    gatherer: Gatherer
    units: list[Unit]
    reducer: Reducer
    stage3: Optional[Stage3Coordinator]
    worker: HostWorker
    """The host's worker (``offload/host_worker.py``): what runs beside the calling thread, and ``wait()`` for it."""
    async_step: Optional[AsyncHostStep]
    """With ``offload_async_step``: the host step beside the next forward (else it runs in the step)."""
    loss_scaler: Optional[DynamicLossScaler]
    param_names: dict[int, str] = field(default_factory=dict)
    """Every parameter's name by ``id`` (after materialization): errors and logs name parameters."""
    frozen: Optional[FrozenParts] = None
    """Stage 3: the units' frozen parts (``frozen.py``); None where no frozen parameter is sharded."""
    activations: Optional[activation_offload.ActivationOffload] = None
    """The offload of activations to the host (``activation_offloading_policy``); None where nothing offloads."""
    retired: bool = False
    closed: bool = False

    @property
    def world_group(self) -> Optional[dist.ProcessGroup]:
        return self.topology.world_group

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self.topology.group

    @property
    def replica_group(self) -> Optional[dist.ProcessGroup]:
        return self.topology.replica_group

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def replica_rank(self) -> int:
        return self.topology.replica_rank

    @property
    def num_groups(self) -> int:
        return self.topology.num_groups


class _Planned(NamedTuple):
    specs: list[UnitSpec]
    shard_size: int
    host_memory: HostBudget
    frozen_only: list[UnitSpec]
    """Stage 3: frozen parameters in parts of their own (``unit_plan.frozen_only_specs``)."""


class _Placed(NamedTuple):
    placement: OptimizerHome
    wire: Wire
    store: Optional[ShardStore]
    layouts: list[UnitLayout]
    transient: dict[int, int]


def build(
    module: nn.Module,
    pol: Policies,
    *,
    param_dtype: torch.dtype,
    group: Optional[dist.ProcessGroup],
    device: Optional[torch.device],
    ranks_per_node: Optional[int],
    loss_scaling: bool,
) -> Parts:
    """The parts of an engine for ``module`` (see the module docstring for the steps)."""
    planned = _agree_and_plan(module, pol, param_dtype, group, ranks_per_node, loss_scaling)
    topo = hybrid.topology(planned.shard_size, pol.quantization, group)
    if rank_and_size(group)[0] == 0:
        for message in pol.ineffective:
            warnings.warn(f"ZeroConfig: {message}", stacklevel=3)
    scaling = pol.numerics.loss_scaling
    scaler = loss_scaler.from_policy(scaling) if scaling is not None else None
    # What can fail on one rank only (an NVMe path, its free space, the kernel build) fails on all ranks.
    sharded = frozenset(id(p) for spec in [*planned.specs, *planned.frozen_only] for p in spec.frozen)
    worker = HostWorker(threaded=pol.offload.speculative or pol.offload.asynchronous)
    with comm.agreed(group, "building the ZeRO engine"):
        where = target_device(module, device)
        frozen = _frozen_parts(module, planned, pol, topo, where) if sharded else None
        placed = _placement(planned, pol, topo, where, param_dtype, frozen.need if frozen else NO_FROZEN, worker)
    sync_replicated_state(module, where, group, sharded)
    gatherer = Gatherer(
        placed.wire, placed.placement, placed.store, where, worker, sync_persistent_on_build=topo.int8_weights
    )
    gatherer.frozen = frozen.gatherer if frozen is not None else None
    units = _units(module, planned, placed, gatherer, where, param_dtype, group, topo.rank, frozen)
    stage3, async_step, reducer = _hooks(module, pol, topo, placed, gatherer, units, where, param_dtype, frozen, worker)
    parts = Parts(
        module=module,
        policies=pol,
        param_dtype=param_dtype,
        topology=topo,
        device=where,
        host_memory=planned.host_memory,
        placement=placed.placement,
        gatherer=gatherer,
        units=units,
        reducer=reducer,
        stage3=stage3,
        worker=worker,
        async_step=async_step,
        loss_scaler=scaler,
        param_names=_names(module, units, frozen),
        frozen=frozen,
    )
    held = [*units, *(frozen.units if frozen is not None else ())]  # their working buffers are never offloaded
    parts.activations = activation_offload.install(
        module, pol.activations, where, lambda: [u.flat for u in held], planned.host_memory.activations
    )
    if where.type == "cuda":  # the module's own tensors left blocks the step's allocations rarely fit
        torch.cuda.empty_cache()
    return parts


def _agree_and_plan(
    module: nn.Module,
    pol: Policies,
    param_dtype: torch.dtype,
    group: Optional[dist.ProcessGroup],
    ranks_per_node: Optional[int],
    loss_scaling: bool,
) -> _Planned:
    """Every rank builds the same engine or raises the same error, before any collective (agreement.py)."""
    with BuildAgreement(group, dict(pol.settings)) as agreed:
        agreed.settings.update(
            shard_group_size=hybrid.given(pol.sharding.group_size, ranks_per_node),
            param_dtype=str(param_dtype),
            loss_scaling=str(loss_scaling),
        )
        shard_size = hybrid.shard_group_size(pol.sharding.group_size, rank_and_size(group)[1], ranks_per_node)
        activation_checkpoint.apply(module, pol.recompute)
        activation_offload.select(module, pol.activations.modules)  # what it names exists, before any collective
        stage3 = isinstance(pol.sharding.units, ModuleUnits)
        frozen = frozen_parts.shardable(module) if stage3 else []
        specs = unit_plan(module, trainable_parameters(module), pol.sharding.units, frozen)
        own = (
            frozen_only_specs(module, specs, frozen, pol.sharding.units)
            if isinstance(pol.sharding.units, ModuleUnits)
            else []
        )
        agreed.plan = describe_plan(module, [*specs, *own])
        host_memory = HostBudget(pol.offload, ranks_per_node)  # read before any rank allocates
    return _Planned(specs, shard_size, host_memory, own)


def _placement(
    planned: _Planned,
    pol: Policies,
    topo: Topology,
    device: torch.device,
    param_dtype: torch.dtype,
    frozen: FrozenNeed,
    worker: HostWorker,
) -> _Placed:
    layouts = plan_layouts(planned.specs, topo.world_size, topo.align(pol.quantization))
    placement = optimizer_home(
        pol.offload.optimizer, device, param_dtype, topo.rank, topo.world_size, layouts, worker, pol.offload.speculative
    )
    wire = make_wire(layouts, pol, topo, device, param_dtype, topo.group)
    transient = {i: wire.payload_numel(i) for i, spec in enumerate(planned.specs) if not spec.persistent}
    planned.host_memory.built(layouts, topo.rank, param_dtype, wire.payload_dtype, transient, placement, frozen)
    store = None
    if transient:
        store = shard_store(
            pol.offload.parameters,
            device,
            payload_dtype=wire.payload_dtype,
            payload_numels=transient,
            param_dtype=param_dtype,
            rank=topo.rank,
            quantized=pol.quantization.weights,
            master_on_device=placement.master_on_device,
            masters_may_move=placement.masters_may_move,
            alone=topo.world_size == 1,
        )
        placement.store_built(store)
    return _Placed(placement, wire, store, layouts, transient)


def make_wire(
    layouts: list[UnitLayout],
    pol: Policies,
    topo: Topology,
    device: torch.device,
    param_dtype: torch.dtype,
    group: Optional[dist.ProcessGroup],
) -> Wire:
    """How shards travel on ``group``: full width, or INT8 (``quantize_weights``)."""
    if not topo.int8_weights:
        return FullWidth(layouts, param_dtype, group)
    q = pol.quantization
    return Int8(
        layouts,
        param_dtype=param_dtype,
        rank=topo.rank,
        group=group,
        device=device,
        group_size=q.group_size,
        exact_numel=q.exact_numel,
        bucket_numel=q.gather_bucket_numel,
    )


def _units(
    module: nn.Module,
    planned: _Planned,
    placed: _Placed,
    gatherer: Gatherer,
    device: torch.device,
    param_dtype: torch.dtype,
    group: Optional[dist.ProcessGroup],
    rank: int,
    frozen: Optional[FrozenParts],
) -> list[Unit]:
    part = None
    if frozen is not None:
        index = {id(spec): k for k, spec in enumerate(s for s in [*planned.specs, *planned.frozen_only] if s.frozen)}
        codec = frozen.codec

        def part(spec: UnitSpec, held: list[nn.Parameter]) -> Unit:
            k = index[id(spec)]
            built = frozen_parts.build_part(
                k, held, codec.layouts[k], codec, module=spec.module, group=group, rank=rank
            )
            frozen.units.append(built)
            if not spec.params:  # a part of its own: stored and freed now (its unit's is freed with the unit)
                frozen.gatherer.free(built)
            return built

    units = build_units(
        module,
        planned.specs,
        placed.layouts,
        device=device,
        param_dtype=param_dtype,
        group=group,
        adopt_master=placed.placement.adopt_master,
        on_built=gatherer.adopt,
        shard_rank=rank,
        frozen_part=part,
        frozen_only=planned.frozen_only,
    )
    if frozen is not None:
        frozen.owner = {u.frozen.index: u for u in units if u.frozen is not None}
    return units


def _frozen_parts(
    module: nn.Module, planned: _Planned, pol: Policies, topo: Topology, device: torch.device
) -> FrozenParts:
    """The codec and gatherer of stage 3's frozen parts (built with their units, ``_units``)."""
    q = pol.quantization
    specs = [*planned.specs, *planned.frozen_only]
    held = [p for spec in specs for p in spec.frozen]
    compute = held[0].dtype
    storage = pol.sharding.units.frozen_dtype if isinstance(pol.sharding.units, ModuleUnits) else None
    layouts = frozen_parts.frozen_layouts(specs, topo.world_size, topo.align(q), storage, q.group_size)
    codec = FrozenCodec(
        storage,
        compute,
        layouts,
        rank=topo.rank,
        group=topo.group,
        device=device,
        on_host=not isinstance(pol.offload.parameters, OnDevice),
        group_size=q.group_size,
        exact_numel=q.exact_numel,
        bucket_numel=q.gather_bucket_numel,
    )
    if isinstance(pol.offload.parameters, Nvme) and topo.rank == 0 and rank_and_size(topo.world_group)[0] == 0:
        warnings.warn(
            "ZeroQ stage 3: frozen parameters rest in host memory with offload_params_device='nvme' (the "
            "trainable shards go to NVMe); count their bytes against the host's memory.",
            stacklevel=4,
        )
    # Frozen parts are never stepped: their gatherer's worker never has work (and never shares unit numbers).
    gatherer = Gatherer(
        codec,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        MasterAlias(),
        device,
        HostWorker(threaded=False),
        sync_persistent_on_build=False,
    )
    need = frozen_parts.need_of(planned.specs, codec, compute)
    return FrozenParts([], codec, gatherer, need)


def _names(module: nn.Module, units: list[Unit], frozen: Optional[FrozenParts]) -> dict[int, str]:
    names = {id(p): name for name, p in module.named_parameters()}  # after materialization
    for unit in units:
        for p in [*unit.params, *(unit.frozen.params if unit.frozen is not None else ())]:
            p.__dict__["_zeroq_name"] = names.get(id(p), "?")  # named in FreedParameter's errors
    own = [part for part in frozen.units if part.index not in frozen.owner] if frozen is not None else []
    for part in own:  # a part of its own: gathered only around its module's forward
        for p in part.params:
            p.__dict__["_zeroq_name"] = (
                f"{names.get(id(p), '?')} (frozen, sharded on its own; a model that reads it outside its module's "
                f"forward keeps it whole with stage3_param_persistence_threshold={p.numel()})"
            )
    return names


class _Hooks(NamedTuple):
    stage3: Optional[Stage3Coordinator]
    async_step: Optional[AsyncHostStep]
    reducer: Reducer


def _hooks(
    module: nn.Module,
    pol: Policies,
    topo: Topology,
    placed: _Placed,
    gatherer: Gatherer,
    units: list[Unit],
    device: torch.device,
    param_dtype: torch.dtype,
    frozen: Optional[FrozenParts],
    worker: HostWorker,
) -> _Hooks:
    """Stage 3's module hooks, the asynchronous host step and the gradient hooks, in that order."""
    stage3 = None
    own = [p for p in frozen.units if p.index not in frozen.owner] if frozen is not None else []
    if (placed.transient or own) and isinstance(pol.sharding.units, ModuleUnits):  # stage 3's module units
        stage3 = Stage3Coordinator(
            gatherer,
            units,
            prefetch_depth=pol.sharding.units.prefetch_depth,
            reshard_after_forward=pol.sharding.units.reshard_after_forward,
            names=_unit_names(module, units),
            frozen_only=own,
        )
    async_step = _async_step(module, pol, topo, placed, gatherer, units, device, param_dtype, worker)
    reducer = Reducer(
        units,
        gradients=placed.placement,
        sharding=pol.sharding,
        param_dtype=param_dtype,
        group=topo.world_group,  # the agreement on used parameters and non-finite gradients spans the world
        device=device,
        wire=topo.gradient_wire(device, pol.quantization.group_size),
        listener=stage3 if stage3 is not None else NoListener(),
    )
    return _Hooks(stage3, async_step, reducer)


def _unit_names(module: nn.Module, units: list[Unit]) -> dict[int, str]:
    """Each transient unit's name for messages: its module's qualified name (a module reached twice: the first)."""
    names: dict[int, str] = {}
    for name, m in module.named_modules():
        names.setdefault(id(m), name or type(m).__name__)
    return {u.index: names.get(id(u.module), type(u.module).__name__) for u in units if u.module is not None}


def _async_step(
    module: nn.Module,
    pol: Policies,
    topo: Topology,
    placed: _Placed,
    gatherer: Gatherer,
    units: list[Unit],
    device: torch.device,
    param_dtype: torch.dtype,
    worker: HostWorker,
) -> Optional[AsyncHostStep]:
    """With ``offload_async_step``, the host step beside the next forward (``offload/async_step.py``), on the
    host's worker, publishing on a process group of its own; else None (the host step runs in the step)."""
    host = host_part(placed.placement)
    if not pol.offload.asynchronous or host is None:
        return None
    own = comm.duplicate(topo.group, topo.world_group)  # the worker's collectives: a group of their own
    publisher = (
        gatherer
        if own is topo.group
        else Gatherer(
            make_wire(placed.layouts, pol, topo, device, param_dtype, own),
            placed.placement,
            placed.store,
            device,
            worker,
            sync_persistent_on_build=False,
        )
    )
    on_host = [u for u in units if not placed.placement.master_on_device(u.index)]
    return AsyncHostStep(
        host, worker, module, on_host, publisher.publish, device, own_group=None if own is topo.group else own
    )
