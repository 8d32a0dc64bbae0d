"""CPU offload: master shards, optimizer state and gradient copies in (pinned) host memory.

Optimizer. The fp32 master shard of every unit and the optimizer state live on the host; the
optimizer steps there with torch's fused CPU kernel (``binding.prefer_fast_host_step``).

Gradients to the host: ``host_grads.GradientLanding`` copies each unit's reduced gradient shard into a
host buffer and releases it on the device (its note says when).

The host step. For torch's Adam and AdamW the host kernel (``ops.host_adam``, torch's fused
arithmetic bitwise) steps a unit's segments in one call: it reads bf16 gradients, applies the pending
gradient multiplier (unscaling and clipping) on the fly instead of a pass of its own, and, with bf16
working weights, writes the updated master rounded to bf16 beside it (``working``), which crosses
PCIe in half the bytes (``device_working``) or, with stage-3 parameter offload, is written straight
into the store's pinned buffer, so nothing crosses back. Other optimizers step through
``optimizer.step()`` with torch's fused CPU kernel where torch has one.

The step walks the units one at a time, in the order their gradients were reduced (reverse unit
order, the same on every rank, so the collectives of ``publish`` match): the copy back and the
gather of one unit (asynchronous on the GPU) overlap the host update of the next.

[Note: weights cross back in the working dtype, cast on the GPU]
Weights back to the device (``device_working``): the working-dtype copy the kernel wrote, where it is
fresh (bf16); otherwise (fp16, other optimizers) the fp32 master crosses PCIe as it is, in chunks, and
is cast to the working dtype on the GPU, so the CPU only enqueues the copies. A cast on the host is a
pass of its own over every master, in the host step's critical path (measured:
``benchmarks/results/offload_profile_gpu_cast_1xh200_2026-12-01.txt``). ``HostStore.put`` and
``DeviceStore.put`` (``stores.py``) follow this note.

Parameters (stage 3). A transient unit's payload rests in pinned host memory and is copied to the
device right before each gather (on the gather stream when prefetched). After a step the kernel's
bf16 copy is that payload already; otherwise the host master is cast to it on the GPU and copied back
(``HostStore.put``), not on the CPU.

On a machine without a GPU "host" and "device" are the same memory; the code path is the same and
is what the CPU tests exercise. Host buffers are pinned only where a GPU copies from or to them.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.ops.host_adam import HostAdam, host_adam
from lightning_zeroq.zero.offload.device import OptimizerHome
from lightning_zeroq.zero.offload.host_grads import GradientLanding, wait_event
from lightning_zeroq.zero.offload.host_kernel import KernelSteps, set_host_step_threads
from lightning_zeroq.zero.offload.host_worker import HostWorker
from lightning_zeroq.zero.offload.speculative_step import Speculation
from lightning_zeroq.zero.offload.stores import HostStore, ShardStore, copy_cast_to_device, host_copy
from lightning_zeroq.zero.optim.binding import Binding, adam_kind, prefer_fast_host_step, whole
from lightning_zeroq.zero.optim.matrix import is_matrix_optimizer
from lightning_zeroq.zero.unit import Unit


class HostOptimizer(OptimizerHome):
    """Masters and optimizer state in host memory; the step runs on the CPU, unit by unit."""

    def __init__(
        self,
        device: torch.device,
        param_dtype: torch.dtype,
        world_size: int,
        worker: HostWorker,
        speculative: bool = False,
    ) -> None:
        super().__init__(device)
        self.worker = worker
        """The host's worker (``host_worker.py``): speculative and asynchronous steps run there, and whatever
        reads or writes host gradients, masters or state outside them waits for it first."""
        self.speculative = speculative
        self.spec: Optional[Speculation] = None
        """Host steps taken during the backward (``speculative_step.py``), with ``speculative`` and the kernel."""
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stepping = False
        self.pin = device.type == "cuda"
        self.param_dtype, self.world_size = param_dtype, world_size
        self.landing = GradientLanding(device, self.pin, worker)
        self.multiplier: dict[int, float] = {}
        """Units whose host gradient still owes this multiplier (the kernel applies it as it steps)."""
        self.device_reads: dict[int, "torch.cuda.Event"] = {}
        """Units whose master the device may still be reading (``published``), with the event after it."""
        self.also_on: Optional[torch.device] = None
        """Partial offload (``split.SplitOptimizer``): the optimizer's groups hold segments on this device too."""
        self.kernel: Optional[KernelSteps] = None
        """The host kernel's steps, when an attached optimizer is torch's Adam or AdamW (and it loaded)."""
        self._shared: dict[int, Tensor] = {}

    def adopt_master(self, index: int, shard: Tensor) -> Tensor:
        master = host_copy(shard, self.pin)
        self.landing.add(index, master.numel())
        return master

    def master_on_device(self, index: int) -> bool:
        return False

    def store_built(self, store: ShardStore) -> None:
        """A host store: the kernel writes the units' bf16 copies into its buffers, which then hold the
        step's payload as soon as the step is done."""
        if isinstance(store, HostStore):
            self._shared = store.buffers
            if self.kernel is not None:
                self.kernel.share(store.buffers)

    def attach(self, units: Sequence[Unit], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.worker.wait()
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                prefer_fast_host_step(optimizer, group, self.also_on)
        set_host_step_threads(self.world_size)
        kernel = host_adam() if any(adam_kind(o) is not None or is_matrix_optimizer(o) for o in optimizers) else None
        if kernel is None:
            self.kernel = None
        elif self.kernel is None:
            self.kernel = KernelSteps(kernel, self.param_dtype, self.pin)
            self.kernel.share(self._shared)
        self._optimizers = list(optimizers)
        if self.spec is not None:
            self.spec.close()
        self.spec = (
            Speculation(self.worker, self.kernel, self._kernel_grad, self.wait_device_reads, self.landing.landed, units)
            if self.speculative and self.kernel is not None
            else None
        )
        if self.speculative and self.kernel is None:
            warnings.warn(
                "ZeroConfig: offload_speculative_step=True has no effect: it needs torch's Adam or AdamW "
                "stepped by the host kernel, and "
                + (
                    "the optimizer is neither"
                    if not any(adam_kind(o) is not None for o in optimizers)
                    else "the kernel did not load here (see the log)"
                )
                + ".",
                stacklevel=3,
            )

    def begin_backward(self, last: bool) -> None:
        self.worker.wait()
        self.landing.begin(last)
        if last and self.spec is not None:
            self.spec.open(self._optimizers)

    def grad_reduced(self, unit: Unit) -> None:
        if self.spec is not None:
            self.spec.regrown(unit)
        if self.landing.reduced(unit, self.kernel is not None) and self.spec is not None:
            self.spec.offer(unit)

    def resident(self, units: Sequence[Unit]) -> Iterator[Unit]:
        """The units in order; each only once the host's worker is done with it and the device finished
        reading its master (whoever writes the masters walks them through here: the step, checkpoint
        loads, ``gathered_parameters``). A walker other than the step sees the masters as before any
        speculative step, after all of the worker's work; the step's own walk waits unit by unit (a
        speculative step of the unit is then kept or undone, ``step_batch``)."""
        if not self._stepping:
            self.abandon_speculation()
            self.worker.wait()
        for unit in units:
            self.worker.wait(unit.index)
            self.wait_device_reads(unit.index)
            if self.kernel is not None:
                self.kernel.discard(unit.index)  # the walker may write the master
            yield unit

    def abandon_speculation(self) -> None:
        """Undo every speculative step of this window (a reader or writer comes before the step)."""
        if self.spec is not None:
            self.spec.undo_all()

    def published(self, unit: Unit) -> None:
        if self.pin:  # the copies just issued read the pinned master (or its bf16 copy) asynchronously
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.device_reads[unit.index] = done

    def wait_device_reads(self, index: int) -> None:
        wait_event(self.device_reads, index)

    def step_batches(self, units: Sequence[Unit]) -> Iterator[list[Unit]]:
        self._stepping = True  # the step's own walk keeps what it may (``step_batch``)
        try:
            for unit in self.resident(list(reversed(units))):  # the order the gradients left the device
                yield [unit]
        finally:
            self._stepping = False

    def gradients_ready(self, units: Sequence[Unit]) -> None:
        if self.spec is not None:
            self.spec.end_offers()  # the backward is over here (not yet on a GPU): the offered units still step
        self.landing.ready(units, self.kernel is not None)

    def gradients_done(self, units: Sequence[Unit]) -> None:
        self.landing.done(units, self.kernel is not None)

    def step_grad(self, unit: Unit) -> Tensor:
        """The unit's fp32 host gradient, with every multiplier owed applied (a reader other than the
        kernel: the optimizer's own step, value clipping)."""
        self.abandon_speculation()
        self.worker.wait()
        grad = self.landing.fp32(unit)
        owed = self.multiplier.pop(unit.index, None)
        if owed is not None:
            grad.mul_(owed)
        return grad

    def clear_spans(self, unit: Unit, spans: Sequence[slice]) -> None:
        self.abandon_speculation()
        self.worker.wait()
        self.landing.clear(unit, spans)

    def matrix_grad(self, unit: Unit) -> tuple[Tensor, float]:
        """With the kernel's Muon parts, the gradient as it landed (bf16 where it crossed so) and the
        multiplier it owes, which the kernel applies as it reads; else ``step_grad``'s."""
        if self.kernel is None or not self.kernel.kernel.muon:
            return self.step_grad(unit), 1.0
        self.abandon_speculation()
        self.worker.wait()
        # As it landed, and still so for a later reader (another optimizer's share of the unit widens it).
        return self._kernel_grad(unit), self.multiplier.get(unit.index, 1.0)

    def host_kernel(self, unit: Unit) -> Optional[HostAdam]:
        return self.kernel.kernel if self.kernel is not None else None

    def scale_grads(self, unit: Unit, spans: Sequence[slice], multiplier: float) -> None:
        if self.kernel is not None and list(spans) == [slice(None)] and unit.index not in self.multiplier:
            self.multiplier[unit.index] = multiplier  # the kernel multiplies as it reads, as mul_ would
            return
        super().scale_grads(unit, spans, multiplier)

    def step_batch(self, batch: Sequence[Unit], binding: Binding, used: Sequence[Any]) -> bool:
        """Step ``batch`` with the host kernel where it takes it (``host_kernel.KernelSteps``); else False, and
        ``optimizer.step()`` steps it."""
        spec = self.spec  # step_batches yields one unit at a time
        rest = [u for u in batch if spec is None or not spec.keep(u, binding, used, u.index in self.multiplier)]
        if rest and (
            self.kernel is None or not self.kernel.step(rest, binding, used, self._kernel_grad, self._owed(binding))
        ):
            if self.kernel is not None:
                for unit in rest:
                    self.kernel.discard(unit.index)  # the optimizer's own step writes these masters: no copy
            return False
        # A unit another optimizer shares keeps its gradient as it landed, and what it owes, for that one.
        self.landing.half.difference_update(u.index for u in batch if whole(u, binding))
        return True  # the kernel stepped them, or their step during the backward stands

    def _owed(self, binding: Binding) -> Callable[[Unit], float]:
        """The multiplier a unit still owes, for the kernel that steps ``binding``'s segments of it: taken
        where they are all of the unit's, else read (the unit's other optimizer reads it too)."""
        return lambda u: self.multiplier.pop(u.index, 1.0) if whole(u, binding) else self.multiplier.get(u.index, 1.0)

    def step_later(
        self, unit: Unit, binding: Binding, used: Sequence[Any], hypers: dict[int, dict[str, Any]]
    ) -> tuple[Optional["torch.cuda.Event"], list]:
        """For an asynchronous step (``async_step.py``), on the calling thread: the host kernel's jobs for
        ``unit`` (its state made, its step counts advanced, the multiplier it owes taken, as
        ``step_batch`` would) and the event of its gradient's copy to the host, which the worker waits
        for before running them; no jobs where a speculative step of it stands (kept here)."""
        assert self.kernel is not None  # AsyncHostStep.takes checked it
        index = unit.index
        self.wait_device_reads(index)
        self.kernel.discard(index)  # until the worker has run the jobs (``KernelSteps.stepped``)
        if self.spec is not None and self.spec.keep(unit, binding, used, index in self.multiplier):
            self.landing.half.discard(index)
            return None, []
        grad = self.landing.buffer(index)
        jobs = self.kernel.jobs(unit, binding, used, grad, self.multiplier.pop(index, 1.0), hypers)
        self.landing.half.discard(index)
        return self.landing.in_flight.get(index), jobs

    def _kernel_grad(self, unit: Unit) -> Tensor:
        return self.landing.as_landed(unit)

    def host_working(self, unit: Unit, dtype: torch.dtype) -> Optional[Tensor]:
        return self.kernel.copy(unit, dtype) if self.kernel is not None else None

    def device_master(self, unit: Unit) -> Tensor:
        return unit.master.to(self.device, non_blocking=True)

    def write_working(self, unit: Unit, out: Tensor, spans: Sequence[slice]) -> None:
        for span in spans:
            copy = (
                self.kernel.take_fresh_copy(unit, span)
                if self.kernel is not None and out.dtype == torch.bfloat16
                else None
            )
            if copy is not None:  # the step's own bf16 copy: half the bytes of the master
                out[span].copy_(copy, non_blocking=True)
            elif self.pin and out.dtype != unit.master.dtype:
                copy_cast_to_device(out[span], unit.master[span])
            else:
                out[span].copy_(unit.master[span], non_blocking=True)

    def kernel_copy(self, unit: Unit) -> Optional[Tensor]:
        return self.kernel.copy_buffer(unit) if self.kernel is not None else None

    def copied(self, unit: Unit, spans: Sequence[slice]) -> None:
        if self.kernel is not None:
            self.kernel.copied(unit, spans)

    def device_working(self, unit: Unit, dtype: torch.dtype) -> Tensor:
        working = self.host_working(unit, dtype)
        if working is not None:  # the step's own bf16 copy: half the bytes of the master
            return working.to(self.device, non_blocking=True)
        if self.pin and dtype != unit.master.dtype:
            return copy_cast_to_device(torch.empty(unit.master.shape, dtype=dtype, device=self.device), unit.master)
        return unit.master.to(device=self.device, dtype=dtype, non_blocking=True)

    def close(self) -> None:
        self.worker.wait()
        if self.spec is not None:
            self.spec.close()

    def end_window(self) -> None:
        """Before the device gradient shards are released: the copies still reading them come first.
        A speculative step the window did not keep is undone."""
        self.abandon_speculation()
        self.landing.end_window()
        self.multiplier.clear()
        if self.kernel is not None:
            self.kernel.clear()
