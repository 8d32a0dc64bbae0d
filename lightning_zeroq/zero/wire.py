"""How a shard travels between ranks: at full width, or as INT8 groups (``quantized_weights``).

A *wire* turns this rank's fp32 master shard into every rank's full working buffer. It is chosen
once, when the engine is built, and offers three operations:

- ``sync(unit, placement)``: persistent units (stages 1/2, stage 3's root and small parameters),
  after every step: master shard -> ``unit.flat``, with temporary memory bounded per collective.
- ``encode(unit, placement)``: stage 3 transient units, once per step: the *payload* this rank
  sends for the unit (a 1-D tensor of ``payload_dtype``/``payload_numel``). A shard store
  (``offload/``) keeps it between gathers wherever the parameters live.
- ``gather(unit, payload)``: stage 3, before every use: every rank's payload -> ``unit.flat``.

Full width. The payload is the working-dtype shard; ``encode`` hands over the copy a host step wrote
in that dtype (``Masters.host_working``), or else the master as it is, which the store casts
where the payload rests: on the host into pinned memory (parameter offload), on
the GPU after the fp32 master crossed PCIe once (a host master, payload on the device), or at each
gather (a device master: nothing rests).

INT8, per unit (all ranks run the same steps on the same sizes):

1. *Side channel.* Elements of small parameters (at most ``exact_numel`` elements: norms, biases)
   are sent exactly, in the working dtype; they are zeroed before quantization so they cannot
   inflate a group's scale. Each rank sends only the values it owns (ranks own different numbers of
   them: an all-to-all with split sizes, not an all-gather padded to the largest rank's count), in
   rounds of at most ``allgather_bucket_size`` elements over all ranks, like the chunks below.
2. *Chunks.* The shard is cut into chunks of ``chunk_numel`` elements (a multiple of the group size)
   so that one collective gathers at most ``allgather_bucket_size`` elements across all ranks, but
   never less than one group per rank. Per chunk: quantize+pack ``[codes | scales]`` into a send
   buffer, one ``all_gather`` of bytes, then unpack+dequantize source rank by source rank straight
   into that rank's slice of the working buffer.
3. *Restore* the side-channel elements into the working buffer.

The INT8 payload is one byte buffer ``[chunk 0 | chunk 1 | ... | side values]`` (about 1.06 bytes
per element instead of the working dtype's 2), encoded once per step; every gather of the step
(forward and backward) sends it. Every rank, the owner included, ends with the dequantized values,
so all ranks hold bitwise the same working weights. Master shards are never touched, so
quantization error does not accumulate. Temporary memory of ``sync`` per chunk: ``chunk_numel``
fp32 (the masked copy, only where the chunk holds side elements) plus ``world_size + 1`` packed
buffers of ``chunk_numel * (1 + 4 / group_size)`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq import ops
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.offload.roles import Masters
from lightning_zeroq.zero.unit import Unit


class Wire(Protocol):
    payload_dtype: torch.dtype
    group: Optional[dist.ProcessGroup]
    """The shard group the shards travel in."""

    def payload_numel(self, index: int) -> int: ...

    def sync(self, unit: Unit, placement: Masters) -> None: ...

    def encode(self, unit: Unit, placement: Masters) -> Tensor: ...

    def gather(self, unit: Unit, payload: Tensor) -> None:
        """Fill ``unit.flat`` from every rank's ``payload`` (on the device, or pinned on the host: a
        store's own buffer, ``offload/stores.py``)."""


def on_device(payload: Tensor, device: torch.device) -> Tensor:
    """``payload`` on ``device`` (a copy issued on the current stream where it rests on the host)."""
    return payload if payload.device.type == device.type else payload.to(device, non_blocking=True)


class FullWidth:
    """Shards travel in the working dtype: one ``all_gather_into_tensor`` straight into ``flat``."""

    def __init__(
        self, layouts: Sequence[UnitLayout], param_dtype: torch.dtype, group: Optional[dist.ProcessGroup]
    ) -> None:
        self.layouts, self.payload_dtype, self.group = layouts, param_dtype, group
        self.alone = comm.alone(group)
        """One rank in the group: a gather or a sync is a copy, not a collective."""
        self.rank = rank_and_size(group)[0]

    def payload_numel(self, index: int) -> int:
        return self.layouts[index].shard_numel

    def sync(self, unit: Unit, placement: Masters) -> None:
        if self.alone and placement.master_on_device(unit.index):  # one copy that casts: no temporary
            unit.flat.copy_(unit.master)
        else:
            comm.all_gather(unit.flat, placement.device_working(unit, self.payload_dtype), self.group)

    def sync_spans(self, unit: Unit, placement: Masters, spans: Sequence[slice]) -> None:
        """``sync`` where only ``spans`` of this rank's shard changed (one of several optimizers stepped; the
        rest is as the last sync left it): they are written into this rank's part of ``flat``, which the
        ranks then gather in place (every rank calls it, each with its own spans, maybe none)."""
        n = unit.layout.shard_numel
        mine = unit.flat.narrow(0, self.rank * n, n)
        placement.write_working(unit, mine, spans)
        if not self.alone:
            comm.all_gather(unit.flat, mine, self.group)

    def encode(self, unit: Unit, placement: Masters) -> Tensor:
        # The step's own working-dtype copy of a host master (the host kernel's), else the master,
        # which the store's copy casts where the master lives.
        working = placement.host_working(unit, self.payload_dtype)
        return working if working is not None else unit.master

    def gather(self, unit: Unit, payload: Tensor) -> None:
        if self.alone:  # the payload is the unit: one copy, from wherever it rests
            unit.flat.copy_(payload, non_blocking=True)
        else:
            comm.all_gather(unit.flat, on_device(payload, unit.flat.device), self.group)


