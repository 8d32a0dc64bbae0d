"""What a configuration needs before launch, from the model alone: device, host and disk bytes per
rank, whether it fits a machine, and a first-order step time (``lightning_zeroq.plan``, ``zeroq-plan``).

The model is built on the meta device (shapes, no memory: a 70B model plans on a laptop). For each
candidate ``ZeroConfig``:

- *Device bytes* (peak allocated; reserved, which decides whether it fits, as a factor over it) are
  the engine's own kinds (``ZeroEngine.memory_report``), computed from the unit
  layouts the engine would make for that configuration (``unit_plan.unit_plan``, ``unit.plan_layouts``): fp32
  masters and optimizer state of the units stepped on the device, the working weights of the
  persistent units, the stored shards of stage 3's transient units; then the largest of three moments
  of the step (``phases``): the loss's backward (every activation autograd saves, traced in one forward
  on the meta device with attention and RMSNorm counted as their CUDA kernels save them, and the two
  gradients of the largest of them, the loss's input, coming in and going out; no transient unit is
  gathered then), a block's backward (two of the largest transient unit gathered, its gradients, the
  activations less the loss's input, the block being recomputed) and the step (the fp32 gradient
  shards and the optimizer's temporaries). With activation checkpointing of the repeated blocks, their
  saved tensors become each block's input, plus one block's own while it is recomputed.
- *Host bytes* are what the engine's host check counts (``zero/memory/host.py``), the same
  functions, so the plan and the check before launch agree.
- *Disk bytes*: the swap files of NVMe offload (master and state of the swapped units; stage-3
  payloads).
- *Step time*: compute (6 x parameters x tokens, 8 x with checkpointing) at an achieved matmul rate,
  plus the host step (elements per second), NVMe traffic (read and write of the swapped state) and
  what crosses PCIe beyond the compute. A first-order model from given figures (``Machine``); the
  measured side lives in the benchmarks.

Hybrid sharding (``shard_group_size``: shards within groups of that many ranks) and INT8 weights (a
transient unit's stored payload is its INT8 groups and their scales) are laid out as the engine lays
them out (``_shards``); what they change in the collectives' time is not planned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.planning import calibrate
from lightning_zeroq.zero import hybrid
from lightning_zeroq.zero.activation_offload import BLOCKS_IN_FLIGHT
from lightning_zeroq.zero.frozen import FrozenNeed, frozen_need, shardable
from lightning_zeroq.zero.layout import ALIGN, UnitLayout
from lightning_zeroq.zero.memory.device import device_kinds, units_off_device
from lightning_zeroq.zero.memory.host import ACTIVATIONS, activations_host_bytes, engine_need, optimizer_need
from lightning_zeroq.zero.offload import host_units
from lightning_zeroq.zero.policies import ModuleUnits, Nvme, OnDevice, Policies, activation_mix, from_config
from lightning_zeroq.zero.unit import plan_layouts, trainable_parameters
from lightning_zeroq.zero.unit_plan import UnitSpec, frozen_only_specs, repeated_blocks, unit_plan
from lightning_zeroq.zero.wire import Int8

GIB = 2**30
log = logging.getLogger("lightning_zeroq")
DEVICE_STEP_BYTES = 88
"""Bytes of device memory traffic per element of torch's multi-tensor (foreach) AdamW, its default on a
GPU, in eight passes (decay 8, first moment 12, second moment 8 + 12, its square root 8, divided 8,
plus eps 8, the update 16) and the publish's working copy (6): the ``device_bytes_per_s`` it runs at."""


@dataclass(frozen=True)
class Machine:
    """What one rank has, and the rates the step time is figured from (achieved, not peak)."""

    device_bytes: Optional[int] = None
    host_bytes: Optional[int] = None
    """Host memory for all ranks of one node (``ranks_per_node`` of them)."""
    nvme_bytes: Optional[int] = None
    ranks_per_node: int = 1
    matmul_flops: float = 400e12
    host_step_elements_per_s: float = 5.0e9
    pcie_bytes_per_s: float = 40e9
    nvme_bytes_per_s: float = 3e9
    reserved_per_allocated: float = 1.205
    reserved_overhead_bytes: int = int(0.68 * GIB)
    """The caching allocator's reserve (what decides whether it fits) as ``reserved_per_allocated`` times
    the peak allocated plus this: fitted to the 34 runs of two days on one H200 (the 17 configurations
    of ``docs/plan.md`` measured twice), each within 10%."""
    runtime_host_bytes: int = 0
    """Host memory of a process's CUDA runtime and libraries, beside what the engine puts there
    (``zeroq-plan`` on a GPU machine: 0.6 GiB, as measured with torch 2.11; planned with the rest)."""
    device_bytes_per_s: float = 3e12
    """The device's memory bandwidth (read and write together): its optimizer step moves
    ``DEVICE_STEP_BYTES`` per element stepped there."""
    device_workspace_bytes: int = 64 << 20
    """Device memory allocated throughout beside the engine's and the model's: the CUDA libraries'
    workspaces (cuBLAS) and the step's small tensors (measured: 0.06-0.07 GiB in each of the 17 runs of
    ``docs/plan.md``)."""
    block_seconds: Optional[tuple[float, float]] = None
    """One repeated block's forward, and forward plus backward, timed on the device at the planned
    micro-batch (``calibrate.block_seconds``); None: the blocks' compute from ``matmul_flops``."""


