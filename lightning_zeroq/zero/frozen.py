"""Stage 3's frozen parameters (``requires_grad=False``): sharded with the unit of the module that holds
them, gathered and freed with it, never stepped.

A LoRA block holds a frozen base (most of the model) and small trainable factors. Stage 3 makes the block
one unit: its trainable parameters are an ordinary ``Unit`` (fp32 master, gradient, optimizer state), and
its frozen ones the unit's *frozen part* (``Unit.frozen``), a second ``Unit`` of the same shape of life:

- its working buffer ``flat`` is in the parameters' own dtype, full size only while the unit is gathered;
- its ``master`` is this rank's shard of it *as stored*: the same dtype (``frozen_dtype=None``: exact, the
  values DDP computes with), ``bf16``/``fp16`` (half or less the bytes of fp32, rounded to nearest even
  once, when the engine is built), or INT8 groups with one fp32 scale per ``quantized_weights_group_size``
  elements (``"int8"``: about 1.06 bytes per element; parameters of at most ``quantized_weights_exact_numel``
  elements travel exactly, as with ``quantized_weights``). Quantized or rounded once, never again: nothing
  writes a frozen shard during training, so the error does not grow;
- no gradient, no fp32 master, no optimizer state, no reduction;
- with ``offload_parameters`` the stored shard rests in host memory (pinned where the device is a GPU) and
  crosses to the device at each gather, prefetched on the gather stream like the trainable shards;
- alone in the shard group (one GPU), stored exactly on the device, the stored shard is the whole part: it stays
  gathered (``FrozenCodec.resident``), with no copy at each use.

Every rank holds ``1/N`` of the frozen bytes at rest. Which frozen parameters are sharded is decided with the
units (``unit_plan.py``): floating point, of the dtype that holds most of the frozen bytes (``compute_dtype``),
owned by no module outside their part; those inside a stage-3 module unit that holds trainable parameters too
join it, and a repeated block with nothing to train or a module whose own frozen parameters pass
``stage3_param_persistence_threshold`` (a frozen embedding or head) forms a part of its own, gathered around its
module's forward and backward by ``stage3.py``. The rest (small ones outside the blocks, tied ones, another
dtype's) stay whole on every rank, as in stages 1 and 2 and DDP.

``FrozenCodec`` turns a frozen shard into what rests and back; the frozen parts' ``Gatherer``
(``FrozenParts.gatherer``) gathers them, and the trainable ``Gatherer`` calls it for a unit's frozen part
whenever it gathers or frees the unit (``gather.py``), so every path that gathers a unit (forward, backward,
recomputation, prefetch, ``gathered_parameters``) brings its frozen part along.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq import ops
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.swap.buffers import pinned_empty
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.layout import UnitLayout, make_layout
from lightning_zeroq.zero.unit import Unit, UnitState
from lightning_zeroq.zero.wire import FullWidth, Int8, on_device

if TYPE_CHECKING:
    from lightning_zeroq.zero.unit_plan import UnitSpec

FROZEN_DTYPES: dict[Optional[str], Optional[torch.dtype]] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": None,
}
"""``ZeroConfig.frozen_dtype``'s values: how a frozen shard is stored (None: in the parameter's own dtype)."""


def compute_dtype(frozen: Sequence[nn.Parameter]) -> Optional[torch.dtype]:
    """The floating dtype that holds the most frozen bytes (None: no floating frozen parameter)."""
    by_dtype: dict[torch.dtype, int] = {}
    for p in frozen:
        if p.is_floating_point():
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
    return max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else None


def shardable(module: nn.Module) -> list[nn.Parameter]:
    """The module's frozen parameters stage 3 may shard: floating point, of ``compute_dtype``."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    dtype = compute_dtype(frozen)
    return [p for p in frozen if p.dtype == dtype]


class _Fp32Shard:
    """The one ``Masters`` call the INT8 wire's ``encode`` makes, answered with a given shard."""

    def __init__(self, shard: Tensor) -> None:
        self.shard = shard

    def device_master(self, unit: Unit) -> Tensor:
        return self.shard


class _CastGather:
    """Shards stored in a smaller dtype than the parameters': gathered in it, cast into ``flat``."""

    def __init__(self, stored: torch.dtype, group: Optional[dist.ProcessGroup]) -> None:
        self.stored, self.group, self.alone = stored, group, comm.alone(group)

    def gather(self, unit: Unit, payload: Tensor) -> None:
        payload = on_device(payload, unit.flat.device)
        if self.alone:
            unit.flat.copy_(payload)
            return
        full = torch.empty(unit.flat.numel(), dtype=self.stored, device=unit.flat.device)
        comm.all_gather(full, payload, self.group)
        unit.flat.copy_(full)


