"""``zero/offload/host_worker.py``: the host's one worker thread. Every test holds the worker on a first job
until the queue is as it wants it, so what runs when is certain (no sleep, no timing)."""

from __future__ import annotations

import functools
import threading

import pytest

from lightning_zeroq.zero.offload.host_worker import HostWorker, Job


def _said(error: BaseException) -> BaseException:
    return RuntimeError(f"said on {threading.current_thread().name}")


def _held(worker: HostWorker) -> threading.Event:
    """A first job that holds the worker until the returned event is set (once it has started)."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait()

    worker.submit(Job(-1, hold, _said))
    started.wait()
    return release


def test_without_a_thread_a_job_runs_where_it_is_submitted():
    worker = HostWorker(threaded=False)
    ran, joined = [], []
    worker.submit(Job(0, functools.partial(ran.append, 0), _said, joined=joined.append))
    assert ran == [0] and joined == [False] and worker._thread is None
    worker.wait()
    worker.wait(0)
    with pytest.raises(RuntimeError, match="said on MainThread") as info:
        worker.submit(Job(1, functools.partial(int, "x"), _said))
    assert isinstance(info.value.__cause__, ValueError)


def test_the_newest_landed_first_else_the_oldest():
    """Speculation's order: each unit offered goes first; the first landed in the queue, else the last."""
    worker = HostWorker(threaded=True)
    release = _held(worker)
    landed, ran = {2, 1}, []
    for index in (3, 2, 1, 0):  # offered in reverse unit order, as reduced
        worker.submit(Job(index, functools.partial(ran.append, index), _said,
                          ready=functools.partial(landed.__contains__, index)), first=True)
    release.set()
    worker.wait()
    assert ran == [1, 2, 3, 0]  # 3 and 0 never landed: the oldest first (it lands first)
    worker.close()


def _unit_order(worker: HostWorker, landed: set[int], units: int, log: list, joined: list) -> None:
    """The asynchronous step's jobs: each unit's step (ready once landed) and its publication (ready once
    stepped and the unit before published; never run early)."""
    stepped, order = set(), list(range(units))

    def step(i: int) -> None:
        log.append(("step", i))
        stepped.add(i)

    def publish(i: int) -> None:
        log.append(("publish", order.pop(0)))

    for i in range(units):
        worker.submit(Job(i, functools.partial(step, i), _said, ready=functools.partial(landed.__contains__, i)))
        worker.submit(Job(i, functools.partial(publish, i), _said, waits=False,
                          ready=lambda i=i: order[0] == i and i in stepped,
                          joined=lambda early, i=i: joined.append((i, early))))


def test_the_first_landed_in_forward_order_and_publications_in_unit_order():
    worker = HostWorker(threaded=True)
    release = _held(worker)
    log, joined = [], []
    _unit_order(worker, {1, 2}, 3, log, joined)
    assert worker.busy(0) and worker.busy(2) and not worker.busy(3)
    release.set()
    worker.wait(1)
    assert joined == [(0, True), (1, True)]  # a wait for unit 1 joins units 0 and 1, not 2
    worker.wait()
    assert joined == [(0, True), (1, True), (2, False)]
    assert log == [("step", 1), ("step", 2), ("step", 0), ("publish", 0), ("publish", 1), ("publish", 2)]
    assert not worker.busy(0)
    worker.close()
    assert worker._thread is None


def test_a_failed_job_raises_at_the_next_wait_and_ends_the_work_behind_it():
    worker = HostWorker(threaded=True)
    release = _held(worker)
    ran = []
    worker.submit(Job(0, functools.partial(int, "x"), _said))
    worker.submit(Job(1, functools.partial(ran.append, 1), _said))
    release.set()
    with pytest.raises(RuntimeError, match="said on MainThread") as info:
        worker.wait(1)  # a wait for another unit than the failed job's
    assert isinstance(info.value.__cause__, ValueError)
    assert ran == [] and not worker.busy(1)
    worker.wait()  # said once
    worker.submit(Job(2, functools.partial(ran.append, 2), _said))
    worker.wait(2)
    assert ran == [2]
    worker.close()


def test_jobs_none_of_which_can_start_are_an_error_not_a_hang():
    worker = HostWorker(threaded=True)
    release = _held(worker)
    worker.submit(Job(0, lambda: None, _said, ready=lambda: False, waits=False))
    release.set()
    with pytest.raises(RuntimeError, match="said on MainThread") as info:
        worker.wait()
    assert "none of which can start" in str(info.value.__cause__)
    worker.close()


def test_a_job_not_started_can_be_taken_back():
    worker = HostWorker(threaded=True)
    release = _held(worker)
    ran = []
    job = Job(3, functools.partial(ran.append, 3), _said)
    worker.submit(job)
    assert worker.busy(3) and worker.withdraw(job) and not worker.busy(3)
    assert not worker.withdraw(job)
    release.set()
    worker.wait()
    assert ran == []
    worker.close()
