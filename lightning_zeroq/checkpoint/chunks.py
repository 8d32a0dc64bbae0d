"""What a rank contributes to, or takes from, a checkpoint tensor stored at its full shape.

``LocalChunks``: the rank's contiguous flat range ``[start, start + numel)`` of a tensor of ``shape``,
as the boxes of ``boxes.flat_range_boxes``. For saving, ``read()`` returns the range as a 1-D tensor
when the writer gets to it (so an engine can make the data resident only then, one unit at a time);
for loading, ``target`` is the 1-D tensor the range is read into. Every box is a view of that 1-D
tensor, so nothing is copied to change shapes.

``BytesTarget``: a non-tensor value (an optimizer hyperparameter) to be read back.

``check_chunks`` and ``chunk_mismatch``: what every reader (``fit``, ``fabric.load``,
``load_from_checkpoint``, ``zeroq-convert``) checks of a checkpoint's chunk metadata, so they accept
and refuse the same checkpoints with the same words: ``check_chunks`` when the checkpoint is opened
(each tensor's chunks lie inside its shape, do not overlap, cover it exactly, and each has a stored
item long enough for its elements), ``chunk_mismatch`` when an item is read (it holds its chunk's shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_zeroq.checkpoint.agree import earlier
from lightning_zeroq.checkpoint.boxes import Box, flat_range_boxes


@dataclass(eq=False)
class LocalChunks:
    shape: torch.Size
    dtype: torch.dtype
    start: int
    numel: int
    read: Optional[Callable[..., Tensor]] = None
    """Saving: returns the flat range (``numel`` elements, any device); called with no arguments (typed
    ``...`` because mypy cannot match the callers' default-argument lambdas to ``Callable[[], Tensor]``)."""
    target: Optional[Tensor] = None
    """Loading: the 1-D tensor the range is read into."""
    order: int = 0
    """Saving: the writer writes in increasing ``order`` (an engine's unit index)."""
    boxes: list[Box] = field(init=False)

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)
        self.boxes = flat_range_boxes(self.shape, self.start, self.start + self.numel)

    def box_view(self, flat: Tensor, index: int) -> Tensor:
        """Box ``index`` as a view of ``flat`` (the range as a 1-D tensor)."""
        box = self.boxes[index]
        begin = box.flat_start - self.start
        return flat[begin : begin + box.numel].view(box.sizes)

    def box_index(self, offsets: tuple[int, ...]) -> int:
        for i, box in enumerate(self.boxes):
            if box.offsets == tuple(offsets):
                return i
        raise KeyError(f"no box at offsets {tuple(offsets)} (boxes: {[b.offsets for b in self.boxes]})")


@dataclass(eq=False)
class BytesTarget:
    value: Any = None
    loaded: bool = False


Chunk = tuple[tuple[int, ...], tuple[int, ...]]
"""A stored chunk of a tensor: its offsets and its sizes in the tensor's full shape."""


def _edited(where: str, fqn: str, shape: tuple[int, ...], problem: str) -> str:
    return (
        f"{where}: the chunks it lists for {fqn!r} (shape {shape}) {problem}; the metadata was edited or damaged "
        f"after the save. {earlier()}"
    )


def check_chunks(metadata: Metadata, where: str) -> list[str]:
    """Every tensor's chunk metadata (``where``: the metadata file, for the messages): each chunk has
    the tensor's number of dimensions and lies inside its shape, no two overlap, together they hold
    exactly its elements, and each has a stored item of at least its elements' bytes. One error per
    tensor that fails, the same on every rank and in every reader."""
    items: dict[tuple[str, tuple[int, ...]], Any] = {}
    for index, info in metadata.storage_data.items():
        if index.offset is not None:
            items[(index.fqn, tuple(int(o) for o in index.offset))] = info
    errors = []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        try:
            shape = tuple(int(s) for s in md.size)
            chunks = list(
                dict.fromkeys((tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)) for c in md.chunks)
            )  # a replicated tensor's chunk may be listed twice
            itemsize = md.properties.dtype.itemsize
        except (AttributeError, TypeError, ValueError) as error:
            errors.append(_edited(where, fqn, (), f"are malformed ({error})"))
            continue
        problem = _chunk_problem(shape, chunks, fqn, items, itemsize)
        if problem is not None:
            errors.append(_edited(where, fqn, shape, problem))
    return errors


def _chunk_problem(shape: tuple[int, ...], chunks: list[Chunk], fqn: str, items: dict, itemsize: int) -> Optional[str]:
    if any(s < 0 for s in shape):
        return "have a negative size in the shape"
    filled = []
    for offsets, sizes in chunks:
        where = f"at offsets {offsets} with sizes {sizes}"
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"include one {where}, not of the tensor's {len(shape)} dimension(s)"
        if any(o < 0 for o in offsets) or any(s < 0 for s in sizes):
            return f"include one {where}, negative"
        numel = math.prod(sizes)
        if numel == 0:
            continue  # holds nothing (an empty shard): wherever it says it is
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            return f"include one {where}, outside the tensor"
        info = items.get((fqn, offsets))
        if info is None:
            return f"include one {where} that has no stored item"
        if not getattr(info, "transform_descriptors", None) and info.length < numel * itemsize:
            return (
                f"include one {where}, whose {numel * itemsize} bytes of elements do not fit its stored item "
                f"of {info.length} bytes"
            )
        filled.append((offsets, sizes))
    pair = _overlapping(filled)
    if pair is not None:
        return f"include two that overlap, at offsets {pair[0][0]} and {pair[1][0]}"
    held, total = sum(math.prod(sizes) for _, sizes in filled), math.prod(shape)
    if held != total:
        return f"hold {held} of its {total} elements"
    return None


def _overlapping(chunks: list[Chunk]) -> Optional[tuple[Chunk, Chunk]]:
    """Two of ``chunks`` (non-empty, inside the shape) that overlap, if any: a sweep along the dimension
    where their offsets differ most, comparing each chunk with those that reach past its start there."""
    if len(chunks) < 2:
        return None
    ndim = len(chunks[0][0])
    if ndim == 0:
        return chunks[0], chunks[1]  # two distinct non-empty chunks of a 0-d tensor
    d = max(range(ndim), key=lambda i: len({offsets[i] for offsets, _ in chunks}))
    active: list[Chunk] = []
    for chunk in sorted(chunks, key=lambda c: c[0][d]):
        start = chunk[0][d]
        active = [a for a in active if a[0][d] + a[1][d] > start]
        for other in active:
            if all(o < c + cs and c < o + os for o, os, c, cs in zip(other[0], other[1], chunk[0], chunk[1])):
                return other, chunk
        active.append(chunk)
    return None


def chunk_mismatch(
    where: str, fqn: str, shape: tuple[int, ...], chunk: tuple[int, ...], stored: tuple[int, ...]
) -> Optional[str]:
    """Why an item read for a chunk of sizes ``chunk`` cannot be used, if it holds another shape
    (``stored``). The message names the tensor, not the item: every rank (each reads its own items)
    and every reader says the same."""
    if tuple(chunk) == tuple(stored):
        return None
    return _edited(
        where, fqn, tuple(shape), "do not match the items stored for them (an item holds another shape than its chunk)"
    )
