"""Speculative host steps (``offload_speculative_step``): host units step while the backward still runs,
before the window's checks are known, and are undone exactly where the checks say otherwise.

Why. A unit may step only once every rank agreed on the window (which parameters got gradients,
whether all of them are finite) and the step's gradient multiplier is known (unscaling, clipping), so
with optimizer offload the host waits through the backward, and the backward and the host step add up.

What is speculated. In a backward that ends the window (``boundary=True``), each unit whose gradient
leaves for the host during it is offered to the host's worker (``host_worker.py``) as a job, which
steps it once its copy has landed, with the host kernel (``host_kernel.KernelSteps``) out of place: the
updated master, ``exp_avg`` and ``exp_avg_sq`` go to the unit's spare buffers (``_Spare``), the ones
the step read stay as they were, and the bf16 copy of the master is written as usual. Only where the
step is torch's Adam or AdamW through the kernel (one optimizer, no step pre-hooks), every segment's
state was made by an earlier step, and no loss scaling (whose unscaling multiplier is not 1) is in use.

Which unit first: each unit offered goes to the front of the worker's queue, so the worker steps the
unit offered last among those whose gradient is on the host, else the one offered first (its gradient
lands first). Why newest first: the host steps more slowly than the backward hands it gradients, so
some units are left for after the backward whatever the order, and the next forward needs the units in
forward order, the reverse of the order they land in. Stepping the newest first leaves the units the
forward reaches last for the end, where their steps overlap the forward (``async_step.py`` takes them
over, in forward order, at ``step()``: ``hand_over``), instead of leaving unit 0, which the forward
needs first, for the end.

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

import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_pre_hooks

from lightning_zeroq.swap.buffers import pinned_empty
from lightning_zeroq.zero.layout import Segment
from lightning_zeroq.zero.offload.host_kernel import KernelSteps
from lightning_zeroq.zero.offload.host_worker import HostWorker, Job
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
    grown: int = 0
    """How many times more gradients had reached the unit when it was offered (``Speculation.regrown``):
    another count at the step means some arrived after its copy."""


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
    """One per host placement; its steps are jobs of the host's worker (``host_worker.py``)."""

    def __init__(
        self,
        worker: HostWorker,
        steps: KernelSteps,
        grad_of: Callable[[Unit], Tensor],
        wait_reads: Callable[[int], None],
        landed: Callable[[int], bool] = lambda index: True,
        units: Sequence[Unit] = (),
    ) -> None:
        """``grad_of``: a unit's host gradient once landed (waits for it); ``landed``: whether unit
        ``index``'s gradient is on the host now (does not wait)."""
        self.worker, self.steps, self._grad_of, self._wait_reads, self._landed = (
            worker,
            steps,
            grad_of,
            wait_reads,
            landed,
        )
        self.units = list(units)
        """The units it may step (their spare buffers are made at the first window that can use them)."""
        self._jobs: list[Job] = []
        """The jobs offered to the worker that no ``keep`` or ``undo_all`` has waited for yet."""
        self._grown: dict[int, int] = {}
        """Per unit: how many times more gradients reached it after a reduction (``regrown``)."""
        self._accepting = False
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._pause = 0
        self._warned = False
        self.done: dict[int, _Done] = {}
        """The worker's finished steps, by unit (written on its thread, read once a wait covered them)."""
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
        if (
            optimizer is None
            or adam_kind(optimizer) is None
            or optimizer._optimizer_step_pre_hooks
            or _global_optimizer_pre_hooks
        ):
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "offload_speculative_step=True does not speculate in this window: it needs one "
                    "optimizer, torch's Adam or AdamW, without step pre-hooks (they may change what the "
                    "step does); the step runs as usual.",
                    stacklevel=2,
                )
            return
        self._make_spares(optimizer)
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
        """``unit``'s gradient is on its way to the host: the worker steps it once it has landed, the units
        offered last first (``Job.ready``; the module docstring of ``host_worker.py`` says why)."""
        if not self._accepting:
            return
        index = unit.index
        job = Job(
            index,
            functools.partial(self._work, unit, self._grown.get(index, 0)),
            self._failed,
            ready=functools.partial(self._landed, index),
        )
        self._jobs.append(job)
        self.counts.offered += 1
        self.worker.submit(job, first=True)

    def regrown(self, unit: Unit) -> None:
        """More gradients reached ``unit``: a step taken from its earlier copy must not stay (one not started
        is taken back; one started or done is stale, ``keep``)."""
        self._grown[unit.index] = self._grown.get(unit.index, 0) + 1
        for job in [j for j in self._jobs if j.unit == unit.index]:
            if self.worker.withdraw(job):
                self._jobs.remove(job)

    def end_offers(self) -> None:
        """The backward ended on this thread: no more units. Those offered still step on the worker: on a
        GPU the device is still running the backward (the CPU only queued it), so their gradients are
        still landing, and the step waits for each in turn (``keep``) rather than stepping it itself."""
        self._accepting = False

    def hand_over(self) -> None:
        """No more units, and those the worker has not started are the caller's to step: an asynchronous
        step's (``async_step.AsyncHostStep.run``, in forward order), or the usual step's (``undo_all``). The
        one being stepped finishes on the worker (``keep`` waits for it)."""
        self._accepting = False
        for job in list(self._jobs):
            if self.worker.withdraw(job):
                self._jobs.remove(job)
                self.counts.unstarted += 1

    def _failed(self, error: BaseException) -> BaseException:
        """A step the worker failed, raised by the worker's next wait on the calling thread, every speculated
        unit undone first."""
        self.undo_all()
        return RuntimeError("ZeroQ: a speculative host step failed; the model is as before it")

    def keep(self, unit: Unit, binding: Any, used: Sequence[Any], owed: bool) -> Optional[bool]:
        """At the step: None if ``unit`` was not speculated; True if its step stays; False if it was
        undone (the caller steps it as usual). ``owed``: a gradient multiplier is pending for it. Waits
        for the worker to finish ``unit`` if it was offered and is still queued or running."""
        if any(job.unit == unit.index for job in self._jobs):
            self.worker.wait(unit.index)
            self._jobs = [job for job in self._jobs if job.unit != unit.index]
        record = self.done.pop(unit.index, None)
        if record is None:
            return None
        same = (
            record.grown == self._grown.get(unit.index, 0)
            and not owed
            and binding.optimizer is self._optimizer
            and [id(v) for v, _ in binding.optimized[unit.index]] == [id(v) for v, _ in record.pairs]
            and all(used[unit.param_id(seg.param)] for _, seg in record.pairs)
            and self.steps.kernel_args([unit], binding) == record.hypers
        )
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
        """Restore every unit still speculated (the window ends, or someone reads before the step): no more
        units, those not started handed over, the one being stepped waited for."""
        if not self._jobs and not self.done:
            return
        self.hand_over()
        for index in sorted({job.unit for job in self._jobs}):
            self.worker.wait(index)
        self._jobs.clear()
        for record in list(self.done.values()):
            self._undo(record)
        self.done.clear()

    def forget(self, index: int) -> None:
        """Unit ``index`` no longer steps on the host."""
        self.spares.pop(index, None)

    def close(self) -> None:
        """Undo what is left and drop the spare buffers."""
        self.undo_all()
        self.spares.clear()

    # ------------------------------------------------------------------ on the worker

    def _work(self, unit: Unit, grown: int) -> None:
        earlier = self.done.pop(unit.index, None)
        if earlier is not None:  # offered again: its earlier step (and the step count it advanced) is dropped first
            self._undo(earlier)
        with torch.profiler.record_function("zeroq.speculative_step"):
            record = self._speculate(unit)
        if record is not None:
            record.grown = grown
            self.done[unit.index] = record

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
        moments = {
            id(view): (
                torch.zeros_like(optimizer.state[view]["exp_avg"]),
                torch.zeros_like(optimizer.state[view]["exp_avg_sq"]),
            )
            for view, _ in pairs
        }
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
        self.steps.discard(unit.index)
        self.counts.undone += 1