class ForwardError(ValueError):
    """A forward given to the plan returned no loss, or the like: its message is worded for the user."""


@dataclass(frozen=True)
class Activations:
    """Bytes autograd saves in one forward (deduplicated storages, parameters excluded)."""

    total: int
    in_blocks: int
    """Of ``total``, saved inside the repeated blocks."""
    block_inputs: int
    """The blocks' inputs: what checkpointing the blocks saves instead."""
    largest_block: int
    """The most one block saves (held again while it is recomputed)."""
    largest: int = 0
    """The largest single tensor saved (the loss's input, in a language model: its gradient is made
    as the backward starts, beside every activation)."""
    block_call: Any = field(default=None, compare=False, repr=False)
    """``(args, kwargs)`` of the first block's call (meta tensors): what ``calibrate.block_seconds`` times
    a real block on."""
    blocks: int = 0
    """How many repeated blocks."""
    block_numel: int = 0
    """Their parameters' elements, together."""
    tokens: int = 0
    """The token ids the forward feeds: the elements of the first integer tensor a module with parameters
    is called with (0: none)."""
    self_checkpointed: bool = False
    """Every repeated block saves no more than its input: the model recomputes them itself (checkpointing
    them again saves nothing, and what a block holds while recomputed is not traced)."""

    def with_checkpointing(self, share: float = 1.0) -> int:
        """Saved when ``share`` of the blocks recompute: they keep only their inputs (a block's own are
        held again while it is recomputed: ``largest_block``, at a block's backward)."""
        if share <= 0:
            return self.total
        return int(self.total - share * (self.in_blocks - self.block_inputs))

    def mixed(self, recompute: float, offload: float = 0.0, inputs_on_host: bool = False) -> tuple[int, int, int]:
        """``(kept on the device, moved to the host, in flight)`` bytes when the blocks ``policies.activation_mix``
        picks for ``offload`` keep their saved tensors on the host, those it picks for ``recompute`` recompute
        (with ``inputs_on_host`` their inputs on the host: DeepSpeed's ``cpu_checkpointing``) and the rest keep
        theirs. Each block counts as the average block; in flight: ``BLOCKS_IN_FLIGHT`` blocks' moved bytes
        (copied out behind the forward, or brought back ahead of the backward)."""
        if (offload <= 0 and not inputs_on_host) or not self.blocks:
            return self.with_checkpointing(recompute), 0, 0
        offloaded, recomputed = activation_mix(self.blocks, offload, recompute)
        block, first = self.in_blocks / self.blocks, self.block_inputs / self.blocks
        moved = len(offloaded) * block + (len(recomputed) * first if inputs_on_host else 0)
        kept = self.total - len(recomputed) * (block - first) - moved
        flight = BLOCKS_IN_FLIGHT * (block if offloaded else first if moved else 0)
        return int(kept), int(moved), int(flight)


@dataclass(frozen=True)
class Need:
    """One candidate's plan, per rank."""

    name: str
    config: ZeroConfig
    checkpointing: float
    """The share of the repeated blocks that recompute (0: none, 1: all)."""
    device: dict[str, int]
    host: dict[str, int]
    nvme: int
    step_s: float
    fits: bool
    why: str
    """What does not fit (empty when it fits)."""

    reserved: int = 0
    """The device bytes the allocator is predicted to reserve (``Machine.reserved_per_allocated``)."""
    device_checked: bool = True
    """Whether the device's memory was known (``Machine.device_bytes``): where not, ``fits`` says only that
    the host and the disk fit."""
    tokens: int = 0
    """The tokens per micro-batch and rank the step time counts."""
    traced: Optional[Activations] = field(default=None, compare=False, repr=False)
    """What the forward saved, as traced (shared by every configuration of one plan)."""
    offloading: float = 0.0
    """The share of the repeated blocks whose saved tensors wait on the host (``activation_offloading_policy``)."""
    inputs_on_host: bool = False
    """The recomputing blocks keep their checkpoint inputs on the host."""

    @property
    def device_total(self) -> int:
        return peak_allocated(self.device)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def describe(machine: Machine) -> str:
    """The rates in one line."""
    block = (
        f"one block {machine.block_seconds[0] * 1e3:.2f} ms forward, {machine.block_seconds[1] * 1e3:.2f} ms "
        "forward+backward, "
        if machine.block_seconds
        else ""
    )
    return (
        f"{block}matmul {machine.matmul_flops / 1e12:.0f} TFLOP/s, device memory "
        f"{machine.device_bytes_per_s / 1e12:.2f} TB/s, host step {machine.host_step_elements_per_s / 1e9:.2f}e9 "
        f"elements/s, PCIe {machine.pcie_bytes_per_s / 1e9:.1f} GB/s, disk {machine.nvme_bytes_per_s / 1e9:.2f} GB/s"
    )


