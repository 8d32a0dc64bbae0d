"""The engine's state by parameter name: the one door from checkpoints and exports into the engine.

**Sharded view** (``ShardedView(engine.parts, engine.optimizer)``; what ``lightning_zeroq/checkpoint`` reads and writes, and
all it uses of the engine). Every parameter the engine manages is a tensor of its full shape, and this
rank holds one contiguous range of it, flattened: a DTensor sharded on the flattened parameter, as
FSDP2 hands DCP one sharded on dim 0. A ``Part`` says so: global shape, dtype, this rank's flat
offset and count, and functions that read the range (1-D) or write it. A ``ParamView`` is one
parameter: every name of it (tied parameters have several; the first is canonical), its shape, its
param group, its ``part`` (None: no element on this rank), and its optimizer state alike: per-element
state (Adam's moments) is sharded as the parameter is; scalar state (Adam's ``step``) is the part of
the rank that holds the parameter's first element.

- ``params``: every managed parameter, unit by unit; ``groups()``: them by param group;
  ``unmanaged()``: the module's other ``state_dict()`` entries (buffers, frozen parameters);
  ``frozen_names()``: every name of a frozen parameter, sharded or whole; ``module``: the module the names are
  relative to.
- ``walk()``: reads of a ``Part`` in increasing ``order`` come after ``walk().ensure(order)`` (with
  NVMe offload one unit is resident at a time), and ``close()`` ends the walk.
- ``load(optimizer)``: yields batches of parameters that are resident now; the caller writes their
  parts, and the view publishes each batch (the engine's collectives) before the next.
- ``group_names()``: collective, every param group's parameter names from all ranks.

**Full state** (exports, tests, single-file checkpoints):

- ``full_state_dict``: collective; the full fp32 parameters by name (CPU tensors), gathered unit by
  unit from the master shards, on every rank or (``rank0_only``) on rank 0 only, whose host then
  holds one copy of the model and no rank ever holds two; frozen parameters are included as they are.
- ``load_full_state_dict``: every rank sets its own slice of each master from full parameters by name,
  then republishes the working weights (no other collective).
- ``full_optimizer_state``: collective, every parameter's optimizer state at full shape.
- Every walk over the masters goes through the placement's ``resident`` iterator (NVMe: one unit at a time).
- A read of the masters (a save, ``full_state_dict``) first takes what was written into the working
  weights since the last step, where the masters can (``full_params.take_writes``: fp32), so it reads what
  the module holds, as DDP's would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq.ranks import is_distributed
from lightning_zeroq.zero import comm, full_params
from lightning_zeroq.zero.build import Parts
from lightning_zeroq.zero.loss_scaler import DynamicLossScaler
from lightning_zeroq.zero.offload.device import OptimizerHome
from lightning_zeroq.zero.offload.nvme import per_element_state_keys
from lightning_zeroq.zero.policies import Nvme
from lightning_zeroq.zero.unit import Unit


class ShardedParts(Protocol):
    """What the checkpoint door sees of an engine (``ZeroEngine`` provides it): its built ``parts``
    (read through ``ShardedView`` and the functions below), its optimizer, loss scaler and step count."""

    parts: Parts
    steps: int  # optimizer steps counted (a resumed run counts on from its checkpoint's global step)

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]: ...

    @property
    def loss_scaler(self) -> Optional[DynamicLossScaler]: ...


KERNEL_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})
"""Param-group entries that choose how the step runs, not what it computes: they belong to this run
(the offload placement sets ``fused`` for the host step), so a load keeps the live ones. Copying a
checkpoint's would, e.g., turn on a fused CPU kernel that the device has not (fused Adagrad on CUDA)."""


@dataclass(eq=False)
class Part:
    """This rank's range ``[offset, offset + numel)`` of a tensor of ``shape``, flattened."""

    shape: torch.Size
    dtype: torch.dtype
    offset: int
    numel: int
    order: int
    """Its unit: read it after ``walk().ensure(order)``, in increasing order."""
    read: Callable[..., Tensor]
    """The range as a 1-D tensor (the engine's own memory: copy it before the walk goes on). The three
    functions take no argument but ``write``'s value (typed ``...``: mypy cannot match default-argument
    lambdas)."""
    buffer: Callable[..., Tensor]
    """A 1-D tensor a load may fill and hand to ``write`` (the master itself: no copy)."""
    write: Callable[..., None]
    """Takes the range (1-D, ``numel`` elements)."""