class FrozenCodec:
    """What a frozen shard rests as (``encode``), what it holds (``decode``), and how the stored shards of all
    ranks become a unit's ``flat`` (``wire.gather``)."""

    def __init__(
        self,
        storage: Optional[str],
        compute: torch.dtype,
        layouts: Sequence[UnitLayout],
        *,
        rank: int,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        on_host: bool,
        group_size: int,
        exact_numel: int,
        bucket_numel: int,
    ) -> None:
        self.compute, self.device, self.on_host, self.group = compute, device, on_host, group
        self.layouts = list(layouts)
        self.stored: torch.dtype = FROZEN_DTYPES.get(storage) or compute
        if storage == "int8":
            self.stored = torch.uint8
            self.wire: object = Int8(
                layouts,
                param_dtype=compute,
                rank=rank,
                group=group,
                device=device,
                group_size=group_size,
                exact_numel=exact_numel,
                bucket_numel=bucket_numel,
            )
        elif self.stored != compute:
            self.wire = _CastGather(self.stored, group)
        else:
            self.wire = FullWidth(layouts, compute, group)
        self.exact = self.stored == compute
        """The stored shard holds the parameters' values bit for bit."""
        self.resident = self.exact and not on_host and all(layout.world_size == 1 for layout in self.layouts)
        """One rank in the shard group, exact storage on the device: the stored shard is the whole part, so the
        parts stay gathered (persistent: no copy at each use, no more memory than the shard)."""

    def stored_bytes(self) -> int:
        """The bytes of this rank's stored shards, known before any is built (the memory checks count them)."""
        if isinstance(self.wire, Int8):
            return sum(self.wire.payload_numel(i) for i in range(len(self.layouts)))
        return sum(layout.shard_numel for layout in self.layouts) * self.stored.itemsize

    @torch.no_grad()
    def encode(self, unit: Unit, shard: Tensor) -> Tensor:
        """What rests of ``shard`` (this rank's values, in ``compute``, on the device): on the device, or on the
        host (pinned where the device is a GPU) with parameter offload."""
        if isinstance(self.wire, Int8):
            stored = self.wire.encode(unit, _Fp32Shard(shard.float()))  # type: ignore[arg-type]
        else:
            stored = shard.to(self.stored, copy=True)
        if not self.on_host or self.device.type != "cuda":
            return stored
        host = pinned_empty(stored.numel(), stored.dtype)
        host.copy_(stored)
        return host

    @torch.no_grad()
    def store(self, unit: Unit, shard: Tensor) -> None:
        """Rest ``shard`` as ``unit``'s stored shard (in place where it can, so a gather in flight on the
        gather stream sees a whole old or new value after the caller's ordering)."""
        stored = self.encode(unit, shard)
        if unit.master.numel() == stored.numel() and unit.master.dtype == stored.dtype:
            unit.master.copy_(stored)
        else:
            unit.master = stored

    @torch.no_grad()
    def decode(self, unit: Unit) -> Tensor:
        """This rank's shard of ``unit`` as the parameters hold it (``compute``, on the device; a copy)."""
        stored = on_device(unit.master, self.device)
        if not isinstance(self.wire, Int8):
            return stored.to(self.compute, copy=True)
        plan = self.wire.plans[unit.index]
        out = torch.empty(unit.layout.shard_numel, dtype=self.compute, device=self.device)
        for c, (start, n) in enumerate(plan.chunks):
            ops.unpack_dequantize_int8(
                stored[plan.offsets[c] : plan.offsets[c + 1]], out[start : start + n], group_size=self.wire.group_size
            )
        if plan.side is not None:
            out[plan.side.local] = stored[plan.offsets[-1] :].view(self.compute)
        return out

    def gather(self, unit: Unit, payload: Tensor) -> None:
        """Every rank's stored shard (``payload``: this rank's, ``Unit.master``) into ``unit.flat``."""
        self.wire.gather(unit, payload)  # type: ignore[attr-defined]


def frozen_layouts(
    specs: Sequence["UnitSpec"], world_size: int, align: int, storage: Optional[str], group_size: int
) -> list[UnitLayout]:
    """The frozen parts' layouts, in the order of their units (INT8: whole groups per shard)."""
    align = math.lcm(align, group_size) if storage == "int8" else align
    return [make_layout([p.numel() for p in spec.frozen], world_size, align) for spec in specs if spec.frozen]


