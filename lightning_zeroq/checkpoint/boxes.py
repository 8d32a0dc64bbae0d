"""A contiguous flat range of a tensor, as rectangular boxes of its full shape. Pure arithmetic.

A rank of a ZeRO engine owns a contiguous range ``[start, stop)`` of each parameter's flattened
(row-major) elements. A checkpoint stores every tensor at its full shape as chunks with offsets and
sizes (``torch.distributed.checkpoint``'s ``ChunkStorageMetadata``), so the range is cut into
rectangular boxes: a partial row at each end, recursively, and the whole rows in between. For a
tensor of ``ndim`` dimensions that is at most ``2 * ndim - 1`` boxes (one for a 0-d tensor).

Every box is itself contiguous in the flat order (its leading dimensions are single indices, one
dimension is a range and the trailing ones are whole), and the boxes come in flat order, so box
``i`` holds the flat elements ``[Box.flat_start, Box.flat_start + Box.numel)`` and a rank's flat
segment is the concatenation of its boxes. That is what lets a box be a plain view of a flat shard.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence


class Box(NamedTuple):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int
    """First element of the box in the tensor's flat (row-major) order."""

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes covering the flat elements ``[start, stop)`` of a tensor of ``shape``, in flat order."""
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape} ({total} elements)")
    if start == stop:
        return []
    out: list[Box] = []
    _cut(shape, start, stop, (), out, start)
    return out


def _cut(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...], out: list[Box], flat: int) -> None:
    """Append the boxes of ``[start, stop)``, counted within the sub-tensor at index ``prefix``."""
    ones = (1,) * len(prefix)
    if not shape:  # a 0-d (sub-)tensor: one element
        out.append(Box(prefix, ones, flat))
        return
    row = math.prod(shape[1:])  # elements per index of the leading dimension
    rest = (0,) * (len(shape) - 1)
    if start % row == 0 and stop % row == 0:  # whole rows only: one box
        out.append(Box(prefix + (start // row,) + rest, ones + (stop // row - start // row,) + shape[1:], flat))
        return
    first, last = start // row, (stop - 1) // row
    if first == last:  # inside one row
        _cut(shape[1:], start - first * row, stop - first * row, prefix + (first,), out, flat)
        return
    whole_from, whole_to = -(-start // row), stop // row
    if start % row:  # the partial row at the start
        _cut(shape[1:], start % row, row, prefix + (first,), out, flat)
        flat += row - start % row
    if whole_to > whole_from:
        out.append(Box(prefix + (whole_from,) + rest, ones + (whole_to - whole_from,) + shape[1:], flat))
        flat += (whole_to - whole_from) * row
    if stop % row:  # the partial row at the end
        _cut(shape[1:], 0, stop % row, prefix + (whole_to,), out, flat)
