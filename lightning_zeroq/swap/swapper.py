"""NVMe swap space for offloaded optimizer state: named fixed-size regions in per-rank files.

The engine keeps one region per ZeRO unit and kind (fp32 master shard, each optimizer state such as
``exp_avg``/``exp_avg_sq``, the gradient shard) on a local disk and moves it to and from CPU
tensors it owns. :class:`NvmeSwapper` is that swap space; it knows nothing about ZeRO.

Files
    Every region has its own file, ``<key>.swp``, so that a region is one contiguous extent that
    starts at offset 0. Its size is rounded up to ``alignment`` bytes (4096 by default), which is
    what ``O_DIRECT`` asks of offsets and lengths. :meth:`NvmeSwapper.reserve` checks the free space
    for every registered region at once (before writing anything: failing at step 1 beats failing
    after an hour) and preallocates the files with ``posix_fallocate``, so a later write cannot run
    out of space. A file is opened for each transfer and closed after it, so there is no
    file-position or descriptor state to share between threads, no descriptor limit to hit with
    thousands of regions, and a file removed behind our back is noticed at the next transfer
    instead of being read through a stale descriptor.

Read-ahead
    :meth:`prefetch` reads a region into an aligned staging buffer of the region's (aligned) size;
    staging buffers are reused by size, at most ``num_buffers`` idle ones are kept. :meth:`read`
    then waits for it and copies into the caller's tensor. ``prefetch(key, out=t)`` reads straight
    into ``t`` instead (no staging buffer, no copy); ``t`` must then be left alone until
    ``read(key, t)``.

Error policy
    Bad arguments (unknown key, wrong numel/dtype/device, bad sizes) raise ``ValueError`` at once.
    A bad environment (missing, non-directory or read-only path, too little free space, no
    ``O_DIRECT`` when it was required, a file planted where a swap file goes) raises
    ``RuntimeError`` naming the path and the fix. A short read, a file that shrank or vanished
    after it was written, or an OS error in a transfer raises ``RuntimeError`` naming the file, the
    offset and the byte counts; data is never returned partially. An error in a background transfer
    is recorded and raised by the next ``read``/``write``/``write_async``/``prefetch``/``wait_all``
    (and by the handle's ``wait``), and from then on by every call: after a failed transfer the
    contents of the swap space are no longer trustworthy, and training must not continue on them.

Lifetime
    :meth:`close` waits for outstanding transfers, then removes the files, the lock and the
    directory. It is idempotent. The same cleanup runs (best effort, never raising) when the
    swapper is garbage collected, also from inside a reference cycle (a ``weakref.finalize`` whose
    callback holds only ``directory.Resources``; pending operations are cancelled, running ones
    finish first), and at interpreter exit. A forked child's copy of a swapper never removes its
    parent's files.

Testing hook
    The free-space query is the module-level function :func:`free_bytes`, looked up at each
    ``reserve()``; tests monkeypatch ``lightning_zeroq.swap.swapper.free_bytes`` to exercise
    the "too small" error without filling a disk.

A swapper is meant to be driven from one thread (the engine's); only its own background threads
run concurrently with that thread.
"""

from __future__ import annotations

import functools
import logging
import shutil
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lightning_zeroq.swap.buffers import BouncePool, StagingCache, byte_view
from lightning_zeroq.swap.cleanup import signals_held, track_live
from lightning_zeroq.swap.directory import (
    THREAD_PREFIX,
    check_directory,
    create_file,
    create_private_directory,
    directory_stem,
    report_leftovers,
)
from lightning_zeroq.swap.io import Failure, RegionIO, SwapHandle, choose_direct_io
from lightning_zeroq.swap.regions import (
    DEFAULT_BUFFER_BYTES,
    PathLike,
    Region,
    check_arguments,
    check_tensor,
    new_region,
)

__all__ = ["NvmeSwapper", "free_bytes", "human_bytes"]

log = logging.getLogger(__name__)

_ASYNC_OP_THREADS = 2


