"""Gradient landing: each unit's reduced gradient shard copied into a host buffer and released on the
device, so that with the optimizer on the host no gradient waits on the device for the step.

[Note: gradients leave the device as they are reduced]
Each unit's gradient shard is copied to a pinned host buffer on a copy stream of its own, with one
event per unit; the step reads a unit's host gradient only after waiting for that unit's event
(``wait``), so it starts on the first unit while the others are still crossing PCIe. Once its copy is
issued, the unit's device gradient is released (``Unit.land``: the allocator reuses the memory once the
copy has read it), after its sum (the agreement's finiteness check) and, where the last window asked
for it, its sum of squares (clipping's norm) were measured there. A reader that needs the device
gradient again (another reduction into the unit, the per-parameter norms, several optimizers) has it
copied back (``Unit.recall``), in the dtype it left. So the device holds, at any time, the gradients
of the units whose copy is still running, not the model's: with everything on the host, the peak
device memory of a step is the forward's.

A window whose unit got exactly one reduction holds its gradient in the working dtype (``Unit.pending``);
in bf16 that crosses PCIe as it is, in half the bytes of fp32, into a bf16 host buffer, and the host
kernel reads it there (``ops.host_adam``: the fp32 value is the bf16 one exactly); any other reader gets
it in fp32 (``HostOptimizer.step_grad`` widens it first). No fp32 copy of a landed gradient is made
on the device.

When. The agreement on the window (a few bytes read back at finalize) must come first. Through the copy
engine, on an H200, that read-back waits behind every copy to the host already queued, whatever the
stream, its priority or the chunking (``benchmarks/kernels.py readback``); where the reducer reads it back
through mapped host memory instead (``comm.mapped_readback``: a kernel stores the flags into pinned
memory, no copy engine involved), it waits for nothing, so in a backward that ends the window (the caller
said so: ``boundary=True``, which the Trainer passes with managed accumulation) every unit is copied as
soon as it is reduced. Without mapped read-back a unit is copied then only if no earlier such copy is
still running, and never the unit reduced last (the first unit: the read-back comes right after it); the
read-back then waits for the rest of one unit's copy at most. The other units (all of them in an
unmanaged window, and a unit that got gradients again after its copy) are copied at finalize: before
the agreement where the read-back is mapped (``ready``), after it otherwise (``done``). The measurements
behind this order are in ``benchmarks/results/`` (``d2h_readback``).

On a machine without a GPU "host" and "device" are the same memory; the code path is the same (a copy,
then the release) and is what the CPU tests exercise.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.nulls import nothing
from lightning_zeroq.swap.buffers import pinned_empty
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.offload.host_worker import HostWorker
from lightning_zeroq.zero.unit import ParamGrads, Unit

IN_FLIGHT = 3
"""Copies to the host a backward may have running at once. A device gradient a copy still reads is kept
from the allocator until that copy ends, so a backward that outran PCIe would make it reserve a new
unit-sized block for every further unit, in the reduction stream's cache, which the activations cannot
use; past this many, the CPU waits for the oldest copy before it issues the next (the step needs every
copy anyway)."""


class GradientLanding:
    """The host buffers the units' gradient shards land in, and the copies that fill them."""

    def __init__(self, device: torch.device, pin: bool, worker: HostWorker) -> None:
        self.device, self.pin = device, pin
        self.worker = worker
        """The host's worker, whose jobs (an asynchronous step's) may still read a unit's host gradient."""
        self.numels: dict[int, int] = {}
        """The host units, with their shard's elements."""
        self.host_grads: dict[int, Tensor] = {}
        """fp32 host gradient buffers, made for every host unit at the first fp32 landing or reader
        (``_fp32_buffer``): a window of one bf16 reduction stepped by the host kernel never needs them."""
        self.half_grads: dict[int, Tensor] = {}
        """bf16 host gradient buffers (made at a unit's first bf16 copy)."""
        self.before_fp32: Callable[[int], None] = nothing
        """Called with the bytes the fp32 buffers take, before they are made (``memory.host.HostBudget``)."""
        self.copies = comm.side_stream(device)
        """CUDA only: the stream the gradient shards leave the device on."""
        self.in_flight: dict[int, "torch.cuda.Event"] = {}
        """Units whose copy to the host may still be running, with its event."""
        self.fresh: set[int] = set()
        """Units whose host gradient already holds this window's gradients."""
        self.half: set[int] = set()
        """Fresh units whose host gradient is the bf16 copy (``half_grads``), not yet widened."""
        self.copy_early = False
        """This backward ends the window (``begin``): copy units as they are reduced."""
        self.copy_all = comm.mapped_readback(device)
        """The agreement's read-back does not wait for copies to the host: copy every unit at once."""
        self.early: list["torch.cuda.Event"] = []
        """The events of the copies issued during this backward that may still be running."""
        self.order: list[int] = []
        """The units reduced in this backward, in order."""
        self.last: Optional[int] = None
        """The unit the last backward reduced last (before any: the first unit)."""
        self.leaving: collections.deque["torch.cuda.Event"] = collections.deque()
        """The events of the copies issued that may still be running, oldest first (``IN_FLIGHT``)."""

    def add(self, index: int, numel: int) -> None:
        self.numels[index] = numel

    def forget(self, index: int) -> None:
        """Unit ``index`` no longer steps on the host (``auto.AutoSplit`` moved it to the device)."""
        self.numels.pop(index, None)
        self.host_grads.pop(index, None)
        self.half_grads.pop(index, None)
        self.fresh.discard(index)
        self.half.discard(index)

    def begin(self, last: bool) -> None:
        self.copy_early = last
        if self.order:
            self.last, self.order = self.order[-1], []

    def reduced(self, unit: Unit, half_ok: bool) -> bool:
        """A reduction reached ``unit``; True if it was copied to the host now (see the module's note)."""
        self.fresh.discard(unit.index)  # more gradients arrived: an earlier copy is stale
        self.half.discard(unit.index)
        self.order.append(unit.index)
        if not self.copy_early or unit.index not in self.numels:
            return False
        # Without mapped read-back, the unit reduced last (as the last backward did) is left to
        # finalize: its copy would sit whole before the read-back.
        last = self.last if self.last is not None else min(self.numels)
        if not (self.copy_all or (unit.index != last and self._copies_idle())):
            return False
        self.copy(unit, half_ok)  # on the reduction stream, as finalize would (bitwise the same)
        if not self.copy_all and unit.index in self.in_flight:
            self.early.append(self.in_flight[unit.index])
        return True

    def _copies_idle(self) -> bool:
        """No copy issued during this backward is still running."""
        self.early = [done for done in self.early if not done.query()]
        return not self.early

    def copy(self, unit: Unit, half_ok: bool) -> None:
        """Copy the unit's gradient shard to the host after what the current stream issued so far (its
        reduction), on the copy stream, and release it on the device. The window's single reduced part
        goes as it is where it is bf16 and ``half_ok`` (the host kernel reads it); otherwise in fp32."""
        self.worker.wait(unit.index)  # an asynchronous step may still read the host gradient
        if (
            half_ok
            and unit.flat.dtype == torch.bfloat16
            and not (unit.has_grad_storage or unit.pending is not None or unit.landed is not None)
        ):
            self._half_buffer(unit).zero_()  # no gradient this window: zeros, as a materialized shard holds
            self.fresh.add(unit.index)
            self.half.add(unit.index)
            return
        pending = unit.pending
        assert not isinstance(pending, ParamGrads), "a unit stepped on the host gets its reduced part as one tensor"
        half = half_ok and pending is not None and not unit.has_grad_storage and pending.dtype == torch.bfloat16
        if half:
            assert pending is not None  # half says so
            source, host = pending, self._half_buffer(unit)
        else:
            unit.materialize_grad()
            source, host = unit.grad, self._fp32_buffer(unit.index)
        if self.copies is None:
            host.copy_(source)
        else:
            self.copies.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copies):
                host.copy_(source, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copies)
            self.in_flight[unit.index] = done
            self.leaving.append(done)
            while len(self.leaving) > IN_FLIGHT:
                self.leaving.popleft().synchronize()
        unit.land(functools.partial(self._recall, unit.index, host), self.copies)
        self.fresh.add(unit.index)
        if half:
            self.half.add(unit.index)

    def _recall(self, index: int, host: Tensor) -> Tensor:
        """Unit ``index``'s landed gradient on the device again, as a new tensor."""
        done = self.in_flight.get(index)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return torch.empty(host.shape, dtype=host.dtype, device=self.device).copy_(host, non_blocking=self.pin)

    def _half_buffer(self, unit: Unit) -> Tensor:
        buffer = self.half_grads.get(unit.index)
        if buffer is None:
            buffer = self.half_grads[unit.index] = pinned_empty(self.numels[unit.index], torch.bfloat16, self.pin)
        return buffer

    def _fp32_buffer(self, index: int) -> Tensor:
        if not self.host_grads:
            self.before_fp32(4 * sum(self.numels.values()))
            self.host_grads = {i: pinned_empty(n, torch.float32, self.pin).zero_() for i, n in self.numels.items()}
        return self.host_grads[index]

    def ready(self, units: Sequence[Unit], half_ok: bool) -> None:
        """Before the agreement's read-back: with a mapped read-back, the last copies now."""
        if self.copy_all:
            self.done(units, half_ok)

    def done(self, units: Sequence[Unit], half_ok: bool) -> None:
        """After it: every unit whose host gradient is not this window's yet."""
        for unit in reversed(units):
            if unit.index not in self.fresh and unit.index in self.numels:
                self.copy(unit, half_ok)

    def wait(self, index: int) -> None:
        """The host waits for unit ``index``'s copy, if one is pending (and forgets it)."""
        wait_event(self.in_flight, index)

    def landed(self, index: int) -> bool:
        """Whether unit ``index``'s copy to the host has ended (without waiting for it)."""
        done = self.in_flight.get(index)
        return done is None or done.query()

    def as_landed(self, unit: Unit) -> Tensor:
        """The unit's host gradient as it landed (bf16 where it crossed so), for the kernel, once there."""
        self.wait(unit.index)
        return self.buffer(unit.index)

    def clear(self, unit: Unit, spans: Sequence[slice]) -> None:
        """Zero parts of the unit's host gradient where it is kept: the bf16 copy as it landed (not widened:
        another reader may still read the rest so), else the fp32 buffer where there is one (where there is
        none yet, it is made zeroed)."""
        self.wait(unit.index)
        grad = self.half_grads[unit.index] if unit.index in self.half else self.host_grads.get(unit.index)
        if grad is not None:
            for span in spans:
                grad[span].zero_()

    def buffer(self, index: int) -> Tensor:
        """The buffer unit ``index``'s gradient lands in this window (its copy may still be running)."""
        return self.half_grads[index] if index in self.half else self.host_grads[index]

    def fp32(self, unit: Unit) -> Tensor:
        """The unit's fp32 host gradient (the bf16 copy widened in place: exact)."""
        self.wait(unit.index)
        grad = self._fp32_buffer(unit.index)
        if unit.index in self.half:
            grad.copy_(self.half_grads[unit.index])
            self.half.discard(unit.index)
        return grad

    def end_window(self) -> None:
        """Before the device gradient shards are released: the copies still reading them come first."""
        current = torch.cuda.current_stream(self.device) if self.in_flight else None
        for done in self.in_flight.values():
            assert current is not None  # set whenever a copy is in flight
            current.wait_event(done)
        self.in_flight.clear()
        self.leaving.clear()
        self.fresh.clear()
        self.half.clear()
        self.copy_early, self.early = False, []


def wait_event(events: dict[int, "torch.cuda.Event"], index: int) -> None:
    """The host waits for unit ``index``'s event, if one is pending (and forgets it)."""
    done = events.pop(index, None)
    if done is not None:
        done.synchronize()
