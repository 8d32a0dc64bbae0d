"""CPU offload: master shards, optimizer state and gradient copies in (pinned) host memory.

Optimizer. The fp32 master shard of every unit and the optimizer state live on the host; the
optimizer steps there with torch's fused CPU kernel (``optimizers.prefer_fast_host_step``).

Gradients to the host. Each unit's fp32 gradient shard is copied to a pinned host buffer on a copy
stream of its own, with one event per unit; the step reads a unit's host gradient only after waiting
for that unit's event (``step_grad``), so it starts on the first unit while the others are still
crossing PCIe. The agreement on the window (a few bytes read back at finalize) must come first, and
on an H200 it waits behind every copy to the host already queued, whatever the stream, its priority
or the chunking (``benchmarks/d2h_readback.py``). So in a backward that ends the window (the caller
said so: ``boundary=True``, which the Trainer passes with managed accumulation) a unit is copied as
soon as it is reduced only if no earlier such copy is still running, and never the unit reduced last
(the first unit: the read-back comes right after it); the read-back then waits for the rest of one
unit's copy at most. The other units (all of them in an unmanaged window, and a unit that got
gradients again after its copy) are copied at finalize, after the read-back. (On the 953M model on
one H200, copying every unit during the backward made the agreement wait 45 ms for all 3.8 GB;
copying them all after it, the host step took 262 ms instead of 227 while they landed.)

The step walks the units one at a time, in the order their gradients were reduced (reverse unit
order, the same on every rank, so the collectives of ``publish`` match): the copy back and the
gather of one unit (asynchronous on the GPU) overlap the host update of the next.

Weights back to the device (``device_working``). The fp32 master crosses PCIe as it is, in chunks,
and is cast to the working dtype on the GPU: the CPU only enqueues the copies. (Casting on the host
first halves the bytes on PCIe but cost the CPU about a third of the AdamW step's time on the 953M
model, as a second pass over the masters; the copy engine is otherwise idle during the host step.)

Parameters (stage 3). A transient unit's payload rests in pinned host memory and is copied to the
device right before each gather (on the gather stream when prefetched). After a step the host master
is cast to that payload on the GPU and copied back (``HostStore.put``), not on the CPU.

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

from lightning_zeroq.zero import comm
from lightning_zeroq.zero.offload.device import OptimizerPlacement, copy_cast_to_device
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
        self.copies = comm.side_stream(device)
        """CUDA only: the stream the gradient shards leave the device on."""
        self.in_flight: dict[int, "torch.cuda.Event"] = {}
        """Units whose gradient copy to the host may still be running, with its event."""
        self.fresh: set[int] = set()
        """Units whose host gradient already holds this window's gradients."""
        self.device_reads: dict[int, "torch.cuda.Event"] = {}
        """Units whose master the device may still be reading (``published``), with the event after it."""
        self.copy_early = False
        """This backward ends the window (``begin_backward``): copy units as they are reduced."""
        self.early: list["torch.cuda.Event"] = []
        """The events of the copies issued during this backward that may still be running."""
        self.also_on: Optional[torch.device] = None
        """Partial offload (``split.SplitOptimizer``): the optimizer's groups hold segments on this device too."""

    def adopt_master(self, index: int, shard: Tensor) -> Tensor:
        master = host_copy(shard, self.pin)
        self.host_grads[index] = host_copy(torch.zeros_like(master), self.pin)
        return master

    def master_on_device(self, index: int) -> bool:
        return False

    def attach(self, units: Sequence[Unit], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                prefer_fast_host_step(optimizer, group, self.also_on)
        _give_the_host_step_threads(self.world_size)

    def begin_backward(self, last: bool) -> None:
        self.copy_early = last

    def grad_reduced(self, unit: Unit) -> None:
        self.fresh.discard(unit.index)  # more gradients arrived: an earlier copy is stale
        # The unit reduced last (the first) is left to finalize: its copy would sit whole before the read-back.
        if self.copy_early and unit.index in self.host_grads and unit.index != min(self.host_grads) \
                and self._copies_idle():
            unit.materialize_grad()  # on the reduction stream, as finalize would (bitwise the same)
            self._copy_to_host(unit)
            if unit.index in self.in_flight:
                self.early.append(self.in_flight[unit.index])

    def _copies_idle(self) -> bool:
        """No copy issued during this backward is still running (see the module's docstring)."""
        self.early = [done for done in self.early if not done.query()]
        return not self.early

    def _copy_to_host(self, unit: Unit) -> None:
        """Copy the unit's gradient shard to the host after what the current stream issued so far (its
        reduction), on the copy stream; ``step_grad`` waits for it."""
        host = self.host_grads[unit.index]
        if self.copies is None:
            host.copy_(unit.grad)
        else:
            self.copies.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copies):
                host.copy_(unit.grad, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copies)
            self.in_flight[unit.index] = done
        self.fresh.add(unit.index)

    def resident(self, units: Sequence[Unit]) -> Iterator[Unit]:
        """The units in order; each only once the device finished reading its master (whoever writes
        the masters walks them through here: the step, checkpoint loads, ``gathered_parameters``)."""
        for unit in units:
            self.wait_device_reads(unit.index)
            yield unit

    def published(self, unit: Unit) -> None:
        if self.pin:  # the copies just issued read the pinned master asynchronously
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.device_reads[unit.index] = done

    def wait_device_reads(self, index: int) -> None:
        _wait(self.device_reads, index)

    def step_batches(self, units: Sequence[Unit]) -> Iterator[list[Unit]]:
        for unit in self.resident(list(reversed(units))):  # the order the gradients left the device
            yield [unit]

    def gradients_done(self, units: Sequence[Unit]) -> None:
        for unit in reversed(units):
            if unit.index not in self.fresh:
                self._copy_to_host(unit)

    def step_grad(self, unit: Unit) -> Tensor:
        _wait(self.in_flight, unit.index)
        return self.host_grads[unit.index]

    def device_master(self, unit: Unit) -> Tensor:
        return unit.master.to(self.device, non_blocking=True)

    def device_working(self, unit: Unit, dtype: torch.dtype) -> Tensor:
        if self.pin and dtype != unit.master.dtype:
            return copy_cast_to_device(torch.empty(unit.master.shape, dtype=dtype, device=self.device), unit.master)
        return unit.master.to(device=self.device, dtype=dtype, non_blocking=True)

    def end_window(self) -> None:
        """Before the device gradient shards are released: the copies still reading them come first."""
        current = torch.cuda.current_stream(self.device) if self.in_flight else None
        for done in self.in_flight.values():
            assert current is not None  # set whenever a copy is in flight
            current.wait_event(done)
        self.in_flight.clear()
        self.fresh.clear()
        self.copy_early, self.early = False, []


def _wait(events: dict[int, "torch.cuda.Event"], index: int) -> None:
    """The host waits for unit ``index``'s event, if one is pending (and forgets it)."""
    done = events.pop(index, None)
    if done is not None:
        done.synchronize()


class HostStore:
    """Stage 3 parameter offload to CPU: each transient unit's payload in a pinned host buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numels: dict[int, int]) -> None:
        self.device, self.pin = device, device.type == "cuda"
        self.buffers = {i: host_copy(torch.empty(n, dtype=dtype), self.pin) for i, n in numels.items()}

    def put(self, unit: Unit, payload: Tensor) -> None:
        buffer = self.buffers[unit.index]
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

