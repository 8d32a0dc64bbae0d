"""The INT8 weight gather: this rank's fp32 master shard -> every rank's full working buffer.

Per unit and gather (all ranks run the same steps on the same sizes):

1. *Side channel.* Elements of small parameters (at most ``exact_numel`` elements: norms, biases)
   are sent exactly, in the working dtype, with one ``all_gather`` of a buffer padded to the largest
   rank's count; they are zeroed before quantization so they cannot inflate a group's scale.
2. *Chunks.* The shard is cut into chunks of ``chunk_numel`` elements (a multiple of the group size)
   so that one collective gathers at most ``allgather_bucket_size`` elements across all ranks, but
   never less than one group per rank. Per chunk: quantize+pack ``[codes | scales]`` into a send
   buffer, one ``all_gather`` of bytes, then unpack+dequantize source rank by source rank straight
   into that rank's slice of the persistent working buffer.
3. *Restore* the side-channel elements into the working buffer.

Stage 3 encodes each shard once per step (``encode``, kept as the unit's payload, about 1.06 bytes
per element instead of the working dtype's 2) and every gather of the step (forward and backward)
sends that payload (``gather_encoded``).

Every rank, the owner included, ends with the dequantized values, so all ranks hold bitwise the same
working weights. The master shards are never touched, so quantization error does not accumulate.
Temporary memory per chunk: ``chunk_numel`` fp32 (the masked copy) plus ``world_size + 1`` packed
buffers of ``chunk_numel * (1 + 4 / group_size)`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq import ops
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.layout import UnitLayout


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
    """Where the exact (side-channel) elements of one unit live."""

    local: Tensor
    """Positions in this rank's shard (int64)."""
    max_count: int
    """The largest per-rank count: the padded size of every rank's side buffer."""
    valid: Tensor
    """Positions in the gathered ``[world_size * max_count]`` side buffer that hold real values."""
    flat: Tensor
    """Positions in the working buffer of those values, in the same order."""


def side_positions(layout: UnitLayout, exact_numel: int, rank: int) -> list[int]:
    """Shard positions (within ``rank``'s shard) of parameters with at most ``exact_numel`` elements."""
    out: list[int] = []
    for seg in layout.segments(rank):
        if layout.slots[seg.param].numel <= exact_numel:
            out.extend(range(seg.shard_start, seg.shard_start + seg.numel))
    return out


def _side_plan(layout: UnitLayout, exact_numel: int, rank: int, device: torch.device) -> Optional[_SidePlan]:
    per_rank = [side_positions(layout, exact_numel, r) for r in range(layout.world_size)]
    max_count = max(len(p) for p in per_rank)
    if max_count == 0:
        return None
    valid, flat = [], []
    for r, positions in enumerate(per_rank):
        valid.extend(r * max_count + i for i in range(len(positions)))
        flat.extend(r * layout.shard_numel + p for p in positions)
    as_index = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return _SidePlan(as_index(per_rank[rank]), max_count, as_index(valid), as_index(flat))


def _positions_in(side: Optional[_SidePlan], start: int, n: int) -> Optional[Tensor]:
    """``side``'s shard positions in ``[start, start + n)``, relative to ``start``; None if there are none."""
    if side is None:
        return None
    inside = side.local[(side.local >= start) & (side.local < start + n)] - start
    return inside if inside.numel() else None