@dataclass(eq=False)
class ParamView:
    names: list[str]
    shape: torch.Size
    group: Optional[int]
    """Its param group in the engine's optimizer (None: no part here, or not optimized)."""
    part: Optional[Part]
    _view: Optional[Tensor] = None  # the master segment the optimizer steps
    _optimizer: Optional[torch.optim.Optimizer] = None
    _step_device: torch.device = torch.device("cpu")
    _loaded: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.names[0]

    def state(self) -> dict[str, Any]:
        """This rank's optimizer state: per-element keys as ``Part``s, scalar ones (held by the rank of the
        first element) as values."""
        if self._optimizer is None or self._view is None or self.part is None:
            return {}
        out: dict[str, Any] = {}
        per_element = per_element_keys(self._optimizer)
        for key, value in self._optimizer.state.get(self._view, {}).items():
            if key in per_element:
                out[key] = self.state_part(key, value.dtype)
            elif self.part.offset == 0:
                out[key] = value.detach().clone() if isinstance(value, Tensor) else value
        return out

    def state_part(self, key: str, dtype: torch.dtype = torch.float32) -> Part:
        """Per-element state ``key`` of this parameter on this rank (``load``: written with its batch)."""
        assert self.part is not None and self._view is not None and self._optimizer is not None
        optimizer, view = self._optimizer, self._view
        return Part(
            self.shape,
            dtype,
            self.part.offset,
            self.part.numel,
            self.part.order,
            read=lambda: optimizer.state[view][key],
            buffer=lambda: torch.empty(view.numel(), dtype=torch.float32, device=view.device),
            write=lambda value: self._loaded.__setitem__(key, value),
        )

    def write_scalar(self, key: str, value: Any) -> None:
        """Scalar state ``key`` (``load``: written with its batch; floating tensors where the step reads them)."""
        if isinstance(value, Tensor) and value.is_floating_point():
            value = value.to(dtype=torch.float32, device=self._step_device)
        self._loaded[key] = value


class Walk:
    """Walks ``placement.resident`` lazily: ``ensure(i)`` makes unit ``i`` resident (units in
    increasing index only), ``close()`` finishes the walk (NVMe writes the last units back)."""

    def __init__(self, parts: Parts) -> None:
        full_params.take_writes(parts)  # a write into the weights since the last step is in what is saved (fp32)
        self._walk = parts.placement.resident(parts.units)
        self.current = -1

    def ensure(self, index: int) -> None:
        while self.current < index:
            self.current = next(self._walk).index
        assert self.current == index, f"unit {index} requested after unit {self.current}"

    def close(self) -> None:
        for _ in self._walk:
            pass


