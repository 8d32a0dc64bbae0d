"""Lightning's subprocess launcher, with no swap directory left behind by the ranks it kills.

Lightning's ``_SubprocessScriptLauncher`` (``devices=N`` without torchrun or SLURM) ends the job with
SIGKILL in two places: after Ctrl-C in rank 0 it kills the ranks it started (which may be in the
middle of their own clean-up after the same Ctrl-C), and its observer thread, when a rank it started
exits with an error, kills the other ranks and rank 0 itself. SIGKILL runs no clean-up, so NVMe swap
directories (``<nvme_path>/zeroq_rank<r>_*``, ``zeroq_params_rank<r>_*``) stayed behind.

``ZeroQLauncher`` is that launcher plus, after every SIGKILL it sends: wait for those processes to
be gone, then remove the swap directories whose lock names one of them
(``swap.directory.remove_directories_of``: provably theirs); before the observer kills rank 0 itself, rank
0's own swap files are removed first.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Any, Callable, Optional

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_zeroq.swap.cleanup import remove_live_files
from lightning_zeroq.swap.directory import remove_directories_of

log = logging.getLogger("lightning_zeroq")


def reap_and_clean(procs: list[subprocess.Popen], swap_roots: list[str], timeout_s: float = 10.0) -> None:
    """Wait (up to ``timeout_s``) for ``procs`` to be gone, then remove their swap directories."""
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    dead = [p.pid for p in procs if p.returncode is not None]
    for root in swap_roots:
        for path in remove_directories_of(root, dead):
            log.info("removed %s, the swap directory of a killed rank", path)


class _Observer(_ChildProcessObserver):
    def __init__(self, main_pid: int, child_processes: list[subprocess.Popen], swap_roots: list[str]) -> None:
        super().__init__(main_pid, child_processes)
        self._swap_roots = swap_roots

    def _terminate_all(self) -> None:
        for proc in self._child_processes:
            proc.send_signal(self._termination_signal)
        if self._termination_signal == signal.SIGKILL:
            reap_and_clean(self._child_processes, self._swap_roots)
            remove_live_files()  # this process's own swap files: rank 0 is killed next
        os.kill(self._main_pid, self._termination_signal)


class ZeroQLauncher(_SubprocessScriptLauncher):
    """``_SubprocessScriptLauncher`` that removes the swap directories of the ranks it kills."""

    def __init__(
        self, cluster_environment: Any, num_processes: int, num_nodes: int, swap_roots: Callable[[], list[str]]
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._swap_roots = swap_roots
        self._observer: Optional[_Observer] = None

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self._observer = _Observer(os.getpid(), self.procs, self._swap_roots())
            self._observer.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def __getstate__(self) -> dict:
        # The Trainer pickles (torch.save(trainer), Lightning's own tests do it after fit) with its strategy
        # and launcher; the observer thread and the child processes it watches belong to this process alone.
        state = self.__dict__.copy()
        state["_observer"] = None
        state["procs"] = []
        return state

    def kill(self, signum: Any) -> None:
        super().kill(signum)
        if signum == signal.SIGKILL and self.procs:
            reap_and_clean(self.procs, self._swap_roots())


def record_sigterm_without_collectives(trainer: Any) -> None:
    """Make Lightning's SIGTERM handler only record the signal (and forward it to the ranks rank 0
    started), without its ``dist.broadcast``.

    Lightning's handler broadcasts inside the signal handler. With SIGTERM sent to a whole process
    group (``kill -TERM -PGID``, a scheduler, ``timeout``), every rank runs it, and rank 0 forwards
    the signal to its children, which then run it a second time: the ranks issue different numbers
    of broadcasts and the job hangs until the collective timeout (swap files and all). The fit loop
    broadcasts rank 0's flag before every step anyway, so recording it is enough: every rank stops
    at the same step with ``SIGTERMException`` and cleans up on its way out."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler: Any = signal.getsignal(signal.SIGTERM)  # Lightning's _HandlersCompose, when it installed one
    handlers = getattr(handler, "signal_handlers", None)
    connector: Any = getattr(trainer, "_signal_connector", None)
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    if not isinstance(handlers, list) or notifier is None or notifier not in handlers:
        return

    def record(signum: int, frame: Any) -> None:
        if not connector.received_sigterm:
            log.info("rank %d: received SIGTERM: stopping before the next step", trainer.global_rank)
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        connector.received_sigterm = True

    handler.signal_handlers = [record if h == notifier else h for h in handlers]
