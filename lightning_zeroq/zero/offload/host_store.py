"""Stage 3 parameter offload to CPU: each transient unit's payload rests in a pinned host buffer between
gathers (see ``host.py`` for how the host kernel writes the step's payload there directly)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zeroq.zero.offload.device import copy_cast_to_device
from lightning_zeroq.zero.unit import Unit


def host_copy(tensor: Tensor, pin: bool) -> Tensor:
    """A host copy of ``tensor``, pinned where a GPU will copy from or to it."""
    host = tensor.detach().to("cpu", copy=True)
    return host.pin_memory() if pin else host


class HostStore:
    """Stage 3 parameter offload to CPU: each transient unit's payload in a pinned host buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numels: dict[int, int]) -> None:
        self.device, self.pin = device, device.type == "cuda"
        self.buffers = {i: host_copy(torch.empty(n, dtype=dtype), self.pin) for i, n in numels.items()}

    def put(self, unit: Unit, payload: Tensor) -> None:
        buffer = self.buffers[unit.index]
        if payload.data_ptr() == buffer.data_ptr():
            return  # the host kernel wrote the step's payload here (``HostOptimizer.store_built``)
        if self.pin and payload.device.type == "cpu" and payload.dtype != buffer.dtype:
            # A host master (optimizer offload): cast on the GPU and copy the payload back, so the CPU,
            # which steps the next unit meanwhile, only enqueues copies (casting 953M fp32 elements on
            # the CPU took 72 ms of a 442 ms step on one H200). Both casts round to nearest even.
            payload = copy_cast_to_device(torch.empty(payload.shape, dtype=buffer.dtype, device=self.device), payload)
        buffer.copy_(payload, non_blocking=True)

    def get(self, unit: Unit) -> Tensor:
        return self.buffers[unit.index].to(self.device, non_blocking=True)

    def device_tensors(self) -> list[Tensor]:
        return []

    def close(self) -> None:
        pass

