"""A persistent pool of gloo worker processes for distributed tests on CPU.

Lifecycle:

* ``DistPool(world_size)`` hosts a ``TCPStore`` in the calling (pytest) process and
  spawns ``world_size`` workers ("spawn" start method). Each worker sets the env vars
  an externally launched Lightning process has (MASTER_ADDR/PORT, WORLD_SIZE, RANK,
  LOCAL_RANK, NODE_RANK), ``torch.set_num_threads(1)``, joins a gloo process group
  through the store (60 s collective timeout), pre-imports ``lightning.pytorch`` and
  reports ready. Lightning then sees ``LOCAL_RANK`` (-> processes created externally)
  and an initialized process group (-> ``_init_dist_connection`` is a no-op).
* ``run(fn, *args, **kwargs)`` sends ``(fn.__module__, fn.__qualname__, args, kwargs)``
  to every rank; each resets cheap global state (env vars, cwd, warnings filters,
  default dtype, threads, grad mode), calls ``fn(*args, **kwargs)`` and answers with
  the result or its formatted traceback. Results come back in rank order.
* If any rank raises, dies, or does not answer within ``timeout``, all workers are
  killed (surviving ranks may be stuck in a collective) and ``run`` raises
  ``RuntimeError`` with every remote traceback; the next ``run`` restarts the pool.
  If a test destroys the default process group on all ranks, workers re-create it
  (under a fresh store prefix) before the next task; if only some ranks lost it, the
  pool is restarted.
* ``close()`` asks workers to exit, joins them with a timeout, then kills them.
  Pools still open at interpreter exit are closed by an ``atexit`` hook.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import sys
import time
import traceback
import weakref
from multiprocessing.connection import wait
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])
PG_TIMEOUT_S = 60.0
_open_pools: "weakref.WeakSet[DistPool]" = weakref.WeakSet()


def _init_pg(store, tag: str, rank: int, world_size: int, backend: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, store=dist.PrefixStore(tag, store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S), **extra)


def _worker_main(rank: int, world_size: int, port: int, conn, backend: str = "gloo") -> None:
    os.dup2(2, 1)  # worker stdout -> the pytest process's stderr
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False,
                          timeout=timedelta(seconds=PG_TIMEOUT_S))
    _init_pg(store, "pg/", rank, world_size, backend)
    import lightning.pytorch  # noqa: F401  (pre-import: this is what makes a pool worth it)

    env, cwd, filters = dict(os.environ), os.getcwd(), list(warnings.filters)
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the pytest process went away
            msg = None
        if msg is None:
            break
        task_id, mod, qualname, args, kwargs = msg
        try:
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            warnings.filters[:] = filters
            torch.set_default_dtype(torch.float32)
            torch.set_num_threads(1)
            torch.set_grad_enabled(True)
            if not dist.is_initialized():  # a previous test destroyed it (on all ranks)
                _init_pg(store, f"pg{task_id}/", rank, world_size, backend)
            fn = importlib.import_module(mod)
            for name in qualname.split("."):
                fn = getattr(fn, name)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:
            reply = ("error", traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send((*reply, dist.is_initialized()))
        except Exception:  # e.g. unpicklable result
            conn.send(("error", traceback.format_exc(), dist.is_initialized()))
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    import gc

    gc.collect()  # engines left in reference cycles by tests remove their NVMe swap files now
    os._exit(0)  # skip slow interpreter teardown of torch/lightning


class DistPool:
    error_grace_s = 1.0  # after one rank fails, how long to wait for the others' answers

    def __init__(self, world_size: int, timeout: float = 120.0, backend: str = "gloo"):
        self.world_size, self.timeout, self.backend = world_size, timeout, backend
        self._procs: list = []
        self._conns: list = []
        self._task_id = 0
        self._store = None
        _open_pools.add(self)

    def _start(self) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=PG_TIMEOUT_S))
        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, self.world_size, self._store.port, child, self.backend),
                            name=f"dist_pool-{self.world_size}-rank{rank}")
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        replies = self._collect("pool start")
        assert all(r == ("ready", i) for i, r in enumerate(replies)), replies

    def run(self, fn, *args, **kwargs) -> list:
        mod, qualname = fn.__module__, fn.__qualname__
        if mod == "__main__" or "<locals>" in qualname:
            raise ValueError(f"{mod}.{qualname}: fn must be a module-level function of an importable module")
        if not all(p.is_alive() for p in self._procs):  # first run, after a failure, or a worker vanished
            self._kill()
        self._task_id += 1
        try:
            if not self._procs:
                self._start()
            for conn in self._conns:
                conn.send((self._task_id, mod, qualname, args, kwargs))
            replies = self._collect(f"run({mod}.{qualname})")
        except BaseException:  # incl. KeyboardInterrupt: never leave half-finished tasks in the pool
            self._kill()
            raise
        pg_alive = {alive for _, _, alive in replies}
        if len(pg_alive) > 1:  # only some ranks destroyed the process group: unrecoverable in place
            self._kill()
        return [value for _, value, _ in replies]

    def run_within(self, timeout: float, fn, *args, **kwargs) -> list:
        """``run`` with its own ``timeout`` (e.g. well under the collective timeout: a hang fails fast)."""
        saved, self.timeout = self.timeout, timeout
        try:
            return self.run(fn, *args, **kwargs)
        finally:
            self.timeout = saved

    def _collect(self, what: str) -> list:
        """One reply per rank; on any failure kill the pool and raise with all tracebacks."""
        replies: dict = {}
        failures: dict = {}
        deadline = time.monotonic() + self.timeout
        pending = dict(enumerate(self._conns))
        while pending:
            left = deadline - time.monotonic()
            if failures:
                left = min(left, self.error_grace_s)
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait(list(pending.values()) + list(sentinels), timeout=max(left, 0))
            if not ready:
                break
            for rank, conn in list(pending.items()):
                if conn in ready or self._procs[rank].sentinel in ready:
                    try:
                        reply = conn.recv()
                    except (EOFError, OSError):
                        self._procs[rank].join(1)
                        reply = ("error", f"worker died (exitcode {self._procs[rank].exitcode})")
                    del pending[rank]
                    (failures if reply[0] == "error" else replies)[rank] = reply
        if failures or pending:
            self._kill()
            msg = [f"DistPool(world_size={self.world_size}) {what} failed; pool killed, restarts on next run."]
            msg += [f"--- rank {r} raised:\n{failures[r][1]}" for r in sorted(failures)]
            msg += [f"--- rank {r}: no answer (killed)" for r in sorted(pending)]
            raise RuntimeError("\n".join(msg))
        return [replies[r] for r in range(self.world_size)]

    def _kill(self) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for p in self._procs:
            p.join(max(deadline - time.monotonic(), 0))
        self._kill()


@atexit.register
def _close_all() -> None:
    for pool in list(_open_pools):
        pool.close()