class ShardedView:
    """See the module docstring."""

    def __init__(self, parts: Parts, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self._parts = parts
        self.module = parts.module
        """The module whose state this is: every name here is relative to it."""
        self.rank, self.world_size, self.job_world_size = (
            parts.rank,
            parts.world_size,
            parts.world_size * parts.num_groups,
        )
        self.optimizer = optimizer
        self.closed = parts.closed
        """The engine released its shards (a new fit replaced it): there is nothing to save."""
        self.stable = not isinstance(parts.policies.offload.optimizer, Nvme)
        """What a read returns keeps its contents while the walk goes on (NVMe reuses its buffers)."""
        self.pin = parts.device.type == "cuda" and torch.cuda.is_available()
        self.stage = parts.policies.sharding.stage
        names = unit_parameter_names(parts)
        groups = {}
        if self.optimizer is not None:
            groups = {id(v): g for g, group in enumerate(self.optimizer.param_groups) for v in group["params"]}
        self.params: list[ParamView] = []
        self._unit_params: list[list[ParamView]] = []
        for unit in parts.units:
            views = {seg.param: (seg, view) for seg, view in zip(unit.segments, unit.segment_masters)}
            self._unit_params.append([])
            for i, p in enumerate(unit.params):
                pv = ParamView(names[id(p)], p.shape, None, None)
                if i in views:
                    seg, view = views[i]
                    pv.part = Part(
                        p.shape,
                        torch.float32,
                        seg.param_start,
                        seg.numel,
                        unit.index,
                        read=lambda u=unit, s=seg: u.master[s.shard_span],
                        buffer=lambda u=unit, s=seg: u.master[s.shard_span],
                        write=lambda value, u=unit, s=seg: _copy_into(u.master[s.shard_span], value),
                    )
                    pv.group, pv._view, pv._optimizer = groups.get(id(view)), view, self.optimizer
                    if pv.group is not None:
                        assert self.optimizer is not None
                        group = self.optimizer.param_groups[pv.group]
                        fused = group.get("fused") or group.get("capturable")
                        pv._step_device = view.device if fused else torch.device("cpu")
                    self._unit_params[-1].append(pv)
                self.params.append(pv)
        self.frozen: list[ParamView] = []
        """Stage 3's frozen parameters (``frozen.py``): this rank's range of each, in its own dtype; no group."""
        self._decoded: dict[int, Tensor] = {}
        for part in full_params.frozen_parts(parts):  # (once handed back, the module holds them whole)
            mine = {seg.param: seg for seg in part.segments}
            for i, p in enumerate(part.params):  # every parameter, in the same order on every rank
                pv = ParamView(names[id(p)], p.shape, None, None)
                here = mine.get(i)
                if here is not None:
                    pv.part = Part(
                        p.shape,
                        part.flat.dtype,
                        here.param_start,
                        here.numel,
                        -1,
                        read=lambda u=part, s=here: self._frozen_shard(u)[s.shard_span],
                        buffer=lambda u=part, s=here: self._frozen_shard(u)[s.shard_span],
                        write=lambda value, u=part, s=here: _copy_into(self._frozen_shard(u)[s.shard_span], value),
                    )
                self.frozen.append(pv)
        self.params[:0] = self.frozen  # first: a walk's order (their ``Part.order`` is -1)
        self._by_view = {id(pv._view): pv for pv in self.params if pv._view is not None}
        self.managed = {n for pv in self.params for n in pv.names}

    def _frozen_shard(self, part: Unit) -> Tensor:
        """This rank's shard of a frozen part as the parameters hold it: the stored shard itself where it holds
        their values exactly (on the device or the host), else one decoded copy (kept until ``load`` stores it)."""
        assert self._parts.frozen is not None
        codec = self._parts.frozen.codec
        if codec.exact:
            return part.master
        if part.index not in self._decoded:
            self._decoded[part.index] = codec.decode(part)
        return self._decoded[part.index]

    def frozen_written(self) -> None:
        """The frozen parts' ranges were written (a load): stored (a decoded copy encoded again), and every
        frozen part freed, so its next gather reads them; a module already handed back takes them (collective)."""
        frozen = self._parts.frozen
        if frozen is None:
            return
        for part in full_params.frozen_parts(self._parts):
            if part.index in self._decoded:
                frozen.codec.store(part, self._decoded.pop(part.index))
            frozen.gatherer.free(part)

    def unmanaged(self) -> dict[str, Any]:
        """The module's ``state_dict()`` entries the engine does not shard (buffers, frozen parameters)."""
        return {
            k: v.detach() if isinstance(v, Tensor) else v
            for k, v in self._parts.module.state_dict(keep_vars=True).items()
            if k not in self.managed
        }

    def state_dict_keys(self) -> list[str]:
        return list(self._parts.module.state_dict(keep_vars=True))

    def frozen_names(self) -> list[str]:
        """Every name of every frozen parameter (``requires_grad=False``) of the module, in its order: stage 3's
        frozen parts and the frozen parameters kept whole alike (what ``exclude_frozen_parameters`` leaves out)."""
        return [n for n, p in self._parts.module.named_parameters(remove_duplicate=False) if not p.requires_grad]

    def groups(self) -> list[list[ParamView]]:
        """This rank's parameters by param group, in the optimizer's order."""
        if self.optimizer is None:
            return []
        return [[self._by_view[id(v)] for v in group["params"]] for group in self.optimizer.param_groups]

    def group_names(self) -> list[list[str]]:
        """Collective on the engine's group: every param group's canonical names, gathered from all ranks,
        in the module's order."""
        local = [[pv.name for pv in group] for group in self.groups()]
        everyone: list[Any] = [local]
        if is_distributed() and self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, local, group=self._parts.group)
        order = {n: i for i, (n, _) in enumerate(self._parts.module.named_parameters())}
        return [
            sorted({n for ranks in everyone for n in ranks[g]}, key=lambda n: order.get(n, len(order)))
            for g in range(len(local))
        ]

    def per_element_keys(self) -> set[str]:
        return per_element_keys(self.optimizer) if self.optimizer is not None else set()

    def walk(self) -> Walk:
        return Walk(self._parts)

    @torch.no_grad()
    def load(self, optimizer: bool) -> Iterator[list[ParamView]]:
        """Batches of parameters resident now (every unit at once, or with NVMe one unit at a time); the
        caller writes their parts (and, with ``optimizer``, their state: the rest is cleared), then
        asks for the next batch, and the view publishes this one: every rank walks the same batches."""
        parts = self._parts
        target = self.optimizer if optimizer else None
        if target is not None:
            target.state.clear()
            parts.placement.state_loaded(target)  # before the walk: NVMe writes the new state as it goes
        if self.frozen:  # the frozen parts first (their ``Part.order`` is -1): they rest where they are
            yield [pv for pv in self.frozen if pv.part is not None]
            self.frozen_written()
        at_once = type(parts.placement).resident is OptimizerHome.resident
        batch: list[Unit] = []
        for unit in parts.placement.resident(parts.units):
            batch.append(unit)
            if not at_once:
                yield from self._publish_after(batch, target)
                batch = []
        if batch:
            yield from self._publish_after(batch, target)

    def _publish_after(
        self, units: list[Unit], optimizer: Optional[torch.optim.Optimizer]
    ) -> Iterator[list[ParamView]]:
        params = [pv for unit in units for pv in self._unit_params[unit.index]]
        yield params
        for unit in units:
            for pv in self._unit_params[unit.index]:
                if pv._loaded and optimizer is not None and pv._view is not None:
                    optimizer.state[pv._view] = pv._loaded
                pv._loaded = {}
            full_params.publish_loaded(self._parts, unit)

    def set_hyperparameters(self, param_groups: list[dict]) -> None:
        """A checkpoint's param-group entries, but for ``params`` and this run's ``KERNEL_CHOICES``."""
        assert self.optimizer is not None
        for group, saved in zip(self.optimizer.param_groups, param_groups):
            group.update({k: v for k, v in saved.items() if k != "params" and k not in KERNEL_CHOICES})


