"""Signal handlers that remove the swap files before a signal's default action kills the process.

Signals
    A SIGTERM, SIGINT or SIGHUP whose disposition is the default kills the process without running
    ``atexit``, which would leave the files behind. So a swapper created in the main thread replaces
    that default (and only that: in practice SIGTERM and SIGHUP) by a handler that removes the files of every
    live swapper, restores the default and raises the signal again, so the process still dies by it,
    with the usual status. A Python handler already installed is left alone: it decides, and the
    files go when the swapper is closed or the process exits (Python's own SIGINT handler raises
    ``KeyboardInterrupt``, and whoever catches it may still need the files: Lightning's
    on-exception checkpoint after Ctrl-C, a notebook interrupted mid-cell). Ignored signals stay
    ignored. A handler installed later that calls ours as one of several decides alone, and ours
    does nothing: Lightning's trainer installs its SIGTERM handler after the strategy made the
    swappers, calls the handler it found, and stops training gracefully. The default is put back
    when the last swapper is gone, if ours is still the one installed. Limits: Python runs signal
    handlers between bytecodes only, so while a swapper lives a process stuck in a long C call (a
    hung collective) reacts to SIGTERM when that call returns; what SIGKILL leaves behind is only
    reported (see ``directory``); a swapper created outside the main thread cannot install the handler
    (logged once per process). Between the moment a swapper makes its directory and the moment the
    handler knows it, a signal is held (``signals_held``): the handler is installed first, notes a
    signal that arrives then, and acts on it once the directory is tracked.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Iterator, Optional, Protocol

log = logging.getLogger(__name__)

_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Removable(Protocol):
    """What the handlers remove: a swapper's files (``directory.Resources``)."""

    @property
    def directory(self) -> Path: ...

    def remove_files(self) -> None: ...

    @property
    def removed(self) -> bool: ...

    @property
    def removal_done(self) -> bool: ...


# Resources of every swapper that has not been cleaned up yet, for the signal handlers. Plain dict
# operations (atomic under the GIL), no lock: a handler or a finalizer can run at any bytecode.
_live: dict[int, Removable] = {}
_signal_handlers: dict[int, "_CleanupHandler"] = {}
_dying = False
_warned_not_main_thread = False
_holding = 0  # > 0 inside ``signals_held``
_held: list[int] = []  # signals that arrived while held


class _CleanupHandler:
    """Replaces the default action of SIGTERM/SIGINT: remove every live swapper's files, then die by
    the signal (see "Signals")."""

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        if signal.getsignal(signum) is not self:
            # A handler installed after us calls us as one of several (Lightning's SIGTERM handler
            # does, then stops the trainer gracefully): the default action we stand in for is not
            # going to happen, so neither remove the files nor die.
            return
        if _holding:  # a swap directory may exist that the registry does not know yet
            _held.append(signum)
            return
        global _dying
        if _dying:
            # The same signal again while we clean up (sent to the whole process group and forwarded by
            # a parent, such as ``timeout`` or Lightning's launcher): Python runs handlers between any
            # two bytecodes, this one too, so without this a second call would die half-way through
            # the first one's removal and leave the rest behind.
            return
        _dying = True
        _remove_all()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Install the handlers now (main thread) and hold a signal that arrives inside the block until
    its end, when what it should remove is tracked (``track_live``); then act on it."""
    global _holding
    _install_handlers()
    _holding += 1
    try:
        yield
    finally:
        _holding -= 1
        if not _holding and _held:
            signum = _held[0]
            _held.clear()
            handler = signal.getsignal(signum)
            if isinstance(handler, _CleanupHandler):
                handler(signum, None)
        if not _holding:
            _restore_defaults()  # nothing was tracked (the directory could not be made)


def _install_handlers() -> bool:
    """Put our handler where a cleanup signal has its default action; False outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in _CLEANUP_SIGNALS:
        current = signal.getsignal(signum)
        if isinstance(current, _CleanupHandler):
            _signal_handlers[signum] = current  # ours already (put back by someone), reused
        elif current == signal.SIG_DFL:
            handler = _CleanupHandler()
            signal.signal(signum, handler)
            _signal_handlers[signum] = handler
    return True


def track_live(resources: Removable) -> None:
    global _warned_not_main_thread
    _live[id(resources)] = resources
    if _install_handlers():
        return
    if any(signal.getsignal(s) == signal.SIG_DFL for s in _CLEANUP_SIGNALS) and not _warned_not_main_thread:
        _warned_not_main_thread = True
        log.warning(
            "NvmeSwapper created outside the main thread cannot install its SIGTERM handler, so a SIGTERM "
            "would leave %s behind (close() and a normal exit still remove it); create the first swapper "
            "from the main thread",
            resources.directory,
        )


def forget_live(resources: Removable) -> None:
    """Drop ``resources`` from the registry; the last one out puts the default actions back."""
    _live.pop(id(resources), None)
    _restore_defaults()


def _restore_defaults() -> None:
    """With no swapper left (main thread): the default actions back where ours is still installed."""
    if _live or threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in list(_signal_handlers.items()):
        try:
            if signal.getsignal(signum) is handler:
                signal.signal(signum, signal.SIG_DFL)
        except (ValueError, TypeError, OSError):
            pass
        _signal_handlers.pop(signum, None)


def remove_live_files() -> None:
    """Remove the files and directories of every live swapper of this process, now (before the
    process is ended in a way that runs no cleanup: ``os._exit``, SIGKILL). Safe from any thread."""
    _remove_all()


def _remove_all(wait_s: float = 2.0) -> None:
    """Remove every live swapper's files; a removal another thread started (the watchdog ending the
    process while a signal handler cleans up, or the other way round) is waited for, up to ``wait_s``,
    so that neither ends the process half-way through the other's work."""
    live = list(_live.values())
    for resources in live:
        try:
            resources.remove_files()
        except Exception:
            pass
    deadline = time.monotonic() + wait_s
    while any(r.removed and not r.removal_done for r in live) and time.monotonic() < deadline:
        time.sleep(0.01)