TRANSIENT = (
    "activations",
    "loss_gradients",
    "loss_input",
    "gathered_units",
    "unit_gradients",
    "recomputed_block",
    "gradient_shards",
    "step_temporaries",
    "offload_in_flight",
)
"""The kinds held only at some moments of the step (``phases``); the others are held throughout."""


def phases(device: dict[str, int]) -> dict[str, int]:
    """The device bytes allocated at the three moments of a step that can peak:

    - the loss's backward: every activation, and the loss input's gradients coming in and going out
      (a cross-entropy's log-softmax backward holds its saved output, its incoming gradient and the one
      it makes, each the size of the logits in fp32); the forward has freed its last transient unit and
      the backward gathers its first after this;
    - a block's backward: two of the largest transient unit gathered (the one in use, the one ahead), its
      gradients in the working dtype, the activations less the loss's input (freed by then), and with
      checkpointing the block being recomputed;
    - the step: the fp32 gradient shards and the optimizer's temporaries.

    With activation offload, both backward moments also hold what is in flight (``Activations.mixed``).
    """
    held = sum(v for k, v in device.items() if k not in TRANSIENT)
    flight = device.get("offload_in_flight", 0)  # activation offload: a block's copies on their way
    return {
        "loss backward": held + device["activations"] + device["loss_gradients"] + flight,
        "block backward": held
        + device["gathered_units"]
        + device["unit_gradients"]
        + device["activations"]
        - device["loss_input"]
        + device["recomputed_block"]
        + flight,
        "step": held + device["gradient_shards"] + device.get("step_temporaries", 0),
    }


def peak_allocated(device: dict[str, int]) -> int:
    """The peak of ``device``'s kinds: the largest of ``phases``."""
    return max(phases(device).values())


def _flash_like(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Attention's memory as a flash kernel has it: saves q, k, v, the output and an fp32 row statistic."""
    stat = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    return _Saves.apply(q, k, v, stat)


class _Saves(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, stat: Tensor) -> Tensor:
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, stat)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _fused_rms_norm(x: Tensor, normalized_shape: Any, weight: Optional[Tensor] = None, eps: Any = None) -> Tensor:
    """RMSNorm's memory as CUDA's fused kernel (``aten::_fused_rms_norm``) has it: one kernel scales by the
    weight too, and its backward keeps the input, one fp32 statistic per row and the weight (decomposed, as
    on the meta device and the CPU, it would also save the normalized input before the weight's product,
    and fp32 intermediates)."""
    rows = x.shape[: x.dim() - len(tuple(normalized_shape))]
    stat = torch.empty(*rows, 1, dtype=torch.float32, device=x.device)
    return _Norm.apply(x, stat, weight)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, stat: Tensor, weight: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(x, stat, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, Optional[Tensor]]:
        weight = ctx.saved_tensors[2]
        return torch.empty_like(grad), None, None if weight is None else torch.empty_like(weight)


@contextlib.contextmanager
def _cuda_kernels() -> Iterator[None]:
    """Attention and RMSNorm saving for backward what their CUDA kernels save."""
    real = F.scaled_dot_product_attention, F.rms_norm
    F.scaled_dot_product_attention, F.rms_norm = _flash_like, _fused_rms_norm  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.rms_norm = real


class _LossRead(BaseException):
    """The traced step read its loss's value: the trace ends there (a ``BaseException``, so that a step's own
    ``except Exception`` does not go on past it)."""


class _MetaTrace(TorchFunctionMode):
    """What a trace runs under: a tensor of another device that meets a meta tensor in an op is moved to
    the meta device (a forward may build its inputs anywhere), and reading the value of the loss (``.item()``,
    ``float()`` of a scalar that autograd tracks: a ``training_step`` logging its loss) ends the trace there
    (``_LossRead``): the forward has run, and nothing after the read (a list the step appends to, a counter)
    runs with a value the meta device does not hold. Any other read of a value (an integer count, a
    condition) fails as it would without it."""

    READS = (Tensor.item, Tensor.__float__)

    def __init__(self) -> None:
        super().__init__()
        self.moved: dict[int, tuple[Tensor, Tensor]] = {}  # id -> (the tensor, its meta copy)

    def _meta(self, t: Tensor) -> Tensor:
        if id(t) not in self.moved:
            self.moved[id(t)] = (t, t.to("meta"))
        return self.moved[id(t)][1]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            func in self.READS
            and args
            and isinstance(args[0], Tensor)
            and args[0].is_meta
            and args[0].is_floating_point()
            and args[0].dim() == 0
            and args[0].grad_fn is not None
        ):
            raise _LossRead
        flat, spec = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, Tensor)]
        if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
            args, kwargs = tree_unflatten(
                [self._meta(t) if isinstance(t, Tensor) and not t.is_meta else t for t in flat], spec
            )
        return func(*args, **kwargs)


