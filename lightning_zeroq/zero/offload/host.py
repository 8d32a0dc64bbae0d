"""CPU offload: master shards, optimizer state and gradient copies in (pinned) host memory.

Optimizer. The fp32 master shard of every unit and the optimizer state live on the host; the
optimizer steps there with torch's fused CPU kernel (``optimizers.prefer_fast_host_step``). Each
unit's fp32 gradient shard is copied to a host buffer: during a managed window's last backward as
soon as the unit is reduced (on the reduction stream, overlapping the rest of the backward), or at
finalize for the units that were not. The step walks the units one at a time, so the copy back and
the gather of one unit (asynchronous on the GPU) overlap the host update of the next. The working
shard goes back at half the bytes: the master is cast on the host into a pinned staging buffer.

Parameters (stage 3). A transient unit's payload rests in pinned host memory and is copied to the
device right before each gather (on the gather stream when prefetched).

On a machine without a GPU "host" and "device" are the same memory; the code path is the same and
is what the CPU tests exercise. Host buffers are pinned only where a GPU copies from or to them.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.zero.offload.device import OptimizerPlacement
from lightning_zeroq.zero.optimizers import prefer_fast_host_step
from lightning_zeroq.zero.unit import Unit


def host_copy(tensor: Tensor, pin: bool) -> Tensor:
    """A host copy of ``tensor``, pinned where a GPU will copy from or to it."""
    host = tensor.detach().to("cpu", copy=True)
    return host.pin_memory() if pin else host


class HostOptimizer(OptimizerPlacement):
    """Masters and optimizer state in host memory; the step runs on the CPU, unit by unit."""

    def __init__(self, device: torch.device, param_dtype: torch.dtype, world_size: int) -> None:
        super().__init__(device)
        self.pin = device.type == "cuda"
        self.param_dtype, self.world_size = param_dtype, world_size
        self.host_grads: dict[int, Tensor] = {}
        self.staging: dict[int, Tensor] = {}
        """CUDA only: pinned working-dtype copy of the master for the host-to-device copy."""
        self.fresh: set[int] = set()
        """Units whose host gradient already holds this window's gradients."""
        self.also_on: Optional[torch.device] = None
        """Partial offload (``split.SplitOptimizer``): the optimizer's groups hold segments on this device too."""

    def adopt_master(self, index: int, shard: Tensor) -> Tensor:
        master = host_copy(shard, self.pin)
        self.host_grads[index] = host_copy(torch.zeros_like(master), self.pin)
        if self.pin:
            self.staging[index] = host_copy(torch.empty(shard.numel(), dtype=self.param_dtype), self.pin)
        return master

    def attach(self, units: Sequence[Unit], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                prefer_fast_host_step(optimizer, group, self.also_on)
        _give_the_host_step_threads(self.world_size)

    def grad_reduced(self, unit: Unit, boundary: bool) -> None:
        if boundary:  # the window's last backward: this copy overlaps the rest of the backward
            self.host_grads[unit.index].copy_(unit.grad, non_blocking=True)
            self.fresh.add(unit.index)
        else:  # more gradients arrived: an earlier copy is stale
            self.fresh.discard(unit.index)

    def step_batches(self, units: Sequence[Unit]) -> Iterator[list[Unit]]:
        for unit in self.resident(units):
            yield [unit]

    def gradients_done(self, units: Sequence[Unit]) -> None:
        for unit in units:
            if unit.index not in self.fresh:
                self.host_grads[unit.index].copy_(unit.grad, non_blocking=True)
                self.fresh.add(unit.index)

    def step_grad(self, unit: Unit) -> Tensor:
        return self.host_grads[unit.index]

    def device_master(self, unit: Unit) -> Tensor:
        return unit.master.to(self.device, non_blocking=True)

    def device_working(self, unit: Unit, dtype: torch.dtype) -> Tensor:
        staging = self.staging.get(unit.index)
        if staging is not None and dtype == staging.dtype:  # cast on the host, copy half the bytes
            staging.copy_(unit.master)
            return staging.to(self.device, non_blocking=True)
        return unit.master.to(device=self.device, dtype=dtype)

    def end_window(self) -> None:
        self.fresh.clear()


class HostStore:
    """Stage 3 parameter offload to CPU: each transient unit's payload in a pinned host buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numels: dict[int, int]) -> None:
        self.device, pin = device, device.type == "cuda"
        self.buffers = {i: host_copy(torch.empty(n, dtype=dtype), pin) for i, n in numels.items()}

    def put(self, unit: Unit, payload: Tensor) -> None:
        self.buffers[unit.index].copy_(payload, non_blocking=True)

    def get(self, unit: Unit) -> Tensor:
        return self.buffers[unit.index].to(self.device, non_blocking=True)

    def device_tensors(self) -> list[Tensor]:
        return []

    def close(self) -> None:
        pass


_THREADS_SET: list[int] = []


def _give_the_host_step_threads(world_size: int) -> None:
    """The host step runs on torch's intra-op threads. torchrun sets ``OMP_NUM_THREADS=1`` for every
    rank it starts unless the user set it (953M GPT on 2 H200s: 1.20 s a step with 1 thread, 0.32 s
    with 16): under torchrun with that default, use the cores per local rank and say so once;
    elsewhere, one thread is the user's choice, and gets a warning."""
    if torch.get_num_threads() != 1:
        return
    cores = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    threads = max(1, cores // max(1, local_ranks))
    if threads == 1:
        return
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("OMP_NUM_THREADS") == "1":
        torch.set_num_threads(threads)
        if not _THREADS_SET:
            _THREADS_SET.append(threads)
            logging.getLogger("lightning_zeroq").info(
                f"offload_optimizer: torchrun left each rank 1 thread (OMP_NUM_THREADS=1); the host step now uses "
                f"{threads} ({cores} cores / {local_ranks} local ranks). Set OMP_NUM_THREADS to another value to choose."
            )
        return
    warnings.warn(
        "offload_optimizer: the optimizer step runs on the CPU with 1 thread (torch.get_num_threads() == 1). "
        f"Set OMP_NUM_THREADS to the cores per rank, e.g. OMP_NUM_THREADS={threads}, or call torch.set_num_threads().",
        stacklevel=4,
    )