class ChunkPlan(NamedTuple):
    chunk_numel: int
    """Elements of each rank's shard quantized and gathered per collective (whole groups)."""
    num_chunks: int


def plan_chunks(shard_numel: int, world_size: int, bucket_numel: int, group_size: int) -> ChunkPlan:
    """Chunking of one shard so a collective gathers at most ``bucket_numel`` elements over all ranks.

    ``shard_numel`` is a multiple of ``group_size``. The bound never drops below one group per rank.
    """
    per_rank = max(group_size, (bucket_numel // world_size) // group_size * group_size)
    chunk = min(per_rank, shard_numel) if shard_numel else group_size
    return ChunkPlan(chunk, -(-shard_numel // chunk) if shard_numel else 0)


@dataclass(eq=False)
class _SidePlan:
    """Where the exact (side-channel) elements of one unit live, and the collectives that move them."""

    local: Tensor
    """Positions in this rank's shard (int64); this rank sends exactly these values, no padding."""
    rounds: list[tuple[list[int], Tensor]]
    """Per collective: how many values each rank sends in it, and where the received values go in
    the working buffer. Each collective moves at most ``allgather_bucket_size`` elements in all."""
    per_round: int
    """Values a rank sends per collective (the bucket bound divided by the world size)."""


def side_positions(layout: UnitLayout, exact_numel: int, rank: int) -> list[int]:
    """Shard positions (within ``rank``'s shard) of parameters with at most ``exact_numel`` elements."""
    out: list[int] = []
    for seg in layout.segments(rank):
        if layout.slots[seg.param].numel <= exact_numel:
            out.extend(range(seg.shard_span.start, seg.shard_span.stop))
    return out


def side_rounds(counts: Sequence[int], per_round: int) -> list[list[int]]:
    """Per collective, the number of values each rank sends: rank ``r`` sends its values in order,
    ``per_round`` at a time, until its ``counts[r]`` are out; a rank with fewer sends nothing more."""
    rounds = -(-max(counts, default=0) // per_round)
    return [[max(0, min(per_round, c - k * per_round)) for c in counts] for k in range(rounds)]


def _side_plan(
    layout: UnitLayout, exact_numel: int, rank: int, bucket_numel: int, device: torch.device
) -> Optional[_SidePlan]:
    per_rank = [side_positions(layout, exact_numel, r) for r in range(layout.world_size)]
    if not any(per_rank):
        return None
    per_round = max(1, bucket_numel // layout.world_size)
    rounds = []
    for k, counts in enumerate(side_rounds([len(p) for p in per_rank], per_round)):
        flat = [
            r * layout.shard_numel + p
            for r, (positions, n) in enumerate(zip(per_rank, counts))
            for p in positions[k * per_round : k * per_round + n]
        ]
        rounds.append((counts, torch.tensor(flat, dtype=torch.int64, device=device)))
    local = torch.tensor(per_rank[rank], dtype=torch.int64, device=device)
    return _SidePlan(local, rounds, per_round)


def _positions_in(side: Optional[_SidePlan], start: int, n: int) -> Optional[Tensor]:
    """``side``'s shard positions in ``[start, start + n)``, relative to ``start``; None if there are none."""
    if side is None:
        return None
    inside = side.local[(side.local >= start) & (side.local < start + n)] - start
    return inside if inside.numel() else None


class _UnitPlan(NamedTuple):
    chunks: list[tuple[int, int]]
    """(start, numel) of each chunk of the shard."""
    chunk_sides: list[Optional[Tensor]]
    """Per chunk: side-channel positions inside it, relative to its start (None: quantized in place)."""
    offsets: list[int]
    """Byte offset of each chunk's packed bytes in the payload; the last entry is the side values'."""
    side: Optional[_SidePlan]


class Int8:
    """Shards travel as INT8 groups with fp32 scales (see the module docstring)."""

    payload_dtype = torch.uint8

    def __init__(
        self,
        layouts: Sequence[UnitLayout],
        *,
        param_dtype: torch.dtype,
        rank: int,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        group_size: int,
        exact_numel: int,
        bucket_numel: int,
    ) -> None:
        self.rank, self.group, self.device = rank, group, device
        self.param_dtype, self.group_size = param_dtype, group_size
        self.plans = [self._plan(layout, bucket_numel, exact_numel) for layout in layouts]
        if device.type == "cuda":
            ops.load_cuda_backend()  # compile or load once now, never inside a collective

    def _plan(self, layout: UnitLayout, bucket_numel: int, exact_numel: int) -> _UnitPlan:
        step = plan_chunks(layout.shard_numel, layout.world_size, bucket_numel, self.group_size).chunk_numel
        chunks = [(start, min(step, layout.shard_numel - start)) for start in range(0, layout.shard_numel, step)]
        side = _side_plan(layout, exact_numel, self.rank, bucket_numel, self.device)
        offsets = [0]
        for _, n in chunks:
            offsets.append(offsets[-1] + ops.packed_nbytes(n, self.group_size))
        return _UnitPlan(chunks, [_positions_in(side, start, n) for start, n in chunks], offsets, side)

    def payload_numel(self, index: int) -> int:
        plan = self.plans[index]
        side_bytes = plan.side.local.numel() * self.param_dtype.itemsize if plan.side is not None else 0
        return plan.offsets[-1] + side_bytes

    @torch.no_grad()
    def _encode_chunk(self, plan: _UnitPlan, c: int, master: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """``[codes | scales]`` of chunk ``c`` of ``master`` with the side-channel elements zeroed."""
        start, n = plan.chunks[c]
        chunk = master[start : start + n]
        inside = plan.chunk_sides[c]
        if inside is not None:
            chunk = chunk.clone()
            chunk[inside] = 0.0
        return ops.quantize_pack_int8(chunk, out, group_size=self.group_size)

    @torch.no_grad()
    def _encode_side(self, plan: _UnitPlan, master: Tensor, out: Optional[Tensor] = None) -> Optional[Tensor]:
        """The exact side-channel values of this rank's shard (its own count: no padding)."""
        side = plan.side
        if side is None:
            return None
        values = master[side.local].to(self.param_dtype)
        return values if out is None else out.copy_(values)

    @torch.no_grad()
    def _gather_chunk(self, unit: Unit, c: int, send: Tensor) -> None:
        """All-gather one chunk's packed bytes and dequantize each source rank into ``unit.flat``."""
        start, n = self.plans[unit.index].chunks[c]
        world = unit.layout.world_size
        recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=self.device)
        comm.all_gather(recv, send, self.group)
        for r, packed in enumerate(recv.chunk(world)):
            out = unit.flat[unit.layout.shard_span(r)][start : start + n]
            ops.unpack_dequantize_int8(packed, out, group_size=self.group_size)

    @torch.no_grad()
    def _gather_side(self, unit: Unit, send: Optional[Tensor]) -> None:
        side = self.plans[unit.index].side
        if side is None:
            return
        for k, (counts, positions) in enumerate(side.rounds):
            start = k * side.per_round
            recv = torch.empty(sum(counts), dtype=unit.flat.dtype, device=self.device)
            assert send is not None  # both callers pass the side values whenever the unit has a side plan
            comm.all_gather_uneven(recv, send[start : start + counts[self.rank]], counts, self.group)
            unit.flat[positions] = recv

    def sync(self, unit: Unit, placement: Masters) -> None:
        """Encode and gather chunk by chunk (temporary memory bounded by one chunk)."""
        plan = self.plans[unit.index]
        master = placement.device_master(unit)
        for c in range(len(plan.chunks)):
            self._gather_chunk(unit, c, self._encode_chunk(plan, c, master))
        self._gather_side(unit, self._encode_side(plan, master))

    @torch.no_grad()
    def encode(self, unit: Unit, placement: Masters) -> Tensor:
        plan = self.plans[unit.index]
        master = placement.device_master(unit)
        payload = torch.empty(self.payload_numel(unit.index), dtype=torch.uint8, device=self.device)
        for c in range(len(plan.chunks)):
            self._encode_chunk(plan, c, master, payload[plan.offsets[c] : plan.offsets[c + 1]])
        self._encode_side(plan, master, payload[plan.offsets[-1] :].view(self.param_dtype))
        return payload

    def gather(self, unit: Unit, payload: Tensor) -> None:
        plan = self.plans[unit.index]
        payload = on_device(payload, self.device)
        for c in range(len(plan.chunks)):
            self._gather_chunk(unit, c, payload[plan.offsets[c] : plan.offsets[c + 1]])
        if plan.side is not None:
            self._gather_side(unit, payload[plan.offsets[-1] :].view(unit.flat.dtype))