class QuantizedGather:
    """Gathers units' master shards into their working buffers as INT8 (see the module docstring)."""

    def __init__(
        self,
        layouts: Sequence[UnitLayout],
        *,
        rank: int,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        group_size: int,
        exact_numel: int,
        bucket_numel: int,
    ) -> None:
        self.rank, self.group, self.device = rank, group, device
        self.group_size = group_size
        self.plans = [plan_chunks(l.shard_numel, l.world_size, bucket_numel, group_size) for l in layouts]
        self.sides = [_side_plan(l, exact_numel, rank, device) for l in layouts]
        # Per unit and chunk: the side-channel positions inside the chunk, relative to its start
        # (None where the chunk holds none, so that chunk is quantized in place, without a copy).
        self.chunk_sides = [
            [_positions_in(side, start, n) for start, n in self.chunks(i, l.shard_numel)]
            for i, (l, side) in enumerate(zip(layouts, self.sides))
        ]
        if device.type == "cuda":
            ops.load_cuda_backend()  # compile or load once now, never inside a collective

    def chunks(self, index: int, shard_numel: int) -> list[tuple[int, int]]:
        step = self.plans[index].chunk_numel
        return [(start, min(step, shard_numel - start)) for start in range(0, shard_numel, step)]

    @torch.no_grad()
    def encode_chunk(self, index: int, master: Tensor, start: int, n: int) -> Tensor:
        """``[codes | scales]`` of ``master[start:start + n]`` with the side-channel elements zeroed."""
        chunk = master[start : start + n]
        inside = self.chunk_sides[index][start // self.plans[index].chunk_numel]
        if inside is not None:
            chunk = chunk.clone()
            chunk[inside] = 0.0
        return ops.quantize_pack_int8(chunk, group_size=self.group_size)

    @torch.no_grad()
    def encode_side(self, index: int, master: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
        """The exact side-channel values of this rank's shard, padded to the largest rank's count."""
        side = self.sides[index]
        if side is None:
            return None
        send = torch.zeros(side.max_count, dtype=dtype, device=self.device)
        send[: side.local.numel()] = master[side.local].to(dtype)
        return send

    @torch.no_grad()
    def gather_chunk(self, send: Tensor, start: int, n: int, flat: Tensor, layout: UnitLayout) -> None:
        """All-gather one chunk's packed bytes and dequantize each source rank into ``flat``."""
        world, shard_numel = layout.world_size, layout.shard_numel
        recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=self.device)
        comm.all_gather(recv, send, self.group)
        for r, packed in enumerate(recv.chunk(world)):
            out = flat[r * shard_numel + start : r * shard_numel + start + n]
            ops.unpack_dequantize_int8(packed, out, group_size=self.group_size)

    @torch.no_grad()
    def gather_side(self, index: int, send: Optional[Tensor], flat: Tensor, layout: UnitLayout) -> None:
        side = self.sides[index]
        if side is None:
            return
        recv = torch.empty(layout.world_size * side.max_count, dtype=flat.dtype, device=self.device)
        comm.all_gather(recv, send, self.group)
        flat[side.flat] = recv[side.valid]

    def gather(self, index: int, master: Tensor, flat: Tensor, layout: UnitLayout) -> None:
        """Stages 1/2: encode and gather chunk by chunk (temporary memory bounded by one chunk)."""
        for start, n in self.chunks(index, layout.shard_numel):
            self.gather_chunk(self.encode_chunk(index, master, start, n), start, n, flat, layout)
        self.gather_side(index, self.encode_side(index, master, flat.dtype), flat, layout)

    def encode(self, index: int, master: Tensor, dtype: torch.dtype) -> "EncodedShard":
        """Stage 3: encode the whole shard once per step; every gather of the step reuses it."""
        chunks = [self.encode_chunk(index, master, start, n) for start, n in self.chunks(index, master.numel())]
        return EncodedShard(chunks, self.encode_side(index, master, dtype))

    def gather_encoded(self, index: int, encoded: "EncodedShard", flat: Tensor, layout: UnitLayout) -> None:
        for send, (start, n) in zip(encoded.chunks, self.chunks(index, layout.shard_numel)):
            self.gather_chunk(send, start, n, flat, layout)
        self.gather_side(index, encoded.side, flat, layout)


class EncodedShard(NamedTuple):
    """One rank's quantized shard, as sent: packed chunks and the exact side-channel values."""

    chunks: list[Tensor]
    side: Optional[Tensor]
