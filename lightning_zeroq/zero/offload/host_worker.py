"""The host's worker: the one thread on which the host steps work beside the calling thread, for the
speculative host steps (``speculative_step.py``, during the backward) and the asynchronous ones
(``async_step.py``, beside the next forward).

One worker per engine, made when the engine is built (``build.py``: ``threaded`` with
``offload_speculative_step`` or ``offload_async_step``) and handed to everything that gives it work or
waits for it: the host placement (``host.HostOptimizer``: its gradient landing and its speculation),
the asynchronous step and the gatherer. Without those options it runs no thread: a job runs where it
is submitted, and every wait returns at once.

A job (``Job``) is work on one unit: ``run`` on the worker's thread; ``joined``, what the calling
thread does once a wait covered the job (an asynchronous step makes the unit's parameters readable
again there); ``failed``, what it raises if the job failed.

Which job next. The queue holds jobs in their submitters' order of preference (speculation puts each
new unit first, the asynchronous step its units in forward order); the worker takes the first job that
can start without waiting (``ready``: its gradient is on the host), else the last one allowed to wait
for its inputs (``waits``): the gradients land in reverse unit order, so that one lands first. The host
never waits while a job it could run is there.

Waiting. ``wait(index)`` returns once no job of unit ``index`` is queued or running, after the calling
thread joined every finished job up to the last of them, in the order they finished (the asynchronous
step publishes in unit order, so a wait for unit 3 joins units 0 to 3); ``wait()`` waits for every
job. A job that raises ends the work queued behind it; the next wait, whichever unit it is for, raises
on the calling thread what the failed job's ``failed`` returns (its owner puts things back and says
what happened), chained to the job's own exception.

``withdraw`` takes a job back that has not started (speculation hands its units not started to the
step); ``busy`` says, without waiting, whether a unit has work queued or running (a stage-3 prefetch of
such a unit is left to its use).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Optional


def _always() -> bool:
    return True


@dataclass(eq=False)
class Job:
    unit: int
    """The unit the job works on (what ``wait(index)`` and ``busy`` ask about)."""
    run: Callable[[], None]
    """The work, on the worker's thread."""
    failed: Callable[[BaseException], BaseException]
    """On the calling thread, at the wait after ``run`` raised: puts back what the owner must and returns
    the error to raise (chained to what ``run`` raised)."""
    ready: Callable[[], bool] = _always
    """Whether the job can start now without waiting for its inputs (asked on the worker's thread)."""
    waits: bool = True
    """The job may start before it is ready (it waits for its inputs itself)."""
    joined: Optional[Callable[[bool], None]] = None
    """On the calling thread, once a wait covered the finished job (True: a wait for a unit, not for all)."""


class HostWorker:
    """One thread and one queue of ``Job``s (``threaded``), or none (jobs run where they are submitted)."""

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running: Optional[Job] = None
        self._open: Counter[int] = Counter()
        """Per unit: its jobs queued or running."""
        self._finished: deque[Job] = deque()
        """Finished jobs with a ``joined`` no wait has covered yet, in the order they finished."""
        self._failure: Optional[tuple[BaseException, Job]] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, job: Job, first: bool = False) -> None:
        """Queue ``job`` (``first``: ahead of the others); without a thread, run it here."""
        if not self.threaded:
            try:
                job.run()
            except BaseException as error:
                raise job.failed(error) from error
            if job.joined is not None:
                job.joined(False)
            return
        with self._cv:
            assert not self._closed, "the host's worker is closed"
            if first:
                self._queue.appendleft(job)
            else:
                self._queue.append(job)
            self._open[job.unit] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="zeroq-host-worker", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def withdraw(self, job: Job) -> bool:
        """Take ``job`` back if it has not started (True); its submitter does its work instead."""
        with self._cv:
            if job not in self._queue:
                return False
            self._queue.remove(job)
            self._release(job)
            self._cv.notify_all()
            return True

    def busy(self, index: int) -> bool:
        """Whether unit ``index`` has a job queued or running (without waiting)."""
        with self._cv:
            return self._open[index] > 0

    def wait(self, index: Optional[int] = None) -> None:
        """On the calling thread: until unit ``index``'s jobs (every job, without ``index``) are done, joining
        the finished jobs up to them; a job that failed raises here (see the module docstring)."""
        if not self.threaded:
            return
        assert threading.current_thread() is not self._thread, "a job waits for the worker it runs on"
        with self._cv:
            while self._failure is None and (
                self._open[index] > 0 if index is not None else self._queue or self._running is not None
            ):
                self._cv.wait()
            failure, self._failure = self._failure, None
            if failure is not None:  # the failed job's owner puts back what its jobs left (``failed``)
                self._finished.clear()
            joined = self._joins(index)
        if failure is not None:
            error, job = failure
            raise job.failed(error) from error
        for job in joined:
            assert job.joined is not None  # only such jobs are kept
            job.joined(index is not None)

    def close(self) -> None:
        """Drop the jobs not started and end the thread (after the job it runs)."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                self._release(job)
            self._queue.clear()
            self._finished.clear()
            self._cv.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ------------------------------------------------------------------ under the lock

    def _joins(self, index: Optional[int]) -> list[Job]:
        """The finished jobs a wait for ``index`` covers (taken out of ``_finished``)."""
        if index is None:
            covered = len(self._finished)
        else:
            covered = next(
                (n + 1 for n in range(len(self._finished) - 1, -1, -1) if self._finished[n].unit == index), 0
            )
        return [self._finished.popleft() for _ in range(covered)]

    def _release(self, job: Job) -> None:
        self._open[job.unit] -= 1
        if self._open[job.unit] <= 0:
            del self._open[job.unit]

    def _next(self) -> Optional[Job]:
        """The first job that is ready, else the last that may wait (None: none can start)."""
        chosen = next((job for job in self._queue if job.ready()), None)
        if chosen is None:
            chosen = next((job for job in reversed(self._queue) if job.waits), None)
        if chosen is not None:
            self._queue.remove(chosen)
        return chosen

    # ------------------------------------------------------------------ the thread

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._next()
                if job is None:  # only jobs that wait for others that are gone: a bug, said on the calling thread
                    job = self._queue.popleft()
                    self._finish(job, AssertionError("the host's worker has jobs none of which can start"))
                    continue
                self._running = job
            error: Optional[BaseException] = None
            try:
                job.run()
            except BaseException as caught:  # raised by the next wait, on the calling thread
                error = caught
            with self._cv:
                self._running = None
                self._finish(job, error)

    def _finish(self, job: Job, error: Optional[BaseException]) -> None:
        self._release(job)
        if error is not None:
            if self._failure is None:
                self._failure = (error, job)
            for queued in self._queue:  # the work behind a failure is not done
                self._release(queued)
            self._queue.clear()
        elif job.joined is not None:
            self._finished.append(job)
        self._cv.notify_all()
