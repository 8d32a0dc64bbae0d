"""What a rank contributes to, or takes from, a checkpoint tensor stored at its full shape.

``LocalChunks``: the rank's contiguous flat range ``[start, start + numel)`` of a tensor of ``shape``,
as the boxes of ``boxes.flat_range_boxes``. For saving, ``read()`` returns the range as a 1-D tensor
when the writer gets to it (so an engine can make the data resident only then, one unit at a time);
for loading, ``target`` is the 1-D tensor the range is read into. Every box is a view of that 1-D
tensor, so nothing is copied to change shapes.

``BytesTarget``: a non-tensor value (an optimizer hyperparameter) to be read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

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
