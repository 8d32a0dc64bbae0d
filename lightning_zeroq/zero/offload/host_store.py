"""Stage 3 parameter offload to CPU: each transient unit's payload rests in a pinned host buffer between
gathers (see ``host.py`` for how the host kernel writes the step's payload there directly); a gather
reads it there (``Wire.gather`` takes a payload wherever it rests)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_zeroq.swap.buffers import pinned_empty
from lightning_zeroq.zero.offload.device import copy_cast_to_device
from lightning_zeroq.zero.unit import Unit


def host_copy(tensor: Tensor, pin: bool, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A host copy of ``tensor`` (in ``dtype``, default its own), pinned where a GPU will copy from or
    to it (exactly its bytes: ``pinned_empty``)."""
    if not pin:
        return tensor.detach().to("cpu", dtype=dtype, copy=True)
    host = pinned_empty(tensor.numel(), dtype or tensor.dtype).view(tensor.shape)
    return host.copy_(tensor.detach())


class HostStore:
    """Stage 3 parameter offload to CPU: each transient unit's payload in a pinned host buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numels: dict[int, int]) -> None:
        self.device, self.pin = device, device.type == "cuda"
        self.buffers = {i: pinned_empty(n, dtype, self.pin) for i, n in numels.items()}

    def put(self, unit: Unit, payload: Tensor) -> None:
        buffer = self.buffers[unit.index]
        if payload.data_ptr() == buffer.data_ptr():
            return  # the host kernel wrote the step's payload here (``HostOptimizer.store_built``)
        if self.pin and payload.device.type == "cpu" and payload.dtype != buffer.dtype:
            # A host master (optimizer offload): cast on the GPU and copy the payload back, so the CPU,
            # which steps the next unit meanwhile, only enqueues copies (a cast of every master on the CPU
            # would sit in the step's critical path). Both casts round to nearest even.
            payload = copy_cast_to_device(torch.empty(payload.shape, dtype=buffer.dtype, device=self.device), payload)
        buffer.copy_(payload, non_blocking=True)

    def get(self, unit: Unit) -> Tensor:
        # The pinned buffer itself: the wire copies it to the device (at one rank in the shard group with
        # full-width shards, straight into the working buffer: no unit-sized device copy in between).
        return self.buffers[unit.index]

    def device_tensors(self) -> list[Tensor]:
        return []

    def close(self) -> None:
        pass