def free_bytes(path: str) -> int:
    """Bytes available to this process on the filesystem holding ``path``.

    ``NvmeSwapper.reserve`` calls it through the module attribute, so tests can monkeypatch it.
    """
    return shutil.disk_usage(path).free


def human_bytes(n: int) -> str:
    """``1536 -> '1.50 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass
class _Staged:
    """A read-ahead in progress or done: ``future`` fills ``target`` (a staging buffer or ``out``)."""

    future: "Future[None]"
    target: torch.Tensor
    owned: bool  # target is a staging buffer to give back after use


# ----------------------------------------------------------------------------------------------
# The swapper
# ----------------------------------------------------------------------------------------------


class NvmeSwapper:
    """Named fixed-size regions in swap files in a private per-run directory, moved to and from CPU tensors.

    Args:
        nvme_path: an existing, writable directory on a fast local disk (a symlink to one is fine).
        rank: the global rank; names the swapper's directory.
        num_buffers: aligned bounce buffers in the pool (also the number of idle read-ahead
            staging buffers kept for reuse).
        alignment: bytes; file offsets and sizes are multiples of it, and so must be memory that
            ``O_DIRECT`` uses without a bounce buffer. A power of two >= 512.
        buffer_bytes: the chunk and bounce-buffer size; a positive multiple of ``alignment``.
        num_threads: I/O threads, i.e. chunk transfers in flight at once.
        direct_io: ``None`` probes for ``O_DIRECT`` and falls back to buffered I/O; ``True``
            requires it; ``False`` uses buffered I/O.
        pin_memory: pin the bounce and staging buffers; ``None`` pins when CUDA is available.
        prefix: the swapper's directory is ``<prefix>_rank<rank:05d>_<random>``, created by the
            constructor and removed by :meth:`close`; every swapper gets its own.
    """

    def __init__(
        self,
        nvme_path: PathLike,
        *,
        rank: int = 0,
        num_buffers: int = 4,
        alignment: int = 4096,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        num_threads: int = 2,
        direct_io: Optional[bool] = None,
        pin_memory: Optional[bool] = None,
        prefix: str = "zeroq",
    ) -> None:
        check_arguments(rank, num_buffers, alignment, buffer_bytes, num_threads, prefix)
        self.root = check_directory(Path(nvme_path))
        with signals_held():  # a signal before the directory is tracked would leave it behind
            self._resources = create_private_directory(self.root, prefix, rank)
            track_live(self._resources)
        self._finalizer = weakref.finalize(self, self._resources.cleanup)
        self.directory = self._resources.directory
        self.rank = rank
        self.alignment = alignment
        self.buffer_bytes = buffer_bytes
        self.num_threads = num_threads
        self.direct_io: Optional[bool] = None  # decided by the first reserve()
        self._requested_direct = direct_io
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._bounce = BouncePool(num_buffers, buffer_bytes, alignment, pin)
        self._staging = StagingCache(num_buffers, alignment, pin)
        self._regions: dict[str, Region] = {}
        self._reserved: set[str] = set()
        self._written: set[str] = set()
        self._last_op: dict[str, Future[None]] = {}
        self._staged: dict[str, _Staged] = {}
        self._failure = Failure()
        self._closed = False
        io = ThreadPoolExecutor(num_threads, thread_name_prefix=f"{THREAD_PREFIX}io-r{rank}")
        self._ops = ThreadPoolExecutor(_ASYNC_OP_THREADS, thread_name_prefix=f"{THREAD_PREFIX}op-r{rank}")
        self._resources.executors += [self._ops, io]
        self._region_io = RegionIO(self._resources.dir_fd, io, self._bounce, alignment, buffer_bytes, num_threads)
        report_leftovers(self._resources, directory_stem(prefix, rank), everyone=rank == 0)

    # -- declaration and reservation ------------------------------------------------------------

    def register(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Declare a region of ``numel`` elements of ``dtype``; takes effect at the next :meth:`reserve`."""
        self._check_open()
        self._regions[key] = new_region(key, numel, dtype, self.alignment, self.directory, self._regions)

    def reserve(self) -> None:
        """Check free space for every registered, not yet reserved region, then create the files.

        The first call also decides between ``O_DIRECT`` and buffered I/O.
        """
        self._check_open()
        pending = [r for key, r in self._regions.items() if key not in self._reserved]
        if self.direct_io is None:
            resources = self._resources
            self.direct_io = choose_direct_io(
                self._requested_direct, resources.dir_fd, resources.files, self.root, self.directory, self.alignment
            )
            self._region_io.direct = self.direct_io
        needed = sum(r.file_bytes for r in pending)
        free = free_bytes(str(self.directory))
        when_full = _too_small_message(self.root, needed, free, len(pending))
        if needed > free:
            raise RuntimeError(when_full)
        for region in pending:
            create_file(self._resources, region, when_full)
            self._reserved.add(region.key)

    def nbytes(self, key: str) -> int:
        """The region's payload size in bytes (its file is this rounded up to ``alignment``)."""
        return self._region(key, reserved=False).nbytes

    def path_of(self, key: str) -> Path:
        """The swap file of ``key``."""
        return self._region(key, reserved=False).path

    @property
    def reserved_bytes(self) -> int:
        """Bytes of swap files created so far."""
        return sum(self._regions[k].file_bytes for k in self._reserved)

    # -- transfers --------------------------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` to ``key``'s region and return when it is on disk (or in the page cache)."""
        self._check_failure()
        region = self._region(key)
        check_tensor(region, tensor, "write")
        self._discard_staged(key)
        self._wait_last_op(key)
        self._written.add(key)
        self._transfer_now(region, byte_view(tensor), write=True)

    def write_async(self, key: str, tensor: torch.Tensor) -> SwapHandle:
        """Start writing ``tensor`` to ``key``; do not modify ``tensor`` before the handle's ``wait()``."""
        self._check_failure()
        region = self._region(key)
        check_tensor(region, tensor, "write_async")
        self._discard_staged(key)
        future = self._submit(key, functools.partial(self._region_io.transfer, region, byte_view(tensor), True))
        self._written.add(key)
        return SwapHandle(key, future, self._failure.mark_raised)

    def prefetch(self, key: str, out: Optional[torch.Tensor] = None) -> SwapHandle:
        """Start reading ``key`` ahead, into a staging buffer or, if given, straight into ``out``.

        Complete it with :meth:`read`. With ``out``, leave ``out`` alone until then. Prefetching a
        key that already has a read-ahead outstanding returns the existing one.
        """
        self._check_failure()
        region = self._region(key)
        self._check_written(region)
        if key in self._staged:
            return SwapHandle(key, self._staged[key].future, self._failure.mark_raised)
        if out is not None:
            check_tensor(region, out, "prefetch")
            target, owned = byte_view(out), False
        else:
            target, owned = self._staging.get(region.file_bytes), True
        # A staging buffer has the whole aligned file size, so the tail needs no bounce buffer.
        future = self._submit(key, functools.partial(self._region_io.transfer, region, target, False))
        self._staged[key] = _Staged(future, target, owned)
        return SwapHandle(key, future, self._failure.mark_raised)

    def read(self, key: str, out: torch.Tensor) -> None:
        """Fill ``out`` with ``key``'s region: from its read-ahead if one was issued, else from disk."""
        self._check_failure()
        region = self._region(key)
        check_tensor(region, out, "read")
        self._check_written(region)
        staged = self._staged.pop(key, None)
        if staged is None:
            self._wait_last_op(key)
            self._transfer_now(region, byte_view(out), write=False)
            return
        try:
            self._wait(staged.future)
            destination = byte_view(out)
            if staged.target.data_ptr() != destination.data_ptr():
                destination.copy_(staged.target[: region.nbytes])
        finally:
            self._release_staged(staged)

    def wait_all(self) -> None:
        """Wait for every outstanding write and read-ahead; raise the first I/O error, if any."""
        self._check_open()
        wait_futures(list(self._last_op.values()))
        self._last_op = {k: f for k, f in self._last_op.items() if not f.done()}
        self._check_failure()

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for outstanding transfers, remove the files and the directory.

        Idempotent. Raises a background I/O error only if no earlier call has reported it.
        """
        if self._closed:
            return
        self._closed = True
        wait_futures(list(self._last_op.values()))
        for key in list(self._staged):
            self._release_staged(self._staged.pop(key))
        self._last_op.clear()
        self._finalizer()
        failure = self._failure
        if failure.error is not None and not failure.raised:
            failure.raised = True
            raise failure.error

    def __enter__(self) -> "NvmeSwapper":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NvmeSwapper(directory={str(self.directory)!r}, regions={len(self._regions)}, "
            f"reserved={human_bytes(self.reserved_bytes)}, direct_io={self.direct_io})"
        )

    # -- internals: setup -------------------------------------------------------------------------

    # -- internals: bookkeeping -------------------------------------------------------------------

    def _region(self, key: str, reserved: bool = True) -> Region:
        self._check_open()
        region = self._regions.get(key)
        if region is None:
            known = ", ".join(sorted(self._regions)[:8]) + (", ..." if len(self._regions) > 8 else "")
            raise ValueError(
                f"NvmeSwapper: key={key!r} is not registered (registered: {known or 'none'}); call "
                "register() and reserve() for it first"
            )
        if reserved and key not in self._reserved:
            raise ValueError(f"NvmeSwapper: key={key!r} is registered but not reserved; call reserve() first")
        return region

    def _check_written(self, region: Region) -> None:
        if region.key not in self._written:
            raise ValueError(
                f"NvmeSwapper: key={region.key!r} has never been written, so there is nothing to read; write() it first"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NvmeSwapper for {self.directory} is closed; create a new one")

    def _check_failure(self) -> None:
        self._check_open()
        error = self._failure.error
        if error is None:
            return
        self._failure.raised = True
        raise RuntimeError(
            f"NvmeSwapper for {self.directory} stopped after an I/O error, its contents can no longer "
            f"be trusted: {error}"
        ) from error

    def _transfer_now(self, region: Region, data: torch.Tensor, write: bool) -> None:
        """A synchronous transfer; its failure is sticky too (a half-written region is garbage)."""
        try:
            self._region_io.transfer(region, data, write)
        except BaseException as e:
            self._failure.record(e)
            self._failure.raised = True
            raise

    def _wait(self, future: "Future[None]") -> None:
        wait_futures([future])
        self._check_failure()

    def _wait_last_op(self, key: str) -> None:
        future = self._last_op.pop(key, None)
        if future is not None:
            self._wait(future)

    def _discard_staged(self, key: str) -> None:
        """A write makes ``key``'s read-ahead stale; its buffer goes back once its read is done."""
        staged = self._staged.pop(key, None)
        if staged is not None:
            self._release_staged(staged)

    def _release_staged(self, staged: _Staged) -> None:
        if staged.owned:
            staging, target = self._staging, staged.target  # the callback must not hold the swapper
            staged.future.add_done_callback(lambda _: staging.put(target))

    def _submit(self, key: str, operation: Callable[[], None]) -> "Future[None]":
        previous = self._last_op.get(key)
        future = self._ops.submit(self._failure.run_op, previous, operation)
        self._last_op[key] = future
        return future


def _too_small_message(root: Path, needed: int, free: int, regions: int) -> str:
    return (
        f"NvmeSwapper: not enough free space in nvme_path={str(root)!r}: the swap files of {regions} "
        f"regions need {human_bytes(needed)} ({needed} bytes) but only {human_bytes(free)} ({free} bytes) "
        "are free. Free up space, set nvme_path to a larger disk, or offload less to NVMe "
        "(e.g. offload_optimizer_device='cpu')"
    )
