"""Speculative host steps (``offload_speculative_step``): host units step while the backward still runs,
before the window's checks are known, and are undone exactly where the checks say otherwise.

Why. A unit may step only once every rank agreed on the window (which parameters got gradients,
whether all of them are finite) and the step's gradient multiplier is known (unscaling, clipping), so
with optimizer offload the host waits through the backward, and the backward and the host step add up.

What is speculated. In a backward that ends the window (``boundary=True``), each unit whose gradient
leaves for the host during it is handed to a worker thread, which steps the units newest landed first
(``_next`` says why), each once its copy has landed, with the host kernel (``host_kernel.KernelSteps``) out of place: the updated master,
``exp_avg`` and ``exp_avg_sq`` go to the unit's spare buffers (``_Spare``), the ones the step read stay
as they were, and the bf16 copy of the master is written as usual. Only where the step is torch's Adam or AdamW through the kernel (one optimizer, no step
pre-hooks), every segment's state was made by an earlier step, and no loss scaling (whose unscaling
multiplier is not 1) is in use.

Kept or undone. At the step a speculated unit is kept (``keep``) if its step is the one the step
would take: no multiplier owed (no clipping took effect: the clip factor of a norm under the bound is
exactly 1), the same hyperparameters, every parameter used on some rank, no gradient arrived after
its copy; keeping it swaps the spare buffers in (the master's storage and each moment's, the tensor
objects the optimizer holds staying the same), and the buffers the step read become the spares.
Otherwise it is undone (its outputs dropped; the step counts and the bf16 copy restored) and the unit
steps again as usual. Every speculated unit is restored first when the window ends without a step (a
skipped or failed non-finite check, ``zero_grad``) and when something reads the host gradients
(value clipping) or walks the masters (state dicts, checkpoints, ``gathered_parameters``) before the
step. So the result is bitwise the result without speculation, whatever happens.

Cost. Host memory: spare buffers of 12 bytes per element of every unit (made at the first window that
can speculate, ``_make_spares``, and kept). Host time: none beyond the step itself (out of place, a step moves the bytes a step in
place moves), taken in time the host would otherwise wait; an undone unit's step is taken again.
After a window whose multiplier undid the speculation (clipping in effect), the next ``PAUSE``
windows do not speculate.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_pre_hooks

from lightning_zeroq.swap.buffers import pinned_empty
from lightning_zeroq.zero.layout import Segment
from lightning_zeroq.zero.offload.host_kernel import KernelSteps
from lightning_zeroq.zero.optim.binding import adam_kind
from lightning_zeroq.zero.unit import Unit

PAUSE = 8
"""Windows without speculation after one whose multiplier undid it."""


class _Everything:
    """``used`` for a speculative step: every parameter (checked against the agreement at ``keep``)."""

    def __getitem__(self, index: int) -> bool:
        return True


class _AllSegments:
    """A unit's binding as the one attached optimizer has it: every segment (``keep`` checks it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, unit: Unit) -> None:
        self.optimizer = optimizer
        self.optimized = {unit.index: list(zip(unit.segment_masters, unit.segments))}


@dataclass
class _Done:
    unit: Unit
    pairs: list[tuple[Tensor, Segment]]
    hypers: dict[int, dict[str, Any]]
    steps: list[tuple[Tensor, float]]
    """Each segment's step count tensor and its value before the speculative step."""
    stale: bool = False
    """More gradients arrived for the unit after its copy."""


@dataclass
class _Spare:
    """Where a unit's speculative step writes: a master of the unit's shape (its padding zero, as the
    master's) and, per segment view (by id), an ``exp_avg`` and an ``exp_avg_sq``."""

    master: Tensor
    moments: dict[int, tuple[Tensor, Tensor]]

    def outputs(self, view: Tensor, span: slice) -> tuple[Tensor, Tensor, Tensor]:
        return (self.master[span], *self.moments[id(view)])


@dataclass
class _Counts:
    """What speculation did so far (``benchmarks/step_time.py`` reports it beside the step time)."""

    kept: int = 0
    undone: int = 0
    windows: int = 0
    """Windows that speculated."""
    offered: int = 0
    """Units handed to the worker during a backward."""
    unstarted: int = 0
    """Offered units the backward ended before the worker began (they step as usual)."""
    landing_s: float = 0.0
    """The worker's time waiting for gradients to land on the host."""
    stepping_s: float = 0.0
    """The worker's time in the host kernel."""


