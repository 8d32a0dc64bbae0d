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

Two more ways a job ends from here, because a main thread blocked in a collective (a C call) runs
neither Python code nor Python's signal handlers until it returns, which may be the ``timeout`` away:

- Ranks that ran different stage-3 units (a module only some ranks run, ``zero/gather.py``). Each beat
  also carries this process's stage-3 gathers (how many, the last few units, the one in progress) and
  how long the main thread has stood still in a collective. Rank 0's watchdog, once its own main
  thread has stood still in a collective for ``STILL_S``, reads the beats; if every rank has, and their
  gathers differ (a gather number with different units, or a rank in a gather the others are not in),
  it writes the abort record naming the gather, the units and the ranks, and every process ends as
  above, whatever the ``timeout``. A collective's timeout names them the same way (``diagnose``).
- A signal the main thread cannot act on. The watchdog receives SIGINT, SIGTERM and SIGHUP through
  Python's wakeup file descriptor (written at the signal, whatever the main thread does; only for a
  signal with a Python handler: a default action ends the process anyway). If the main thread has
  then not moved for ``STILL_S`` (stuck in one C call, a hung collective), the watchdog writes the
  abort record, runs the cleanup hooks and ends the process with status 128 + the signal's number;
  the other ranks follow within an interval (or their own signal ends them). Where the main thread moves
  after the signal, its handler ran and decided (to stop, or to go on): the signal is forgotten.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
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
_WAITING_FILES = (
    os.sep + os.path.join("torch", "distributed") + os.sep,  # a collective, or ZeroQ waiting on one
    os.sep + os.path.join("lightning_zeroq", "zero") + os.sep,
    os.sep + os.path.join("lightning_zeroq", "checkpoint") + os.sep,
)
_COLLECTIVE_FILES = (os.sep + os.path.join("torch", "distributed") + os.sep,)  # inside a collective's C call
STILL_S = 3.0
"""How long a main thread must stand still in a collective (all ranks', for a stage-3 mismatch) or after a
signal before the watchdog acts; longer than any wait between two ranks' entries into one collective."""
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_OWN_FILES = (
    os.sep + "torch" + os.sep,
    os.sep + "lightning_zeroq" + os.sep,
    os.sep + "lightning" + os.sep,
    os.sep + "threading.py",
    os.sep + "contextlib.py",
)

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
        s in text
        for s in (
            "Timed out",
            "timed out",
            "Connection closed by peer",
            "Connection reset by peer",
            "ProcessGroupGloo",
            "NCCL communicator was aborted",
            "Broken pipe",
        )
    )


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

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        interval_s: float = 0.5,
        exit_fn: Callable[[int], None] = os._exit,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self._exit_fn = exit_fn
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.aborted: Optional[str] = None
        self._saw_closing = False
        self._still_key: Any = None
        self._still_since = time.monotonic()
        self._inside = False  # the main thread in a collective's call, at the last beat
        self._signalled: Optional[int] = None
        self._signal_key: Any = None  # where the main thread stood when the signal came
        self._signal_at = 0.0
        self._wakeup: Optional[tuple[int, int]] = None  # (read, write) ends of the signal wakeup pipe
        self._seen: dict[int, Any] = {}  # rank 0: each rank's last beat's stillness, to see it hold

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Watchdog":
        global _active
        self._watch_signals()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="zeroq-watchdog", daemon=True)
        self._thread.start()
        _active = self
        return self

    def stop(self) -> None:
        global _active
        self._stop.set()
        if self._wakeup is not None:
            try:
                os.write(self._wakeup[1], b"\0")  # wakes the thread (0: no signal)
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s + 1)
        self._unwatch_signals()
        if _active is self:
            _active = None

    def _watch_signals(self) -> None:
        """Python's wakeup descriptor: a pipe this thread reads (main thread only; one already set is kept)."""
        if threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous != -1:  # someone else's (an event loop's), or none could be set: leave it
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return
        self._wakeup = (read, write)

    def _unwatch_signals(self) -> None:
        if self._wakeup is None or threading.current_thread() is not threading.main_thread():
            return
        read, write = self._wakeup
        self._wakeup = None
        try:
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, write):
                signal.set_wakeup_fd(current)  # not ours: put back
        except (ValueError, OSError):
            pass
        for fd in (read, write):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wait(self) -> bool:
        """Wait one interval, noting a signal that arrives; True once stopped."""
        if self._wakeup is None:
            return self._stop.wait(self.interval_s)
        try:
            ready, _, _ = select.select([self._wakeup[0]], [], [], self.interval_s)
            if ready:
                for number in os.read(self._wakeup[0], 64):
                    if number in _SIGNALS and self._signalled is None:
                        self._signalled, self._signal_key, self._signal_at = number, self._main_key(), time.monotonic()
        except (OSError, ValueError):
            return self._stop.wait(self.interval_s)
        return self._stop.is_set()

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
        while not self._wait():
            try:
                self._beat()
                if self._signal_unheeded() and self.aborted is None:
                    assert self._signalled is not None
                    self._end_on_signal(self._signalled)
                    return
                if (
                    self._inside
                    and self._still() >= STILL_S
                    and self.rank == 0
                    and self.world_size > 1
                    and self.aborted is None
                ):
                    found = self._different_gathers()
                    if found is not None:
                        self._abort(f"ZeroQ: the job ends: {found}.")
                        return
                record = self._abort_record()
            except Exception as error:  # the store is gone: rank 0's process (which hosts it) has ended
                if self._stop.is_set() or self._closing() or self.aborted is not None:
                    return
                self._end(
                    f"rank {self.rank}: the job's store cannot be reached ({type(error).__name__}): rank 0's "
                    "process has ended; ending this rank too."
                )
                return
            if record is not None and self.aborted is None and not self._stop.is_set():
                self._end(record)
                return

    # ------------------------------------------------------------------ beats and the abort record

    def _closing(self) -> bool:
        return self._saw_closing

    def _signal_unheeded(self) -> bool:
        """A signal came ``STILL_S`` ago and the main thread has not moved since. Where it moved, its handler
        ran and decided (Lightning's, or the user's that lets training go on): the signal is forgotten."""
        if self._signalled is not None and self._main_key() != self._signal_key:
            self._signalled = None
        return self._signalled is not None and time.monotonic() - self._signal_at >= STILL_S

    def _main_key(self) -> Any:
        """Where the main thread stands: its innermost frame and instruction, and its count of stage-3 gathers."""
        from lightning_zeroq.zero.gather import GATHERS

        frame = sys._current_frames().get(self._main) if self._main is not None else None
        return (id(frame), getattr(frame, "f_lasti", None), GATHERS.snapshot()["n"])

    def _beat(self) -> None:
        from lightning_zeroq.zero.gather import GATHERS

        frame = sys._current_frames().get(self._main) if self._main is not None else None
        waiting, at = where(frame)
        inside = frame is not None and any(s in frame.f_code.co_filename for s in _COLLECTIVE_FILES)
        gathers = GATHERS.snapshot()
        key = self._main_key()
        if key != self._still_key:  # the main thread moved
            self._still_key, self._still_since = key, time.monotonic()
        self._inside = inside
        beat = {
            "t": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "waiting": waiting,
            "at": at,
            "inside": inside,
            "still": self._still() if inside else 0.0,
            "gathers": gathers,
        }
        self.store.set(f"{PREFIX}beat/{self.rank}", json.dumps(beat))

    def _still(self) -> float:
        """How long the main thread has not moved (one C call: a collective, a sleep), as of the last beat."""
        return time.monotonic() - self._still_since

    def _different_gathers(self) -> Optional[str]:
        """Rank 0, its main thread still in a collective: the ranks' different stage-3 gathers, if every rank
        has stood still in a collective as long (twice in a row: what it read last time holds)."""
        beats, _ = self._beats()
        stills = {
            r: (b["gathers"], b["at"])
            if b is not None
            and b.get("inside")
            and b.get("still", 0) >= STILL_S
            and time.time() - b["t"] < 4 * self.interval_s + 1
            else None
            for r, b in beats.items()
        }
        held = all(v is not None and self._seen.get(r) == v for r, v in stills.items())
        self._seen = stills
        return different_gathers(beats) if held else None

    def _abort(self, message: str) -> None:
        """Rank 0 found why the ranks wait: the abort record for every rank, a moment to read it, then end."""
        try:
            self.store.set(ABORT_KEY, message)
            self._wait_for_acks()
        except Exception:
            pass
        self._end(message)

    def _wait_for_acks(self) -> None:
        deadline = time.monotonic() + 3 * self.interval_s + 1
        while time.monotonic() < deadline:  # the others read it within an interval, then exit
            if all(self.store.check([f"{PREFIX}ack/{r}"]) for r in range(self.world_size) if r != self.rank):
                break
            time.sleep(self.interval_s / 4)

    def _end_on_signal(self, number: int) -> None:
        """A signal the main thread has not acted on for ``STILL_S``: end this rank and the job."""
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        _, at = where(frame)
        inside = frame is not None and any(s in frame.f_code.co_filename for s in _COLLECTIVE_FILES)
        name = signal.Signals(number).name
        message = (
            f"ZeroQ: the job ends: rank {self.rank} received {name} while its main thread was blocked "
            + ("in a collective" if inside else "in a call that does not return")
            + f", at {at}"
        )
        try:
            if not self.store.check([ABORT_KEY]):
                self.store.set(ABORT_KEY, message)
                self._wait_for_acks()
        except Exception:
            pass
        self._end(message, status=128 + number)

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
            return (
                "rank 0 ended (the job's store, which its process hosts with Lightning's launcher and "
                "zeroq-train, cannot be reached)"
            )
        gathers = different_gathers(beats)
        beats.pop(self.rank, None)
        silent = {
            r: b
            for r, b in beats.items()
            if b is None
            or now - b["t"] > 4 * self.interval_s + 1
            or (b["host"] == socket.gethostname() and not _alive(b["pid"]))
        }
        outside = {r: b for r, b in beats.items() if b is not None and r not in silent and not b["waiting"]}
        parts = []
        for r, b in sorted(silent.items()):
            if b is not None and b["host"] == socket.gethostname() and not _alive(b["pid"]):
                parts.append(f"rank {r} died (its process {b['pid']} is gone; it was last at {b['at']})")
                continue
            age = "never" if b is None else f"{now - b['t']:.0f} s ago"
            parts.append(
                f"rank {r} stopped (last sign of life {age}: killed or wedged" + (f", last at {b['at']})" if b else ")")
            )
        for r, b in sorted(outside.items()):
            parts.append(f"rank {r} stalled outside any collective, at {b['at']}")
        if gathers is not None:
            parts.append(gathers)
        if not parts:
            parts.append(
                "no rank is outside a collective: the ranks wait in different collectives (code that "
                "runs a collective on some ranks only)"
            )
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
        message = (
            f"ZeroQ: the job ends: {diagnosis}. Rank {self.rank}'s collective failed"
            + (f" after the process group's timeout ({self.timeout_s:.0f} s)" if timed_out else "")
            + f": {first}"
        )
        self.aborted = message
        log.error("%s", message)
        if error.args and isinstance(error.args[0], str):  # the traceback's last line names the rank too
            error.args = (f"ZeroQ: {diagnosis}. {error.args[0]}", *error.args[1:])
        try:
            self.store.set(ABORT_KEY, message)
            self._wait_for_acks()
        except Exception:
            pass
        self._stop.set()  # this rank ends by its exception; its store (rank 0's) may go any moment
        return message

    def _end(self, message: str, status: int = 1) -> None:
        self.aborted = message
        try:
            self.store.set(f"{PREFIX}ack/{self.rank}", "1")
        except Exception:
            pass
        line = f"[rank {self.rank}] {message}\n"
        try:  # one write: the line stays whole beside the other ranks' on a shared pipe
            sys.stderr.flush()
            os.write(sys.stderr.fileno(), line.encode("utf-8", "replace"))
        except (OSError, ValueError, AttributeError):
            print(line, end="", file=sys.stderr, flush=True)
        from lightning_zeroq.swap.cleanup import remove_live_files

        for fn in [remove_live_files, *_cleanups]:
            try:
                fn()
            except Exception:
                pass
        self._exit_fn(status)


