"""A stalled or dead rank ends the whole job, with an error that names it.

When one rank stops (user code that sleeps or loops, a rank killed or wedged), the others wait in
their next collective until the process group's ``timeout`` and then raise a backend error that
names no rank; the stalled rank itself waits on, and a rank started by Lightning's subprocess
launcher outlives a rank 0 that exited (an orphan). ``Watchdog`` closes both gaps. One daemon
thread per process (started by the strategy when it creates the process group) does, every
``interval_s`` (0.5 s; world size / 100 s from 50 ranks on, to spare rank 0's store):

- publish a beat in the process group's store: wall time, pid, and where this rank's main thread
  is (its innermost frame outside torch and this package, and whether it is inside a collective);
- look for the job's abort record; if there is one, print it (one line, naming the stalled rank),
  run the cleanup hooks (e.g. NVMe swap directories) and end this process with exit status 1;
- if the store cannot be reached (it lives in rank 0's process with Lightning's launcher and
  ``zeroq-train``), rank 0 has ended: the same, naming it.

The rank whose collective fails (``report``: from the strategy's ``on_exception``) reads every
rank's beat, names the rank(s) not in a collective (and where their code is) or not beating (dead),
writes the abort record for the others and waits a moment for them to read it. So with
``timeout=T`` every process ends about ``T`` plus one or two ``interval_s`` after the stall.

Only collectives' failures abort the job; other exceptions take their usual way (Lightning's
launcher ends the other ranks when one exits with an error).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

log = logging.getLogger("lightning_zeroq")

JOIN_TIMEOUT = timedelta(minutes=5)
"""How long ranks wait for each other to join the process group, whatever the collectives' timeout."""
PREFIX = "zeroq/watchdog/"
ABORT_KEY = PREFIX + "abort"
_WAITING_FILES = (os.sep + os.path.join("torch", "distributed") + os.sep,  # a collective, or ZeroQ waiting on one
                  os.sep + os.path.join("lightning_zeroq", "zero") + os.sep,
                  os.sep + os.path.join("lightning_zeroq", "checkpoint") + os.sep)
_OWN_FILES = (os.sep + "torch" + os.sep, os.sep + "lightning_zeroq" + os.sep, os.sep + "lightning" + os.sep,
              os.sep + "threading.py", os.sep + "contextlib.py")

_cleanups: list[Callable[[], None]] = []
_active: Optional["Watchdog"] = None


def add_cleanup(fn: Callable[[], None]) -> None:
    """Run ``fn`` before the watchdog ends this process (it does not run ``atexit`` or ``finally``)."""
    if fn not in _cleanups:
        _cleanups.append(fn)


def remove_cleanup(fn: Callable[[], None]) -> None:
    if fn in _cleanups:
        _cleanups.remove(fn)