class Speculation:
    """One per host placement; the worker thread starts with the first unit offered."""

    def __init__(self, steps: KernelSteps, grad_of: Callable[[Unit], Tensor],
                 wait_reads: Callable[[int], None], landed: Callable[[int], bool] = lambda index: True,
                 units: Sequence[Unit] = ()) -> None:
        """``grad_of``: a unit's host gradient once landed (waits for it); ``landed``: whether unit
        ``index``'s gradient is on the host now (does not wait)."""
        self.steps, self._grad_of, self._wait_reads, self._landed = steps, grad_of, wait_reads, landed
        self.units = list(units)
        """The units it may step (their spare buffers are made at the first window that can use them)."""
        self._cv = threading.Condition()
        self._queue: deque[Unit] = deque()
        self._busy: Optional[Unit] = None
        self._busy_stale = False
        self._accepting = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._pause = 0
        self._closed = False
        self._warned = False
        self.done: dict[int, _Done] = {}
        self.spares: dict[int, _Spare] = {}
        self.counts = _Counts()

    # ------------------------------------------------------------------ the window

    def open(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """A backward that ends the window begins: speculate in it, where the optimizer allows."""
        self.undo_all()  # nothing may be left from a window that ended some other way
        if self._pause:
            self._pause -= 1
            return
        optimizer = optimizers[0] if len(optimizers) == 1 else None
        if (optimizer is None or adam_kind(optimizer) is None or optimizer._optimizer_step_pre_hooks
                or _global_optimizer_pre_hooks):
            if not self._warned:
                self._warned = True
                warnings.warn("offload_speculative_step=True does not speculate in this window: it needs one "
                              "optimizer, torch's Adam or AdamW, without step pre-hooks (they may change what the "
                              "step does); the step runs as usual.", stacklevel=2)
            return
        self._make_spares(optimizer)
        with self._cv:
            self._optimizer, self._accepting = optimizer, True
        self.counts.windows += 1

    def _make_spares(self, optimizer: torch.optim.Optimizer) -> None:
        """Every unit's spare buffers, made (and written once) here on the calling thread as soon as the
        state they mirror exists, rather than by the worker the first time it steps each unit: which
        units the worker reaches varies from window to window, and first writes into fresh pages from
        all the kernel's threads at once cost several times the step itself. A unit whose master is no
        longer on the host (``offload_optimizer_ratio="auto"`` brought it back) gets none."""
        for unit in self.units:
            if unit.index not in self.spares:
                pairs = _AllSegments(optimizer, unit).optimized[unit.index]
                if pairs and all(optimizer.state.get(view) and view.device.type == "cpu" for view, _ in pairs):
                    self.spares[unit.index] = self._spare(unit, optimizer, pairs)

    def offer(self, unit: Unit) -> None:
        """``unit``'s gradient is on its way to the host: step it once it has landed."""
        with self._cv:
            if not self._accepting:
                return
            self._queue.append(unit)
            self.counts.offered += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="zeroq-speculative-step", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def regrown(self, unit: Unit) -> None:
        """More gradients reached ``unit``: a step taken from its earlier copy must not stay."""
        with self._cv:
            if unit in self._queue:
                self._queue.remove(unit)
            if self._busy is unit:
                self._busy_stale = True
            if unit.index in self.done:
                self.done[unit.index].stale = True

    def end_offers(self) -> None:
        """The backward ended on this thread: no more units. Those offered still step on the worker: on a
        GPU the device is still running the backward (the CPU only queued it), so their gradients are
        still landing, and the step waits for each in turn (``keep``) rather than stepping it itself."""
        with self._cv:
            self._accepting = False

    def stop(self) -> None:
        """No more units, and those not started step as usual (a reader comes before the step)."""
        self.hand_over()

    def hand_over(self) -> None:
        """No more units, and those not started are the caller's to step: an asynchronous step's
        (``async_step.AsyncHostStep.run``, in forward order), or the usual step's (``stop``). The one being
        stepped finishes here (``keep`` waits for it)."""
        with self._cv:
            self._accepting = False
            self.counts.unstarted += len(self._queue)
            self._queue.clear()

    def settle(self) -> None:
        """``stop``, and wait for the unit being stepped."""
        with self._cv:  # a reentrant lock: ``stop`` takes it again
            self.stop()
            while self._busy is not None:
                self._cv.wait()
        self._raise_failure()

    def _raise_failure(self) -> None:
        """A step the worker failed is reported here, on the main thread, every speculated unit undone first."""
        with self._cv:
            error, self._error = self._error, None
        if error is not None:
            self.undo_all()
            raise RuntimeError("ZeroQ: a speculative host step failed; the model is as before it") from error

    def keep(self, unit: Unit, binding: Any, used: Sequence[Any], owed: bool) -> Optional[bool]:
        """At the step: None if ``unit`` was not speculated; True if its step stays; False if it was
        undone (the caller steps it as usual). ``owed``: a gradient multiplier is pending for it. Waits
        for the worker to finish ``unit`` if it was offered and is still queued or running."""
        with self._cv:
            while unit in self._queue or self._busy is unit:
                self._cv.wait()
        self._raise_failure()
        record = self.done.pop(unit.index, None)
        if record is None:
            return None
        same = (not record.stale and not owed and binding.optimizer is self._optimizer
                and [id(v) for v, _ in binding.optimized[unit.index]] == [id(v) for v, _ in record.pairs]
                and all(used[unit.param_id(seg.param)] for _, seg in record.pairs)
                and self.steps.kernel_args([unit], binding) == record.hypers)
        if same:
            self._swap_in(record)
            self.steps.stepped(unit.index)
            self.counts.kept += 1
            return True
        if owed:
            self._pause = PAUSE
        self._undo(record)
        return False

    def undo_all(self) -> None:
        """Restore every unit still speculated (the window ends, or someone reads before the step)."""
        if self._busy is None and not self.done and not self._queue:
            return
        self.settle()
        for record in list(self.done.values()):
            self._undo(record)
        self.done.clear()

    def forget(self, index: int) -> None:
        """Unit ``index`` no longer steps on the host."""
        self.spares.pop(index, None)

    def close(self) -> None:
        """Undo what is left and end the worker thread."""
        self.undo_all()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self.spares.clear()

    # ------------------------------------------------------------------ the worker

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                unit = self._busy = self._next()
                self._busy_stale = False
            record, error = None, None
            try:
                with torch.profiler.record_function("zeroq.speculative_step"):
                    record = self._speculate(unit)
            except BaseException as caught:  # reported by the next settle, on the main thread
                error = caught
            with self._cv:
                if record is not None:
                    record.stale = self._busy_stale
                    self.done[unit.index] = record
                if error is not None:
                    self._error = error
                self._busy = None
                self._cv.notify_all()

    def _next(self) -> Unit:
        """The unit to step next (under the lock): the one offered last among those whose gradient is on
        the host, else the one offered first (its gradient lands first).

        Why newest first: the host steps more slowly than the backward hands it gradients, so some units
        are left for after the backward whatever the order, and the next forward needs the units in
        forward order, the reverse of the order they land in. Stepping the newest first leaves the units
        the forward reaches last for the end, where their steps overlap the forward (``async_step.py`` takes
        them over, in forward order, at ``step()``: ``hand_over``), instead of leaving unit 0, which the
        forward needs first, for the end."""
        for unit in reversed(self._queue):
            if self._landed(unit.index):
                self._queue.remove(unit)
                return unit
        return self._queue.popleft()

    def _speculate(self, unit: Unit) -> Optional[_Done]:
        optimizer = self._optimizer
        assert optimizer is not None  # set by open() before any offer is taken
        binding = _AllSegments(optimizer, unit)
        pairs = binding.optimized[unit.index]
        hypers = self.steps.kernel_args([unit], binding)
        if hypers is None or not all(optimizer.state.get(view) for view, _ in pairs):
            return None  # the first step makes the state: never speculated
        began = time.perf_counter()
        grad = self._grad_of(unit)  # waits for the unit's copy to land
        self._wait_reads(unit.index)  # the device's read of the previous step's copies
        landed = time.perf_counter()
        self.counts.landing_s += landed - began
        spare = self.spares.get(unit.index)
        if spare is None:
            spare = self.spares[unit.index] = self._spare(unit, optimizer, pairs)
        steps = [(optimizer.state[view]["step"], float(optimizer.state[view]["step"].item())) for view, _ in pairs]
        jobs = self.steps.jobs(unit, binding, _Everything(), grad, 1.0, hypers, out=spare.outputs)
        self.steps.kernel.run(jobs, threads=max(1, torch.get_num_threads() - 1))  # a core for the backward
        self.counts.stepping_s += time.perf_counter() - landed
        return _Done(unit, pairs, hypers, steps)

    def _spare(self, unit: Unit, optimizer: torch.optim.Optimizer, pairs: list[tuple[Tensor, Segment]]) -> _Spare:
        master = pinned_empty(unit.master.numel(), unit.master.dtype, self.steps.pin).zero_().view(unit.master.shape)
        moments = {id(view): (torch.zeros_like(optimizer.state[view]["exp_avg"]),
                              torch.zeros_like(optimizer.state[view]["exp_avg_sq"])) for view, _ in pairs}
        return _Spare(master, moments)

    def _swap_in(self, record: _Done) -> None:
        """Keep ``record``'s step: its outputs become the unit's master and moments, what it read the spares."""
        unit, spare, optimizer = record.unit, self.spares[record.unit.index], self._optimizer
        assert optimizer is not None
        for view, _ in record.pairs:
            state = optimizer.state[view]
            for key, other in zip(("exp_avg", "exp_avg_sq"), spare.moments[id(view)]):
                current = state[key]
                read = current.data
                current.data = other.data  # the optimizer's tensor object stays; its storage is the output
                other.data = read
        read_master = unit.master
        unit.set_master(spare.master)
        spare.master = read_master

    def _undo(self, record: _Done) -> None:
        """Drop ``record``'s step: the master and moments were only read; the step counts and the bf16
        copy it wrote are restored."""
        unit = record.unit
        with torch.no_grad():
            for count, before in record.steps:
                count.fill_(before)
            working = self.steps.working.get(unit.index)
            if working is not None:  # the bf16 copy (a stage-3 store's payload, too) follows the master
                for _, seg in record.pairs:
                    working[seg.shard_span].copy_(unit.master[seg.shard_span])
        self.steps.fresh.discard(unit.index)
        self.counts.undone += 1