def different_gathers(beats: dict[int, Optional[dict]]) -> Optional[str]:
    """From every rank's beat: the first stage-3 gather (by number) whose unit differs across the ranks, or a
    gather some ranks are in while the others wait elsewhere, named with the units and ranks; else None."""
    from lightning_zeroq.zero.gather import different_units

    known = {r: b["gathers"] for r, b in beats.items() if b is not None and isinstance(b.get("gathers"), dict)}
    if len(known) < 2:
        return None

    def unit(g: dict, number: int) -> Optional[str]:
        first = g["n"] - len(g["last"]) + 1
        return g["last"][number - first] if first <= number <= g["n"] else None

    low = max(g["n"] - len(g["last"]) + 1 for g in known.values())
    high = min(g["n"] for g in known.values())
    for number in range(max(low, 1), high + 1):
        names = {r: unit(g, number) for r, g in known.items()}
        if len(set(names.values())) > 1:
            return different_units(number, names).removeprefix("ZeroQ ")
    # a rank in its gather #n while another, done with gather n - 1, waits elsewhere
    for number in sorted({g["n"] for g in known.values() if g["now"] is not None}):
        behind = {o: g for o, g in known.items() if g["n"] == number - 1 and g["now"] is None}
        if behind:
            units_at: dict[int, Optional[str]] = dict.fromkeys(behind)
            units_at.update({o: g["now"] for o, g in known.items() if g["n"] == number and g["now"] is not None})
            return different_units(number, units_at).removeprefix("ZeroQ ")
    return None


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