def _copy_into(target: Tensor, value: Tensor) -> None:
    if value.data_ptr() != target.data_ptr():
        target.copy_(value)


def per_element_keys(optimizer: torch.optim.Optimizer) -> set[str]:
    cached = getattr(optimizer, "_zeroq_per_element_keys", None)
    if cached is None:
        cached = set(per_element_state_keys(optimizer))
        optimizer._zeroq_per_element_keys = cached  # type: ignore[attr-defined]
    return cached


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name of it (tied parameters have several; the first is canonical, as
    ``named_parameters()`` and ``get_optimizer_state_dict`` use it)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def unit_parameter_names(parts: Parts) -> dict[int, list[str]]:
    """``parameter_names`` for checkpoints: every parameter of every unit must have a name (units and
    the module share their ``nn.Parameter`` objects; replacing them would lose the link)."""
    names = parameter_names(parts.module)
    lost = [(u.index, i) for u in parts.units for i, p in enumerate(u.params) if id(p) not in names]
    if lost:
        raise RuntimeError(
            f"{len(lost)} parameter(s) of the engine's units (unit, index: {lost[:4]}) are no longer "
            "parameters of the module (were they replaced?); their checkpoint names are unknown."
        )
    return names


@torch.no_grad()
def full_state_dict(parts: Parts, rank0_only: bool = False) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    if rank0_only and parts.replica_rank != 0:
        return {}  # hybrid groups: the first group gathers; the others hold the same values
    names = parameter_names(parts.module)
    root = dist.get_global_rank(parts.group, 0) if parts.group is not None and parts.world_size > 1 else 0
    full_params.take_writes(parts)  # a write into the weights since the last step is in what is read (fp32)
    for unit in parts.placement.resident(parts.units):
        shard = parts.placement.device_master(unit)
        if rank0_only and parts.world_size > 1:
            chunks = [torch.empty_like(shard) for _ in range(parts.world_size)] if parts.rank == 0 else None
            dist.gather(shard, chunks, dst=root, group=parts.group)
            if parts.rank != 0:
                continue
            assert chunks is not None  # rank 0 made them
            full = torch.cat(chunks).cpu()
            del chunks
        else:
            full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=parts.device)
            comm.all_gather(full, shard, parts.group)
            full = full.cpu()
        for i, p in enumerate(unit.params):
            value = full[unit.layout.slots[i].span].view(p.shape).clone()
            for name in names.get(id(p), []):
                out[name] = value
        del full
    for part in full_params.frozen_parts(parts):  # gathered as a forward gathers them (collective)
        was = full_params.frozen_gather(parts, part)
        if not rank0_only or parts.rank == 0:
            for p, slot in zip(part.params, part.layout.slots):
                value = part.flat[slot.span].view(p.shape).float().cpu().clone()
                for name in names.get(id(p), []):
                    out[name] = value
        full_params.frozen_release(parts, part, was)
    if rank0_only and parts.rank != 0:
        return {}
    for name, p in parts.module.named_parameters(remove_duplicate=False):
        if name not in out:
            out[name] = p.detach().float().cpu().clone()
    return out