def is_collective_failure(error: BaseException) -> bool:
    """A backend error of a collective (timeout, a peer gone): the process group is broken."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
                            "ProcessGroupGloo", "NCCL communicator was aborted", "Broken pipe"))


def where(frame: Any) -> tuple[bool, str]:
    """(in a collective, the innermost frame of the caller's own code) of a thread's stack."""
    waiting = frame is not None and any(s in frame.f_code.co_filename for s in _WAITING_FILES)
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if not any(s in name for s in _OWN_FILES):
            return waiting, f"{name}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    if frame is None:
        return False, "?"
    return waiting, f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class Watchdog:
    """See the module docstring. ``store``: the process group's store (``dist.distributed_c10d.
    _get_default_store()``); ``timeout_s``: the process group's timeout, named in messages."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, interval_s: float = 0.5,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self._exit_fn = exit_fn
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.aborted: Optional[str] = None
        self._saw_closing = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Watchdog":
        global _active
        self._beat()
        self._thread = threading.Thread(target=self._run, name="zeroq-watchdog", daemon=True)
        self._thread.start()
        _active = self
        return self

    def stop(self) -> None:
        global _active
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s + 1)
        if _active is self:
            _active = None

    def close(self) -> None:
        """The normal end (see ``stop_watchdog``)."""
        self._stop.set()
        try:
            if self.aborted is not None:  # the store may be gone with rank 0
                raise RuntimeError
            self.store.set(f"{PREFIX}closing/{self.rank}", "1")
            if self.rank == 0:
                deadline = time.monotonic() + 4 * self.interval_s + 1
                others = [f"{PREFIX}closing/{r}" for r in range(1, self.world_size)]
                while others and not self.store.check(others) and time.monotonic() < deadline:
                    time.sleep(self.interval_s / 4)
        except Exception:
            pass
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                record = self._abort_record()
            except Exception as error:  # the store is gone: rank 0's process (which hosts it) has ended
                if self._stop.is_set() or self._closing() or self.aborted is not None:
                    return
                self._end(f"rank {self.rank}: the job's store cannot be reached ({type(error).__name__}): rank 0's "
                          "process has ended; ending this rank too.")
                return
            if record is not None and self.aborted is None and not self._stop.is_set():
                self._end(record)
                return

    # ------------------------------------------------------------------ beats and the abort record

    def _closing(self) -> bool:
        return self._saw_closing

    def _beat(self) -> None:
        waiting, at = where(sys._current_frames().get(self._main) if self._main is not None else None)
        beat = {"t": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "waiting": waiting, "at": at}
        self.store.set(f"{PREFIX}beat/{self.rank}", json.dumps(beat))

    def _abort_record(self) -> Optional[str]:
        if not self._saw_closing and self.rank != 0:
            self._saw_closing = self.store.check([f"{PREFIX}closing/0"])
        if not self.store.check([ABORT_KEY]):
            return None
        return self.store.get(ABORT_KEY).decode("utf-8", "replace")

    def _beats(self) -> tuple[dict[int, Optional[dict]], bool]:
        """Every rank's last beat (None: none), and whether the store could be read at all."""
        out: dict[int, Optional[dict]] = {}
        reached = False
        for rank in range(self.world_size):
            key = f"{PREFIX}beat/{rank}"
            try:
                found = self.store.check([key])
                reached = True
                out[rank] = json.loads(self.store.get(key)) if found else None
            except Exception:
                out[rank] = None
        return out, reached

    def diagnose(self) -> str:
        """Which rank(s) the others wait for, and where they are (never this rank, which is asking)."""
        now = time.time()
        beats, reached = self._beats()
        if not reached:
            return ("rank 0 ended (the job's store, which its process hosts with Lightning's launcher and "
                    "zeroq-train, cannot be reached)")
        beats.pop(self.rank, None)
        silent = {r: b for r, b in beats.items() if b is None or now - b["t"] > 4 * self.interval_s + 1
                  or (b["host"] == socket.gethostname() and not _alive(b["pid"]))}
        outside = {r: b for r, b in beats.items() if b is not None and r not in silent and not b["waiting"]}
        parts = []
        for r, b in sorted(silent.items()):
            if b is not None and b["host"] == socket.gethostname() and not _alive(b["pid"]):
                parts.append(f"rank {r} died (its process {b['pid']} is gone; it was last at {b['at']})")
                continue
            age = "never" if b is None else f"{now - b['t']:.0f} s ago"
            parts.append(f"rank {r} stopped (last sign of life {age}: killed or wedged"
                         + (f", last at {b['at']})" if b else ")"))
        for r, b in sorted(outside.items()):
            parts.append(f"rank {r} stalled outside any collective, at {b['at']}")
        if not parts:
            parts.append("no rank is outside a collective: the ranks wait in different collectives (code that "
                         "runs a collective on some ranks only)")
        return "; ".join(parts)

    def report(self, error: BaseException) -> str:
        """On the rank whose collective failed: name the stalled rank(s), publish the abort record, give
        the other ranks a moment to read it; returns the message (also logged as an error)."""
        if self.aborted is not None:
            return self.aborted
        try:
            diagnosis = self.diagnose()
        except Exception:
            diagnosis = "the other ranks cannot be asked (the job's store is gone)"
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        timed_out = "timed out" in first.lower()
        message = (f"ZeroQ: the job ends: {diagnosis}. Rank {self.rank}'s collective failed"
                   + (f" after the process group's timeout ({self.timeout_s:.0f} s)" if timed_out else "")
                   + f": {first}")
        self.aborted = message
        log.error("%s", message)
        if error.args and isinstance(error.args[0], str):  # the traceback's last line names the rank too
            error.args = (f"ZeroQ: {diagnosis}. {error.args[0]}", *error.args[1:])
        try:
            self.store.set(ABORT_KEY, message)
            deadline = time.monotonic() + 3 * self.interval_s + 1
            while time.monotonic() < deadline:  # the others read it within an interval, then exit
                if all(self.store.check([f"{PREFIX}ack/{r}"]) for r in range(self.world_size) if r != self.rank):
                    break
                time.sleep(self.interval_s / 4)
        except Exception:
            pass
        self._stop.set()  # this rank ends by its exception; its store (rank 0's) may go any moment
        return message

    def _end(self, message: str) -> None:
        self.aborted = message
        try:
            self.store.set(f"{PREFIX}ack/{self.rank}", "1")
        except Exception:
            pass
        print(f"[rank {self.rank}] {message}", file=sys.stderr, flush=True)
        from lightning_zeroq.swap.cleanup import remove_live_files

        for fn in [remove_live_files, *_cleanups]:
            try:
                fn()
            except Exception:
                pass
        self._exit_fn(1)


def active() -> Optional[Watchdog]:
    return _active


def start_watchdog(timeout: Optional[timedelta]) -> Optional[Watchdog]:
    """Start this process's watchdog on the default process group (created by the caller)."""
    import torch.distributed as dist

    global _active
    if _active is not None:
        _active.stop()
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
    seconds = timeout.total_seconds() if timeout is not None else float("nan")
    world = dist.get_world_size()
    interval = max(0.5, world / 100)  # about 3 store operations per rank and interval reach rank 0's store
    return Watchdog(store, dist.get_rank(), world, seconds, interval_s=interval).start()


def stop_watchdog() -> None:
    """At the normal end of the process: tell rank 0 this rank is done; rank 0 waits briefly for the
    others' word before its store goes (so they do not read its exit as a failure)."""
    watchdog = _active
    if watchdog is None:
        return
    watchdog.close()


def report_collective_failure(error: BaseException) -> Optional[str]:
    """If ``error`` is a collective's failure and a watchdog runs: name the stalled rank(s) and end
    the job on every rank (see ``Watchdog.report``)."""
    watchdog = _active
    if watchdog is None or not is_collective_failure(error):
        return None
    return watchdog.report(error)


def report_uncaught_collective_failures() -> None:
    """Where no strategy hook sees the error (a Fabric script): a collective's failure that ends the
    main thread is reported as ``report_collective_failure`` does (the stalled rank named in the
    traceback's last line, the other ranks ended) before Python prints it."""
    previous = sys.excepthook
    if getattr(previous, "zeroq", False):
        return

    def hook(kind: Any, error: BaseException, traceback: Any) -> None:
        try:
            report_collective_failure(error)
        finally:
            previous(kind, error, traceback)

    hook.zeroq = True  # type: ignore[attr-defined]  # marks our hook: installed once
    sys.excepthook = hook