def frozen_need(
    specs: Sequence["UnitSpec"],
    own: Sequence["UnitSpec"],
    storage: Optional[str],
    world_size: int,
    rank: int,
    align: int,
    *,
    group_size: int,
    exact_numel: int,
    bucket_numel: int,
    on_host: bool,
) -> FrozenNeed:
    """``FrozenNeed`` of the frozen parts the engine builds from the units' ``specs`` and the parts of their own
    (``own``), without making a tensor (meta models too)."""
    held = [p for spec in [*specs, *own] for p in spec.frozen]
    if not held:
        return FrozenNeed(0, {})
    compute = held[0].dtype
    layouts = frozen_layouts([*specs, *own], world_size, align, storage, group_size)
    codec = FrozenCodec(
        storage,
        compute,
        layouts,
        rank=rank,
        group=None,
        device=torch.device("cpu"),
        on_host=on_host,
        group_size=group_size,
        exact_numel=exact_numel,
        bucket_numel=bucket_numel,
    )
    return need_of(specs, codec, compute)


def need_of(specs: Sequence["UnitSpec"], codec: FrozenCodec, compute: torch.dtype) -> FrozenNeed:
    """``FrozenNeed`` of ``codec``'s parts: the first belong to the units of ``specs`` that hold frozen
    parameters, in order; the rest are parts of their own."""
    owners = [i for i, spec in enumerate(specs) if spec.frozen]
    sizes = [0 if codec.resident else layout.padded_numel * compute.itemsize for layout in codec.layouts]
    return FrozenNeed(codec.stored_bytes(), dict(zip(owners, sizes)), max(sizes[len(owners) :], default=0))


@torch.no_grad()
def build_part(
    index: int,
    params: list[nn.Parameter],
    layout: UnitLayout,
    codec: FrozenCodec,
    *,
    module: Optional[nn.Module],
    group: Optional[dist.ProcessGroup],
    rank: int,
) -> Unit:
    """One frozen part, built as ``unit.build_units`` builds a unit: flattened, rank 0's values broadcast,
    this rank's shard stored; the parameters point at ``flat`` (GATHERED) until the caller frees it."""
    device = codec.device
    full = torch.zeros(layout.padded_numel, dtype=codec.compute, device=device)
    for p, slot in zip(params, layout.slots):
        full[slot.span].copy_(p.detach().reshape(-1))
    if rank_and_size(group)[1] > 1:
        comm.broadcast(full, 0, group)
    unit = Unit(
        index=index,
        params=params,
        first_param_id=-1,
        layout=layout,
        segments=layout.segments(rank),
        flat=full,
        master=torch.empty(0, device=device),
        segment_masters=[],
        grad=torch.empty(0, device=device),
        module=module,
        persistent=codec.resident,
        state=UnitState.GATHERED,
        param_classes=[type(p) for p in params],
        param_dtypes=[p.dtype for p in params],
    )
    shard = full[layout.shard_span(rank)]
    unit.master = shard if codec.resident else codec.encode(unit, shard)
    for p, slot in zip(params, layout.slots):
        p.data = full[slot.span].view(p.shape)
    return unit


class FrozenNeed(NamedTuple):
    """What stage 3's frozen parts hold on this rank (the memory checks and the plan count it)."""

    stored_bytes: int
    """The stored shards (on the device, or on the host with parameter offload)."""
    gathered_bytes: dict[int, int]
    """Per unit (the index of the unit whose frozen part it is): its frozen part's working buffer, gathered."""
    own_gathered: int = 0
    """The largest part of its own (no unit), gathered."""


@dataclass(eq=False)
class FrozenParts:
    """A built engine's frozen parts: one per stage-3 unit that holds frozen parameters (``Unit.frozen`` of that
    unit), then the parts of their own; the codec they share, and the gatherer that gathers them."""

    units: list[Unit]
    codec: FrozenCodec
    gatherer: Gatherer
    """The frozen parts' ``Gatherer`` (``gather.py``), called by the trainable gatherer."""
    need: FrozenNeed
    """What they hold, as the memory checks count it."""
    owner: dict[int, Unit] = field(default_factory=dict)
    """Each frozen part's trainable unit, by the frozen part's index (a part of its own has none)."""

    @property
    def stored_bytes(self) -> int:
        """The bytes of this rank's stored frozen shards (what rests; the measure of memory at rest)."""
        return sum(u.master.numel() * u.master.element_size() for u in self.units)