@torch.no_grad()
def load_full_state_dict(parts: Parts, state: dict[str, Tensor]) -> set[str]:
    """Returns the names of the engine's parameters (all aliases of tied ones). Every value found for
    one of them must have the parameter's shape (as ``nn.Module.load_state_dict`` requires, strict or
    not): a mismatch raises, naming each parameter and both shapes, before any master changes."""
    every_name = parameter_names(parts.module)
    frozen = [p for part in (parts.frozen.units if parts.frozen is not None else []) for p in part.params]
    managed: set[str] = set()
    mismatched = []
    for p in [*(p for u in parts.units for p in u.params), *frozen]:
        names = every_name.get(id(p), [])
        managed.update(names)
        mismatched += [
            f"{n}: checkpoint {tuple(state[n].shape)}, parameter {tuple(p.shape)}"
            for n in names
            if n in state and tuple(state[n].shape) != tuple(p.shape)
        ]
    if mismatched:
        raise RuntimeError(
            "Error loading the state_dict: size mismatch for "
            + "; ".join(mismatched)
            + ". The checkpoint belongs to a model of another shape; build the model it was saved from."
        )

    def found(p: Tensor) -> Optional[str]:
        return next((n for n in every_name.get(id(p), []) if n in state), None)

    for unit in parts.placement.resident(parts.units):
        for seg in unit.segments:
            name = found(unit.params[seg.param])
            if name is not None:
                unit.master[seg.shard_span].copy_(state[name].reshape(-1)[seg.param_span])
        full_params.publish_loaded(parts, unit)
    if parts.retired:  # handed back: the module holds its frozen parameters whole
        for p in frozen:
            name = found(p)
            if name is not None:
                p.data.copy_(state[name].reshape(p.shape))
    elif any(found(p) is not None for p in frozen):
        view = ShardedView(parts, None)
        for pv in view.frozen:
            name = next((n for n in pv.names if n in state), None)
            if name is not None and pv.part is not None:
                pv.part.write(state[name].reshape(-1)[pv.part.offset : pv.part.offset + pv.part.numel])
        view.frozen_written()
    return managed


def load_module_state_dict(parts: Parts, module: nn.Module, state: dict[str, Tensor]) -> tuple[list, list]:
    """``module.load_state_dict(state, strict=False)`` for a module whose parameters the engine
    manages: the engine's parameters go into the masters (shapes checked, see ``load_full_state_dict``),
    the rest (buffers, frozen parameters) into the module. Returns (missing, unexpected) keys as
    ``nn.Module.load_state_dict`` names them."""
    managed = load_full_state_dict(parts, state)
    missing, unexpected = module.load_state_dict({k: v for k, v in state.items() if k not in managed}, strict=False)
    return [k for k in missing if k not in managed] + sorted(k for k in managed if k not in state), list(unexpected)


def full_optimizer_state(parts: Parts, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, dict[str, Any]]:
    """Collective (tests, exports): every parameter's optimizer state at full shape on every rank."""
    assert optimizer is not None
    names = parameter_names(parts.module)
    per_element = per_element_keys(optimizer)
    local: dict[str, dict[str, Any]] = {}
    for unit in parts.placement.resident(parts.units):
        for seg, view in zip(unit.segments, unit.segment_masters):
            name = names[id(unit.params[seg.param])][0]
            for key, value in optimizer.state.get(view, {}).items():
                entry = local.setdefault(name, {})
                if key in per_element:
                    entry.setdefault(key, []).append((seg.param_start, value.detach().cpu().clone()))
                else:
                    entry[key] = value.detach().cpu().clone() if isinstance(value, Tensor) else value
    everyone: list[Any] = [local]
    if is_distributed() and parts.world_size > 1:
        everyone = [None] * parts.world_size
        dist.all_gather_object(everyone, local, group=parts.group)
    shapes = {names[id(p)][0]: p.shape for u in parts.units for p in u.params}
    out: dict[str, dict[str, Any]] = {}
    for rank_state in everyone:
        for name, entry in rank_state.items():
            merged = out.setdefault(name, {})
            for key, value in entry.items():
                if key in per_element:
                    full = merged.setdefault(key, torch.zeros(shapes[name]))
                    for start, part in value:
                        full.view(-1)[start : start + part.numel()] = part
                else:
                    merged[key] = value
    return out