def trace_activations(
    model: nn.Module, forward: Callable[[nn.Module], Tensor], blocks: Sequence[nn.Module]
) -> Activations:
    """Run ``forward(model)`` (the model on the meta device; the loss or the output) once and count what
    autograd saves, in total and per block of ``blocks`` (the repeated blocks), and the token ids it feeds:
    the elements of the first integer tensor a module with parameters is called with (``_MetaTrace``: inputs
    built on another device are moved to the meta device; a read of the loss's value ends the trace)."""
    parameters = {id(p.untyped_storage()) for p in model.parameters()}
    saved: dict[int, tuple[Any, int, int]] = {}  # storage id -> (storage, bytes, block index or -1)
    current = [-1]

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if id(storage) not in parameters and id(storage) not in saved:
            saved[id(storage)] = (storage, storage.nbytes(), current[0])
        return t

    inputs: dict[int, int] = {}  # block index -> the bytes of its input
    calls: list[Any] = []
    tokens: list[int] = []
    hooks = []
    for i, block in enumerate(blocks):

        def enter(module: nn.Module, args: Any, kwargs: Any, i: int = i) -> None:
            current[0] = i
            first = next((a for a in args if isinstance(a, Tensor)), None)
            inputs[i] = max(inputs.get(i, 0), first.numel() * first.element_size() if first is not None else 0)
            if not calls:
                calls.append((args, kwargs))

        def leave(module: nn.Module, args: Any, out: Any) -> None:
            current[0] = -1

        hooks += [block.register_forward_pre_hook(enter, with_kwargs=True), block.register_forward_hook(leave)]

    def token_ids(module: nn.Module, args: Any) -> None:
        if tokens or next(module.parameters(), None) is None:
            return
        ids = next(
            (
                a
                for a in args
                if isinstance(a, Tensor) and not a.is_floating_point() and not a.is_complex() and a.dtype != torch.bool
            ),
            None,
        )
        if ids is not None:
            tokens.append(ids.numel())

    hooks.append(register_module_forward_pre_hook(token_ids))
    try:
        with _cuda_kernels(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _MetaTrace():
            try:
                torch.compiler.disable(forward)(model)  # eager: a compiled module would compile for meta tensors
            except _LossRead:
                pass  # the forward ran; what autograd saved is counted
    finally:
        for hook in hooks:
            hook.remove()
    per_block = [0] * len(blocks)
    for _, nbytes, where in saved.values():
        if where >= 0:
            per_block[where] += nbytes
    total = sum(nbytes for _, nbytes, _ in saved.values())
    largest = max((nbytes for _, nbytes, _ in saved.values()), default=0)
    # A block that saves no more than its input recomputes its forward already (the model checkpoints it)
    self_checkpointed = bool(inputs) and all(0 < nbytes and per_block[i] <= nbytes for i, nbytes in inputs.items())
    return Activations(
        total,
        sum(per_block),
        sum(inputs.values()),
        max(per_block, default=0),
        largest,
        calls[0] if calls else None,
        len(blocks),
        sum(p.numel() for b in blocks for p in b.parameters()),
        tokens[0] if tokens else 0,
        self_checkpointed,
    )


def _nvme_bytes(
    policies: Policies,
    layouts: Sequence[UnitLayout],
    specs: Sequence[UnitSpec],
    param_dtype: torch.dtype,
    state_bytes: int,
    payload: dict[int, tuple[int, torch.dtype]],
) -> int:
    offload, total = policies.offload, 0
    if isinstance(offload.optimizer, Nvme):
        swapped = host_units(layouts, offload.optimizer.ratio)
        total += (4 + state_bytes) * sum(layouts[i].shard_numel for i in swapped)
    if isinstance(offload.parameters, Nvme):
        total += sum(n * dtype.itemsize for n, dtype in payload.values())
    return total


def _shards(
    policies: Policies,
    specs: Sequence[UnitSpec],
    own: Sequence[UnitSpec],
    world_size: int,
    ranks_per_node: int,
    rank: int,
    param_dtype: torch.dtype,
) -> tuple[list[UnitLayout], int, dict[int, tuple[int, torch.dtype]], FrozenNeed]:
    """The unit layouts the engine makes (sharded within a shard group: ``shard_group_size``, hybrid
    sharding), ``rank``'s position in its shard group, and each transient unit's stored payload (elements,
    dtype): its shard in ``param_dtype``, or INT8 groups and their scales where the weights travel as INT8
    (``wire.Int8``'s own count), as ``hybrid.topology`` and ``build.make_wire`` decide; and what the frozen parts
    of ``specs`` and those of their own (``own``) hold."""
    q = policies.quantization
    shard = hybrid.shard_group_size(policies.sharding.group_size, world_size, ranks_per_node)
    groups = world_size // shard
    align = math.lcm(ALIGN, q.group_size) if q.any else ALIGN
    if q.gradients and groups > 1:
        align *= groups  # whole INT8 groups per shard group, for the INT8 sum across groups
    layouts = plan_layouts(specs, shard, align)
    rank %= shard
    transient = [i for i in range(len(specs)) if not specs[i].persistent]
    units = policies.sharding.units
    frozen = frozen_need(
        specs,
        own,
        units.frozen_dtype if isinstance(units, ModuleUnits) else None,
        shard,
        rank,
        align,
        group_size=q.group_size,
        exact_numel=q.exact_numel,
        bucket_numel=q.gather_bucket_numel,
        on_host=not isinstance(policies.offload.parameters, OnDevice),
    )
    if q.weights and not (groups > 1 and q.cross_group_only) and transient:
        wire = Int8(
            layouts,
            param_dtype=param_dtype,
            rank=rank,
            group=None,
            device=torch.device("cpu"),
            group_size=q.group_size,
            exact_numel=q.exact_numel,
            bucket_numel=q.gather_bucket_numel,
        )
        return layouts, rank, {i: (wire.payload_numel(i), wire.payload_dtype) for i in transient}, frozen
    return layouts, rank, {i: (layouts[i].shard_numel, param_dtype) for i in transient}, frozen


def candidates(nvme_path: Optional[str] = None, frozen: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The configurations a plan compares: stages 1-3 without offload, with half and all of the
    optimizer on the host, stage 3 with parameters too, and NVMe where a path is given; for a model with
    frozen parameters (``frozen``: a LoRA fine-tune) also stage 3 with the frozen base stored as INT8
    (``frozen_dtype="int8"``), on the device and on the host."""
    out: list[tuple[str, dict[str, Any]]] = [(f"zeroq{s}", {"stage": s}) for s in (1, 2, 3)]
    for s in (1, 2, 3):
        out.append(
            (f"zeroq{s}+optimizer_half_cpu", {"stage": s, "offload_optimizer": True, "offload_optimizer_ratio": 0.5})
        )
        out.append((f"zeroq{s}+optimizer_cpu", {"stage": s, "offload_optimizer": True}))
    out.append(("zeroq3+params_optimizer_cpu", {"stage": 3, "offload_optimizer": True, "offload_parameters": True}))
    if nvme_path:
        nvme: dict[str, Any] = {"offload_optimizer": True, "offload_optimizer_device": "nvme", "nvme_path": nvme_path}
        out.append(("zeroq3+optimizer_nvme_half", {"stage": 3, **nvme, "offload_optimizer_nvme_ratio": 0.5}))
        out.append(
            (
                "zeroq3+params_cpu_optimizer_nvme_half",
                {"stage": 3, **nvme, "offload_parameters": True, "offload_optimizer_nvme_ratio": 0.5},
            )
        )
        out.append(("zeroq3+params_cpu_optimizer_nvme", {"stage": 3, **nvme, "offload_parameters": True}))
    if frozen:
        out.append(("zeroq3+frozen_int8", {"stage": 3, "frozen_dtype": "int8"}))
        out.append(
            (
                "zeroq3+params_optimizer_cpu+frozen_int8",
                {"stage": 3, "offload_optimizer": True, "offload_parameters": True, "frozen_dtype": "int8"},
            )
        )
    return out


def estimate_config(
    model: nn.Module,
    config: ZeroConfig,
    activations: Activations,
    *,
    name: str,
    world_size: int = 1,
    tokens: int = 0,
    checkpointing: float = 0.0,
    machine: Machine = Machine(),
    param_dtype: torch.dtype = torch.bfloat16,
    state_bytes: int = 8,
    rank: int = 0,
    step_temporary_bytes: int = 4,
    offloading: float = 0.0,
    inputs_on_host: bool = False,
) -> Need:
    """The plan of one configuration (``model`` on the meta device; ``tokens`` per step and rank;
    ``checkpointing``: the share of the repeated blocks that recompute; ``offloading``: the share whose saved
    tensors wait on the host, ``inputs_on_host``: the recomputing ones' inputs too (``Activations.mixed``);
    ``step_temporary_bytes``: what the optimizer allocates per element while it steps, 4 for torch's foreach
    AdamW, 0 for fused)."""
    checkpointing = float(checkpointing)
    policies = from_config(config, loss_scaling=False)
    units = policies.sharding.units
    held = shardable(model) if isinstance(units, ModuleUnits) else []  # stage 3 shards frozen parameters
    specs = unit_plan(model, trainable_parameters(model), units, held)
    own = frozen_only_specs(model, specs, held, units) if isinstance(units, ModuleUnits) else []
    layouts, rank, payload, frozen = _shards(
        policies, specs, own, world_size, machine.ranks_per_node, rank, param_dtype
    )
    device = device_kinds(
        layouts, [s.persistent for s in specs], policies.offload, param_dtype, state_bytes, rank, payload, frozen
    )
    sharded = {id(p) for spec in [*specs, *own] for p in spec.frozen}
    device["frozen_whole"] = sum(
        p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad and id(p) not in sharded
    )
    device["workspaces"] = machine.device_workspace_bytes
    device["activations"], moved, device["offload_in_flight"] = activations.mixed(
        checkpointing, offloading, inputs_on_host
    )
    device["loss_input"] = activations.largest
    device["loss_gradients"] = 2 * activations.largest
    device["recomputed_block"] = activations.largest_block if checkpointing > 0 else 0
    device["unit_gradients"] = max(
        (layouts[i].padded_numel * param_dtype.itemsize for i, s in enumerate(specs) if not s.persistent), default=0
    )  # a unit's gradients (none of its frozen part)
    # torch's multi-tensor (foreach) Adam/AdamW, its default on a GPU, makes the square root of every
    # second moment it steps at once: 4 bytes per element stepped on the device (fused: none).
    device["step_temporaries"] = device["masters"] * step_temporary_bytes // 4
    host = engine_need(policies.offload, layouts, rank, param_dtype, payload, frozen.stored_bytes)
    host.parts.update(optimizer_need([], host.host_elements, False, host.swap_elements, state_bytes).parts)
    if moved:
        host.parts[ACTIVATIONS] = activations_host_bytes(moved)
    if machine.runtime_host_bytes:
        host.parts["CUDA runtime and libraries"] = machine.runtime_host_bytes
    nvme = _nvme_bytes(policies, layouts, specs, param_dtype, state_bytes, payload)
    step = _step_seconds(
        policies,
        layouts,
        specs,
        activations,
        device["masters"] // 4,
        host.host_elements,
        nvme,
        tokens,
        checkpointing,
        machine,
        param_dtype,
        sum(p.numel() for p in model.parameters() if not p.requires_grad),
        frozen.stored_bytes,
        moved,
    )
    why = []
    peak = peak_allocated(device)
    reserved = int(peak * machine.reserved_per_allocated) + machine.reserved_overhead_bytes
    if machine.device_bytes is not None and reserved > machine.device_bytes:
        why.append(f"device {reserved / GIB:.1f} reserved > {machine.device_bytes / GIB:.1f} GiB")
    if machine.host_bytes is not None and host.total * machine.ranks_per_node > machine.host_bytes:
        why.append(f"host {host.total * machine.ranks_per_node / GIB:.1f} > {machine.host_bytes / GIB:.1f} GiB")
    if machine.nvme_bytes is not None and nvme * machine.ranks_per_node > machine.nvme_bytes:
        why.append(f"disk {nvme * machine.ranks_per_node / GIB:.1f} > {machine.nvme_bytes / GIB:.1f} GiB")
    return Need(
        name,
        config,
        checkpointing,
        device,
        dict(host.parts),
        nvme,
        step,
        not why,
        "; ".join(why),
        reserved,
        machine.device_bytes is not None,
        tokens,
        activations,
        float(offloading),
        inputs_on_host and moved > 0,
    )


def _engine_passes(
    policies: Policies,
    layouts: Sequence[UnitLayout],
    specs: Sequence[UnitSpec],
    param_dtype: torch.dtype,
    off: frozenset[int],
) -> int:
    """Device memory traffic of the engine's own passes in a step, beside the model's: each gradient read
    in the working dtype and reduced into its fp32 shard (the units stepped on the device), and in stage
    3 each transient unit gathered twice (the forward's, the backward's): written in the working dtype,
    from its fp32 master where that is on the device, else from its stored shard (parameters on the
    device) or from the host (read over PCIe, not here). ``off``: the units stepped off the device."""
    offload, itemsize = policies.offload, param_dtype.itemsize
    total = sum(
        itemsize * layouts[i].padded_numel + 4 * layouts[i].shard_numel for i in range(len(layouts)) if i not in off
    )
    params_here = isinstance(offload.parameters, OnDevice)
    for i in range(len(layouts)):
        if not specs[i].persistent:
            read = 4 if i not in off else itemsize if params_here else 0
            total += 2 * (read * layouts[i].shard_numel + itemsize * layouts[i].padded_numel)
    return total


def _step_seconds(
    policies: Policies,
    layouts: Sequence[UnitLayout],
    specs: Sequence[UnitSpec],
    activations: Activations,
    device_elements: int,
    host_elements: int,
    nvme_bytes: int,
    tokens: int,
    checkpointing: float,
    machine: Machine,
    param_dtype: torch.dtype,
    frozen_numel: int = 0,
    frozen_stored: int = 0,
    moved: int = 0,
) -> float:
    """The larger of the compute (the model's, and the engine's own passes over device memory) and what
    crosses PCIe beside it (gradients landing, stage 3's parameters coming up), plus the optimizer step
    on the device (``device_elements``, memory bound) and on the host, the new weights going up as it
    goes (one unit's copy after it), and NVMe traffic (``nvme_bytes`` read and written). Frozen parameters
    (``frozen_numel``) cost 4 FLOPs per element and token (forward, and the gradient of their input), and with
    parameter offload their stored shards (``frozen_stored`` bytes) cross PCIe twice a step.

    Activation offload (``moved`` bytes to the host in the forward and back in the backward) overlaps the
    compute of the blocks around the offloaded ones: its copies cost only what they take beyond the forward's
    compute (to the host) and beyond the backward's, recomputation included (back), each way on its own."""
    params = sum(layout.numel for layout in layouts)
    rate = tokens / machine.matmul_flops
    forward = (2 * params + 2 * frozen_numel) * rate
    backward = ((4 + 2 * checkpointing) * params + (2 + 2 * checkpointing) * frozen_numel) * rate
    if machine.block_seconds is not None and activations.blocks:
        block, both = machine.block_seconds
        outside = max(0, params + frozen_numel - activations.block_numel)
        forward = activations.blocks * block + 2 * outside * rate
        backward = activations.blocks * (both - block + checkpointing * block) + 4 * outside * rate
    compute = forward + backward
    copies = moved / machine.pcie_bytes_per_s
    stalls = max(0.0, copies - forward) + max(0.0, copies - backward)
    host_step = host_elements / machine.host_step_elements_per_s
    host = host_step + device_elements * DEVICE_STEP_BYTES / machine.device_bytes_per_s  # the device's part too
    offload = policies.offload
    off = units_off_device(offload.optimizer, layouts)
    compute += _engine_passes(policies, layouts, specs, param_dtype, off) / machine.device_bytes_per_s
    beside, after = 0, 0.0  # bytes over PCIe per step and rank: beside the compute, and after the host step
    if off:
        moved = sum(layouts[i].shard_numel for i in off)
        beside += param_dtype.itemsize * moved  # the gradients land during the backward
        # the new weights go up unit by unit as the host steps the next (``offload/host.py``): one unit's
        # copy waits for the host step's end, the rest ride beside it
        largest = max(layouts[i].shard_numel for i in off)
        after += param_dtype.itemsize * largest + max(
            0.0, param_dtype.itemsize * (moved - largest) - host_step * machine.pcie_bytes_per_s
        )
    if not isinstance(offload.parameters, OnDevice):
        transient = [i for i in range(len(layouts)) if not specs[i].persistent]
        beside += 2 * param_dtype.itemsize * sum(layouts[i].shard_numel for i in transient)  # forward and backward
        after += param_dtype.itemsize * sum(layouts[i].shard_numel for i in transient if i not in off)  # to the host
        beside += 2 * frozen_stored  # the frozen shards, forward and backward
    nvme = 2 * nvme_bytes / machine.nvme_bytes_per_s
    return max(compute, beside / machine.pcie_bytes_per_s) + stalls + host + after / machine.pcie_bytes_per_s + nvme


def estimate_training(
    model: nn.Module,
    forward: Callable[[nn.Module], Tensor],
    *,
    tokens: Optional[int] = None,
    world_size: int = 1,
    machine: Machine = Machine(),
    configs: Optional[Sequence[tuple[str, dict]]] = None,
    nvme_path: Optional[str] = None,
    param_dtype: torch.dtype = torch.bfloat16,
    state_bytes: int = 8,
    calibrate_on: Optional[torch.device] = None,
) -> list[Need]:
    """Every candidate configuration (``configs``: ``(name, ZeroConfig fields)``, default
    ``candidates``), each without and with checkpointing of the repeated blocks (without only, where the
    model recomputes its blocks itself), planned for ``model`` (on the meta device) and ``forward(model)``
    (one micro-batch of ``tokens`` per rank; None: the token ids the forward feeds, as traced): the fitting
    ones first, fastest first, then the rest. ``calibrate_on``: measure the machine's rates on this device
    first (``calibrate.py``: one block timed at the micro-batch, the host step, copies, the disk under
    ``nvme_path``; on a CPU the host step and the disk only) instead of ``machine``'s."""
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError(
            "plan: build the model on the meta device (with torch.device('meta'): ...), so that "
            "planning allocates nothing; it needs only the shapes."
        )
    if next(model.parameters(), None) is None:
        raise ValueError("plan: the model has no parameters: there is nothing to shard or offload.")
    blocks = repeated_blocks(model)
    activations = trace_activations(model, forward, blocks)
    if tokens is None:
        tokens = activations.tokens
        if not tokens:
            raise ValueError(
                "plan: the forward feeds the model no integer tensor (token ids) to count the tokens "
                "from; give tokens=<tokens per micro-batch and rank>."
            )
    if calibrate_on is not None:
        measured = calibrate.rates(
            calibrate_on,
            param_dtype,
            block=blocks[0] if blocks else None,
            call=activations.block_call,
            nvme_path=nvme_path,
        )
        machine = dataclasses.replace(machine, **measured)
        if calibrate_on.type == "cuda":
            log.info("calibrated here: " + describe(machine))
        else:  # no GPU: the host (and the disk) measured, the device's rates as given
            disk = f", disk {machine.nvme_bytes_per_s / 1e9:.2f} GB/s" if "nvme_bytes_per_s" in measured else ""
            log.info(
                f"calibrated here (no GPU, so the host only): host step "
                f"{machine.host_step_elements_per_s / 1e9:.2f}e9 elements/s{disk}; the device's rates are the "
                f"given ones, not measured (matmul {machine.matmul_flops / 1e12:.0f} TFLOP/s, device memory "
                f"{machine.device_bytes_per_s / 1e12:.2f} TB/s, PCIe {machine.pcie_bytes_per_s / 1e9:.1f} GB/s)"
            )
    needs = []
    checkpoint = (False, True) if blocks and not activations.self_checkpointed else (False,)
    has_frozen = any(not p.requires_grad for p in model.parameters())
    for name, fields in configs if configs is not None else candidates(nvme_path, has_frozen):
        config = ZeroConfig(**fields)
        for checkpointing in checkpoint:
            needs.append(
                estimate_config(
                    model,
                    config,
                    activations,
                    name=name + ("+checkpointing" if checkpointing else ""),
                    world_size=world_size,
                    tokens=tokens,
                    checkpointing=float(checkpointing),
                    machine=machine,
                    param_dtype=param_dtype,
                    state_bytes=state_bytes,
                )
            )
        if len(checkpoint) > 1 and machine.device_bytes is not None and not config.activation_offloading_policy:
            rows = [n for n in needs[-2:] if n.fits]
            mixed = best_mix(
                model,
                config,
                activations,
                name=name,
                world_size=world_size,
                tokens=tokens,
                machine=machine,
                param_dtype=param_dtype,
                state_bytes=state_bytes,
                beat=min((n.step_s for n in rows), default=float("inf")),
            )
            needs += [mixed] if mixed is not None else []
    return sorted(needs, key=lambda n: (not n.fits, n.step_s, n.device_total))


RECOMPUTE_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The shares of the repeated blocks recomputing that a plan chooses among."""

OFFLOAD_SHARES = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
"""The shares of the blocks whose activations wait on the host that a plan chooses among (eighths: the copies of
one block take several blocks' compute, so the share that fits beside the compute is often small)."""


def mixes(recompute: bool, offload: bool, given: float = 0.0) -> list[tuple[float, float, bool]]:
    """What the repeated blocks' activations may do, as ``(share offloading, share recomputing, the recomputing
    ones' inputs on the host)`` (``policies.activation_mix`` picks the blocks), less offloaded and less
    recomputed first: with ``recompute`` the shares of ``RECOMPUTE_SHARES`` recomputing, with ``offload`` those
    of ``OFFLOAD_SHARES`` offloading, each with its inputs on the host or not where some recompute; the two
    together, every pair whose shares add up to at most all of them. Neither: ``given`` (the configured
    share) recomputing."""
    offloads = OFFLOAD_SHARES if offload else (0.0,)
    recomputes = RECOMPUTE_SHARES if recompute else (given,)
    return [
        (o, r, inputs)
        for o in offloads
        for r in recomputes
        if o + r <= 1.0
        for inputs in ((False, True) if offload and r > 0 else (False,))
    ]


def best_mix(
    model: nn.Module, config: ZeroConfig, activations: Activations, *, name: str, beat: float, **plan: Any
) -> Optional[Need]:
    """``zeroq-plan``'s mixed row of ``config``: of every ``mixes`` of kept, offloaded and recomputed blocks,
    the fastest that fits and is faster than ``beat`` (the step of its plain or ``+checkpointing`` row that fits;
    ties go to the less offloaded), ``plan`` being ``estimate_config``'s other arguments, the machine's memory
    given; with
    the blocks named in its config (``activation_offloading_policy``, ``activation_checkpointing_policy``) and
    in its name (``+offloadK``: K blocks offload their activations, ``+recomputeR``: R recompute,
    ``+inputs_cpu``: those keep their inputs on the host). None where that is no offload at all (the plain
    and ``+checkpointing`` rows), or nothing fits."""
    blocks = repeated_blocks(model)
    best: Optional[Need] = None
    for offload, share, inputs in mixes(True, True):
        if offload == 0 and not inputs:
            continue  # the plain and +checkpointing rows, and shares of them auto's choice weighs
        need = estimate_config(
            model,
            config,
            activations,
            name=name,
            checkpointing=share,
            offloading=offload,
            inputs_on_host=inputs,
            **plan,
        )
        if need.fits and need.step_s < (best.step_s if best is not None else beat):
            best = need
    if best is None:
        return None
    on_host, recomputed = mix_names(model, blocks, best.offloading, best.checkpointing, best.inputs_on_host)
    offloaded = len(on_host) - (len(recomputed) if best.inputs_on_host else 0)
    label = (f"+offload{offloaded}" if offloaded else "") + (f"+recompute{len(recomputed)}" if recomputed else "")
    fields = {"activation_offloading_policy": on_host, "activation_checkpointing_policy": recomputed or None}
    return dataclasses.replace(
        best, name=name + label + ("+inputs_cpu" if best.inputs_on_host else ""), config=config.replace(**fields)
    )


def mix_names(
    model: nn.Module, blocks: Sequence[nn.Module], offload: float, recompute: float, inputs_on_host: bool
) -> tuple[list[str], list[str]]:
    """The qualified names of the ``blocks`` (repeated, forward order) a mix sends to the host (those offloaded,
    and those recomputing where ``inputs_on_host``: ``activation_offloading_policy``) and of those recomputing
    (``policies.activation_mix``), each sorted."""
    offloaded, recomputed = activation_mix(len(blocks), offload, recompute)
    qualified = {id(m): n for n, m in model.named_modules()}
    on_host = [*offloaded, *(recomputed if inputs_on_host else ())]
    return sorted(qualified[id(blocks[i])] for i in on_host), sorted(qualified[id(blocks[i])] for i in recomputed)
