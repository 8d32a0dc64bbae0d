"""How gradients travel in a reduction: at full width (a reduce-scatter), or as INT8 groups
(``quantized_gradients``, ZeRO++'s qgZ idea, for every stage).

Both return this rank's part of the sum over ranks, divided by the world size, as a new tensor the
caller adds to the unit's gradient (``Unit.add_grad``, which may keep it as it is). All ranks run the
same collectives on the same sizes.

Full width: divide by the world size first (so bf16/fp16 sums cannot overflow; SUM because AVG is
NCCL-only), reduce-scatter in the gradients' dtype, add.

INT8: every rank cuts its local flat gradient into the ``world_size`` shards, quantizes each in
groups (one fp32 scale per group, the weights' format, ``ops.reference``) and sends shard ``r`` to
rank ``r`` in one all-to-all (about 1.06 bytes per element instead of bf16's 2). Each rank then
dequantizes the ``world_size`` versions of its own shard to fp32 and sums them in rank order, so
the result is the same on any machine for the same inputs, and divides by the world size. The
quantization error does not accumulate: every reduction quantizes fresh gradients. One rank alone
has nothing to send and reduces exactly.

Hybrid groups (``shard_group_size``): ``AcrossGroups`` runs one of the two inside the shard group,
then sums the parts across groups (full width or INT8; see the class).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq import ops
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm


class GradientWire(Protocol):
    identity: bool
    """``reduce`` returns ``flat`` unchanged (one rank, nothing to divide by): the caller may skip the
    flat buffer and keep the gradients as they are (``unit.ParamGrads``)."""
    divides_first: int
    """What ``reduce`` divides ``flat`` by before anything else (1: nothing). A caller that divides as it
    fills ``flat`` (the same operation on the same values, so the same bits) passes ``divided=True``."""

    def reduce(self, flat: Tensor, divided: bool = False) -> Tensor:
        """``(sum over ranks of their ``flat``)[this rank's part] / world_size``, a tensor of its own
        (``flat`` itself at world size 1: the caller gives it up)."""


class FullWidthReduce:
    """``divisor``: what the sum is divided by (default: the group's size; with hybrid groups the
    world's, as the sum across groups follows)."""

    def __init__(self, group: Optional[dist.ProcessGroup], divisor: Optional[int] = None) -> None:
        self.group = group
        self.world_size = rank_and_size(group)[1]
        self.divisor = divisor or self.world_size
        self.identity = self.world_size == 1 and self.divisor == 1
        self.divides_first = self.divisor

    def reduce(self, flat: Tensor, divided: bool = False) -> Tensor:
        if self.divisor != 1 and not divided:
            flat.div_(self.divisor)
        if self.world_size == 1:
            return flat
        part = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype, device=flat.device)
        comm.reduce_scatter(part, flat, self.group)
        return part


class Int8Reduce:
    def __init__(
        self, group: Optional[dist.ProcessGroup], device: torch.device, group_size: int, divisor: Optional[int] = None
    ) -> None:
        self.group, self.group_size = group, group_size
        self.world_size = rank_and_size(group)[1]
        self.divisor = divisor or self.world_size
        self.identity = self.world_size == 1 and self.divisor == 1
        self.divides_first = self.divisor if self.world_size == 1 else 1  # else after the sum, in fp32
        if device.type == "cuda":
            ops.load_cuda_backend()  # compile or load once now, never inside a collective

    def reduce(self, flat: Tensor, divided: bool = False) -> Tensor:
        if self.world_size == 1:
            return flat.div_(self.divisor) if self.divisor != 1 and not divided else flat
        n = flat.numel() // self.world_size
        packed_bytes = ops.packed_nbytes(n, self.group_size)
        send = torch.empty(self.world_size * packed_bytes, dtype=torch.uint8, device=flat.device)
        for r, part in enumerate(flat.split(n)):
            ops.quantize_pack_int8(part, send[r * packed_bytes : (r + 1) * packed_bytes], group_size=self.group_size)
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send, self.group)
        total = torch.zeros(n, dtype=torch.float32, device=flat.device)
        decoded = torch.empty(n, dtype=torch.float32, device=flat.device)
        for r in range(self.world_size):  # in rank order: the same sum on every machine
            ops.unpack_dequantize_int8(
                recv[r * packed_bytes : (r + 1) * packed_bytes], decoded, group_size=self.group_size
            )
            total.add_(decoded)
        return total.div_(self.divisor) if self.divisor != 1 else total


class AcrossGroups:
    """Hybrid groups: ``inner`` reduces inside the shard group (dividing by the whole world's size),
    then the ranks at this position in every group sum their parts: an all-reduce on the replica
    group, at full width, or (``quantized``) as INT8 in two phases of ``(G-1)/G`` of the part each:
    a reduce-scatter through an all-to-all of INT8 groups (``Int8Reduce``: each rank sums its piece
    of every group's part in fp32, in group order), then an all-gather of the piece encoded once by
    its owner, which every rank (the owner too) decodes, so every group holds bitwise the same
    gradient shard and the groups' copies never drift apart."""

    def __init__(
        self,
        inner: GradientWire,
        replica_group: Optional[dist.ProcessGroup],
        device: torch.device,
        quantized: bool,
        group_size: int,
    ) -> None:
        self.inner, self.group, self.group_size = inner, replica_group, group_size
        self.identity = False
        self.divides_first = inner.divides_first
        self.groups = rank_and_size(replica_group)[1]
        self.scatter = Int8Reduce(replica_group, device, group_size, divisor=1) if quantized else None

    def reduce(self, flat: Tensor, divided: bool = False) -> Tensor:
        part = self.inner.reduce(flat, divided)
        if self.scatter is None:
            comm.all_reduce(part, dist.ReduceOp.SUM, self.group)
            return part
        piece = self.scatter.reduce(part)
        packed = ops.quantize_pack_int8(piece, group_size=self.group_size)
        recv = torch.empty(self.groups * packed.numel(), dtype=torch.uint8, device=packed.device)
        comm.all_gather(recv, packed, self.group)
        out = torch.empty(part.numel(), dtype=torch.float32, device=part.device)
        for bytes_, values in zip(recv.chunk(self.groups), out.chunk(self.groups)):
            ops.unpack_dequantize_int8(bytes_, values, group_size=self.group_size)
        return out
