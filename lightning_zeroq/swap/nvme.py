"""NVMe swap space for offloaded optimizer state: named fixed-size regions in per-rank files.

The engine keeps one region per ZeRO unit and kind (fp32 master shard, each optimizer state such as
``exp_avg``/``exp_avg_sq``, the gradient shard) on a local disk and moves it to and from CPU
tensors it owns. :class:`NvmeSwapper` is that swap space; it knows nothing about ZeRO.

Files
    Each swapper creates its own private directory when it is constructed,
    ``<nvme_path>/<prefix>_rank<rank:05d>_<random>/`` (mode 0700, created exclusively with a fresh
    random name), so two runs on the same path and rank, or two swappers of one run, never share a
    file, and the one that exits first never deletes the other's. ``nvme_path`` itself may be a
    symlink (to a mount, say); nothing below it is ever followed: the directory is opened once with
    ``O_NOFOLLOW`` and kept open, every file in it is created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` and
    reopened with ``O_NOFOLLOW`` relative to that descriptor, so a symlink planted in it makes the
    operation fail (naming the file) instead of truncating or reading what it points to.
    The directory holds a lock file, ``.lock``, with the owner's pid and host, ``flock``-ed for the
    swapper's lifetime. A new swapper reports (one warning line each, never removes) directories of
    its prefix and rank whose lock is free and whose owner on this host is gone: leftovers of a run
    killed by SIGKILL, which only a person can know to be safe to delete. A swapper of rank 0 reports
    those of every prefix and rank, so one rank's log names every leftover of a killed job. A
    launcher that killed the ranks it started removes their directories
    (:func:`remove_directories_of`: the lock names the dead pid, so they are provably its own).

    Every region has its own file, ``<key>.swp``, so that a region is one contiguous extent that
    starts at offset 0. Its size is rounded up to ``alignment`` bytes (4096 by default), which is
    what ``O_DIRECT`` asks of offsets and lengths. :meth:`NvmeSwapper.reserve` checks the free space
    for every registered region at once (before writing anything: failing at step 1 beats failing
    after an hour) and preallocates the files with ``posix_fallocate``, so a later write cannot run
    out of space. A file is opened for each transfer and closed after it, so there is no
    file-position or descriptor state to share between threads, no descriptor limit to hit with
    thousands of regions, and a file removed behind our back is noticed at the next transfer
    instead of being read through a stale descriptor.

Direct I/O
    ``reserve()`` probes once whether the directory accepts ``O_DIRECT`` (open, write and read back
    one aligned block). If it does, every transfer bypasses the page cache, so the swap space costs
    no host memory beyond its buffers and runs at the disk's own bandwidth. If the probe fails with
    ``EINVAL``/``EOPNOTSUPP`` the swapper logs once, ``O_DIRECT not supported on <path> (<fs>),
    using buffered I/O``, and uses plain buffered ``pread``/``pwrite`` (no ``fsync``: the files are
    scratch space that is thrown away at exit, so durability buys nothing). ``direct_io=True``
    makes the probe's failure an error; ``direct_io=False`` skips the probe.

Buffers
    ``O_DIRECT`` also needs the memory address aligned. A transfer is cut into chunks of
    ``buffer_bytes``; a chunk whose memory is aligned (tensors from :func:`aligned_empty`, pinned
    host memory) goes straight between the caller's tensor and the file. Others, and the sub-block
    tail of every region, go through a bounce buffer from a pool of ``num_buffers`` aligned buffers
    (pinned when CUDA is available, so the engine's H2D copies from them are fast). In buffered
    mode every chunk goes straight from the caller's memory.

Threads
    Two small thread pools. The *I/O pool* (``num_threads`` threads) only runs ``pread``/``pwrite``
    of one chunk; it never waits on anything but the disk. The *op pool* runs whole asynchronous
    operations (:meth:`write_async`, :meth:`prefetch`), each of which keeps up to ``num_threads``
    chunks in flight on the I/O pool while it copies the next chunk into (or the last one out of) a
    bounce buffer; synchronous :meth:`write`/:meth:`read` do the same from the caller's thread.
    Because ops wait on I/O tasks and I/O tasks wait on nothing, neither pool can starve the
    other. Operations on one key run in the order they were issued (an op first waits for the
    previous op on its key); operations on different keys overlap, which is how the engine reads
    unit ``i+1`` ahead while unit ``i`` steps and unit ``i-1`` is written back. Background work and
    the handles it returns reference only the transfer machinery (:class:`_RegionIO`,
    :class:`_Failure`, the buffer pools), never the swapper, so they do not keep it alive.

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
    callback holds only :class:`_Resources`; pending operations are cancelled, running ones
    finish first), and at interpreter exit. A forked child's copy of a swapper never removes its
    parent's files.

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
    reported (see Files); a swapper created outside the main thread cannot install the handler
    (logged once per process).

Testing hook
    The free-space query is the module-level function :func:`free_bytes`, looked up at each
    ``reserve()``; tests monkeypatch ``lightning_zeroq.swap.nvme.free_bytes`` to exercise
    the "too small" error without filling a disk.

A swapper is meant to be driven from one thread (the engine's); only its own background threads
run concurrently with that thread.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import functools
import logging
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Iterable, NamedTuple, Optional, Union

import torch

__all__ = ["NvmeSwapper", "SwapHandle", "aligned_empty", "free_bytes"]

log = logging.getLogger(__name__)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
DEFAULT_BUFFER_BYTES = 32 * 1024 * 1024
_ASYNC_OP_THREADS = 2
_THREAD_PREFIX = "zeroq-nvme-"
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}")
_PROBE_NAME = ".zeroq_odirect_probe"
_LOCK_NAME = ".lock"
_UNSUPPORTED_DIRECT_ERRNOS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
_NO_LOCKS_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_SWAP_DIRECTORY = re.compile(r"^[A-Za-z0-9_.-]+_rank\d{5}_[0-9a-f]{8}$")
_warned_buffered: set[str] = set()
_reported_leftovers: set[str] = set()

PathLike = Union[str, "os.PathLike[str]"]


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


def filesystem_type(path: PathLike) -> str:
    """The filesystem type of the mount holding ``path`` (``'ext4'``, ``'tmpfs'``...), or ``'unknown'``."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fields[2]
    except OSError:
        pass
    return best_type


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def aligned_empty(
    numel: int, dtype: torch.dtype, alignment: int = 4096, pin_memory: Optional[bool] = None
) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor whose data starts at an ``alignment``-byte boundary.

    Tensors from here (or pinned host memory) let ``O_DIRECT`` transfers skip the bounce buffers.
    ``pin_memory=None`` pins when CUDA is available.
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel={numel} must be >= 0")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin_memory)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset : offset + nbytes].view(dtype)


def _memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor's memory (the caller keeps ``t`` alive)."""
    n = t.numel()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 tensor (``t`` contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# Low-level transfers of one chunk (run on the I/O pool)
# ----------------------------------------------------------------------------------------------


def _pwrite_all(fd: int, mem: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(mem):
        try:
            n = os.pwrite(fd, mem[done:], offset + done)
        except OSError as e:
            raise RuntimeError(
                f"I/O error writing swap file {path} at offset {offset + done} "
                f"({len(mem) - done} bytes): {e}"
            ) from e
        if n <= 0:
            raise RuntimeError(
                f"short write to swap file {path}: offset {offset}, expected {len(mem)} bytes, "
                f"wrote {done}; is the disk full or failing?"
            )
        done += n


def _pread_all(fd: int, mem: memoryview, offset: int, path: Path, direct: bool) -> None:
    done = 0
    while done < len(mem):
        try:
            n = os.preadv(fd, [mem[done:]], offset + done)
        except OSError as e:
            raise RuntimeError(
                f"I/O error reading swap file {path} at offset {offset + done} "
                f"({len(mem) - done} bytes): {e}"
            ) from e
        done += n
        # A short O_DIRECT read only happens at end of file, and retrying at an unaligned offset
        # would fail with EINVAL anyway; a buffered read returns 0 at end of file.
        if n == 0 or (direct and done < len(mem)):
            raise RuntimeError(
                f"short read from swap file {path}: offset {offset}, expected {len(mem)} bytes, "
                f"got {done}; the file was truncated or replaced after it was written, so its "
                "contents are lost (check that nothing else cleans up or writes to nvme_path)"
            )



# ----------------------------------------------------------------------------------------------
# Buffers
# ----------------------------------------------------------------------------------------------


class _BouncePool:
    """Up to ``count`` aligned buffers of ``nbytes`` each, allocated on first use."""

    def __init__(self, count: int, nbytes: int, alignment: int, pin: bool) -> None:
        self._count, self._nbytes, self._alignment, self._pin = count, nbytes, alignment, pin
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._cond = threading.Condition()

    def try_acquire(self) -> Optional[torch.Tensor]:
        with self._cond:
            return self._take_locked()

    def acquire(self) -> torch.Tensor:
        with self._cond:
            while True:
                buf = self._take_locked()
                if buf is not None:
                    return buf
                self._cond.wait()

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def _take_locked(self) -> Optional[torch.Tensor]:
        if self._free:
            return self._free.pop()
        if self._allocated < self._count:
            self._allocated += 1
            return aligned_empty(self._nbytes, torch.uint8, self._alignment, self._pin)
        return None


class _StagingCache:
    """Aligned whole-region read-ahead buffers, reused by size; keeps at most ``keep`` idle ones."""

    def __init__(self, keep: int, alignment: int, pin: bool) -> None:
        self._keep, self._alignment, self._pin = keep, alignment, pin
        self._idle: collections.OrderedDict[int, list[torch.Tensor]] = collections.OrderedDict()
        self._idle_count = 0
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            bucket = self._idle.get(nbytes)
            if bucket:
                self._idle_count -= 1
                return bucket.pop()
        return aligned_empty(nbytes, torch.uint8, self._alignment, self._pin)

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._idle.setdefault(buf.numel(), []).append(buf)
            self._idle.move_to_end(buf.numel())
            self._idle_count += 1
            while self._idle_count > self._keep:
                size, bucket = next(iter(self._idle.items()))
                bucket.pop(0)
                self._idle_count -= 1
                if not bucket:
                    del self._idle[size]


# ----------------------------------------------------------------------------------------------
# Bookkeeping
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Region:
    key: str
    numel: int
    dtype: torch.dtype
    nbytes: int
    file_bytes: int
    name: str  # the file's name in the swapper's directory (opened relative to its descriptor)
    path: Path  # the same file, for messages


class _Chunk(NamedTuple):
    offset: int  # bytes from the start of the region (and of the caller's tensor)
    length: int


class _InFlight(NamedTuple):
    future: "Future[None]"
    memory: torch.Tensor  # the caller's bytes for this chunk
    bounce: Optional[torch.Tensor]  # bounce buffer the I/O went through, if any


@dataclass
class _Staged:
    """A read-ahead in progress or done: ``future`` fills ``target`` (a staging buffer or ``out``)."""

    future: "Future[None]"
    target: torch.Tensor
    owned: bool  # target is a staging buffer to give back after use


class _Failure:
    """The first error of any transfer (sticky), and whether the caller has been told about it.

    Shared by the swapper, its background operations and its handles, so that none of those needs
    a reference to the swapper.
    """

    def __init__(self) -> None:
        self.error: Optional[RuntimeError] = None
        self.raised = False
        self._lock = threading.Lock()

    def record(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error if isinstance(error, RuntimeError) else RuntimeError(str(error))

    def mark_raised(self) -> None:
        self.raised = True

    def run_op(self, previous: Optional["Future[None]"], operation: Callable[[], None]) -> None:
        """One asynchronous operation on the op pool, after the previous one on its key."""
        if previous is not None:
            wait_futures([previous])  # FIFO pool: ``previous`` started first, so this cannot deadlock
        if self.error is not None:
            raise RuntimeError(f"skipped after an earlier I/O error: {self.error}")
        try:
            operation()
        except BaseException as e:
            self.record(e)
            raise


class SwapHandle:
    """An asynchronous write or read-ahead; :meth:`wait` re-raises its error."""

    def __init__(self, key: str, future: "Future[None]", on_error: Callable[[], None]) -> None:
        self.key = key
        self._future = future
        self._on_error = on_error

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        try:
            self._future.result()
        except BaseException:
            self._on_error()
            raise


class _RegionIO:
    """Moves bytes between memory and a region's file, keeping ``num_threads`` chunks in flight.

    Background operations run :meth:`transfer`, so it holds what a transfer needs and nothing that
    references the swapper. ``direct`` is decided by the swapper's first ``reserve()``.
    """

    def __init__(
        self, dir_fd: int, io: ThreadPoolExecutor, bounce: _BouncePool, alignment: int, buffer_bytes: int,
        num_threads: int,
    ) -> None:
        self.dir_fd, self.io, self.bounce = dir_fd, io, bounce
        self.alignment, self.buffer_bytes, self.num_threads = alignment, buffer_bytes, num_threads
        self.direct = False

    def transfer(self, region: _Region, data: torch.Tensor, write: bool) -> None:
        """Move ``data`` (the caller's bytes, at most the file size) to or from ``region``'s file.

        Keeps up to ``num_threads`` chunks in flight on the I/O pool; bounce copies of one chunk
        overlap the I/O of the others.
        """
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(region.name, flags, dir_fd=self.dir_fd)
        except FileNotFoundError as e:
            raise RuntimeError(
                f"swap file {region.path} of key {region.key!r} is missing (removed after reserve()?); "
                "its contents are lost. Check that nothing cleans up nvme_path during training"
            ) from e
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RuntimeError(
                    f"swap file {region.path} of key {region.key!r} was replaced by a symlink; it is not "
                    "followed and the region's contents are lost. Check what else writes to nvme_path"
                ) from e
            raise RuntimeError(f"cannot open swap file {region.path}: {e}") from e
        in_flight: collections.deque[_InFlight] = collections.deque()
        try:
            for chunk in self._chunks(data.numel()):
                memory = data[chunk.offset : chunk.offset + chunk.length]
                bounce = self._acquire_bounce(in_flight, write) if self._needs_bounce(memory) else None
                in_flight.append(self._start_chunk(fd, region, chunk, memory, bounce, write))
                while len(in_flight) > self.num_threads:
                    self._finish_chunk(in_flight.popleft(), write)
            while in_flight:
                self._finish_chunk(in_flight.popleft(), write)
        finally:
            self._abandon(in_flight)
            os.close(fd)

    def _chunks(self, nbytes: int) -> Iterator[_Chunk]:
        body = nbytes - nbytes % self.alignment
        for offset in range(0, body, self.buffer_bytes):
            yield _Chunk(offset, min(self.buffer_bytes, body - offset))
        if body < nbytes:
            yield _Chunk(body, nbytes - body)

    def _needs_bounce(self, memory: torch.Tensor) -> bool:
        if not self.direct:
            return False
        return memory.data_ptr() % self.alignment != 0 or memory.numel() % self.alignment != 0

    def _start_chunk(
        self,
        fd: int,
        region: _Region,
        chunk: _Chunk,
        memory: torch.Tensor,
        bounce: Optional[torch.Tensor],
        write: bool,
    ) -> _InFlight:
        if bounce is None:
            io_memory = memory
        else:
            io_memory = bounce[: _align_up(chunk.length, self.alignment)]
            if write:
                bounce[: chunk.length].copy_(memory)
                io_memory[chunk.length :].zero_()
        view = _memoryview(io_memory)
        if write:
            future = self.io.submit(_pwrite_all, fd, view, chunk.offset, region.path)
        else:
            future = self.io.submit(_pread_all, fd, view, chunk.offset, region.path, self.direct)
        return _InFlight(future, memory, bounce)

    def _finish_chunk(self, chunk: _InFlight, write: bool) -> None:
        try:
            chunk.future.result()
            if not write and chunk.bounce is not None:
                chunk.memory.copy_(chunk.bounce[: chunk.memory.numel()])
        finally:
            if chunk.bounce is not None:
                self.bounce.release(chunk.bounce)

    def _acquire_bounce(self, in_flight: "collections.deque[_InFlight]", write: bool) -> torch.Tensor:
        """A bounce buffer; finishes this transfer's oldest chunks rather than wait holding buffers."""
        while True:
            buf = self.bounce.try_acquire()
            if buf is not None:
                return buf
            if not in_flight:
                return self.bounce.acquire()  # holding none, so other transfers will free one
            self._finish_chunk(in_flight.popleft(), write)

    def _abandon(self, in_flight: "collections.deque[_InFlight]") -> None:
        """After a failed chunk: let the others finish (they use the descriptor) and free buffers."""
        if not in_flight:
            return
        wait_futures([c.future for c in in_flight])
        for chunk in in_flight:
            if chunk.bounce is not None:
                self.bounce.release(chunk.bounce)
        in_flight.clear()


# ----------------------------------------------------------------------------------------------
# The private directory, its cleanup, and the signal handlers that trigger it
# ----------------------------------------------------------------------------------------------


@dataclass
class _Resources:
    """What cleanup needs. Held by a ``weakref.finalize`` and by the live registry that the signal
    handlers walk, so it must not reference the swapper."""

    root: Path
    name: str  # the private directory's name in ``root``
    root_fd: int
    dir_fd: int
    lock_fd: Optional[int] = None
    owner_pid: int = field(default_factory=os.getpid)
    files: set[str] = field(default_factory=set)  # names of the swap files this swapper created
    executors: list[ThreadPoolExecutor] = field(default_factory=list)
    removed: bool = False
    released: bool = False

    @property
    def directory(self) -> Path:
        return self.root / self.name

    def cleanup(self) -> None:
        """Stop the threads, remove the files and the directory, close the descriptors; runs once.

        Best effort: reports problems in the log and never raises.
        """
        if self.released:
            return
        self.released = True
        _forget_live(self)
        if os.getpid() != self.owner_pid:
            return  # a forked child's copy: the directory and everything in it are the parent's
        # The last reference can die on one of our own threads, which must not join itself; then
        # a transfer may still be running and use dir_fd, so the descriptors stay open (closing
        # them could let a new file take the number and a late transfer write into it).
        on_own_thread = threading.current_thread().name.startswith(_THREAD_PREFIX)
        for executor in self.executors:
            executor.shutdown(wait=not on_own_thread, cancel_futures=True)
        self.remove_files()
        if on_own_thread:
            return
        for fd in (self.dir_fd, self.root_fd, self.lock_fd):  # the lock is released last
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def remove_files(self) -> None:
        """Unlink the swap files, the lock and the directory; runs once.

        Safe in a signal handler: takes no lock and joins no thread. Only names this swapper
        created are removed; anything else found in the directory is left, with a warning.
        """
        if self.removed or os.getpid() != self.owner_pid:
            return
        self.removed = True
        for name in [*sorted(self.files), *([_LOCK_NAME] if self.lock_fd is not None else [])]:
            try:
                os.unlink(name, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not remove swap file %s: %s", self.directory / name, e)
        self.files.clear()
        try:
            # Remove the directory by name only if that name still is our directory.
            here = os.stat(self.name, dir_fd=self.root_fd, follow_symlinks=False)
            ours = os.fstat(self.dir_fd)
            if (here.st_dev, here.st_ino) != (ours.st_dev, ours.st_ino):
                log.warning("swap directory %s was moved or replaced while in use; left it alone", self.directory)
                return
            os.rmdir(self.name, dir_fd=self.root_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove swap directory %s: %s", self.directory, e)


def _directory_stem(prefix: str, rank: int) -> str:
    return f"{prefix}_rank{rank:05d}_"


def _create_private_directory(root: Path, prefix: str, rank: int) -> _Resources:
    """Create ``<root>/<prefix>_rank<rank:05d>_<random>`` (0700, exclusively) and lock it."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise RuntimeError(
            f"NvmeSwapper: cannot open nvme_path={str(root)!r} ({e}); set nvme_path to a directory "
            "this process can read and write"
        ) from e
    stem = _directory_stem(prefix, rank)
    made = False
    try:
        for _ in range(100):
            name = stem + secrets.token_hex(4)
            try:
                os.mkdir(name, 0o700, dir_fd=root_fd)  # fails if anything, a symlink too, has the name
                made = True
                break
            except FileExistsError:
                continue
        else:
            raise RuntimeError(
                f"NvmeSwapper: found no unused name {stem}<random> in nvme_path={str(root)!r} after 100 "
                "tries; remove old swap directories from it"
            )
        dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        owner = os.fstat(dir_fd).st_uid
        if owner != os.geteuid():
            os.close(dir_fd)
            raise RuntimeError(
                f"NvmeSwapper: {root / name} was replaced by a directory of uid {owner} right after this "
                "process created it; set nvme_path to a directory that only you can write to"
            )
        os.fchmod(dir_fd, 0o700)  # whatever the umask took away
    except OSError as e:
        if made:  # made, but not usable: take the empty directory back (fails harmlessly otherwise)
            try:
                os.rmdir(name, dir_fd=root_fd)
            except OSError:
                pass
        os.close(root_fd)
        raise RuntimeError(
            f"NvmeSwapper: cannot create a swap directory in nvme_path={str(root)!r} ({e}); make "
            "nvme_path writable or set it to a writable directory"
        ) from e
    except BaseException:
        os.close(root_fd)
        raise
    resources = _Resources(root, name, root_fd, dir_fd)
    try:
        resources.lock_fd = _lock_directory(resources)
    except BaseException:
        resources.cleanup()
        raise
    return resources


_warned_no_locks = False


def _lock_directory(resources: _Resources) -> int:
    """Create ``.lock`` holding ``<pid> <host>`` and ``flock`` it for the swapper's lifetime.

    The lock is what tells a live swapper's directory from a crashed run's (see
    :func:`_report_leftovers`). A filesystem without ``flock`` gets a warning, not an error.
    """
    global _warned_no_locks
    path = resources.directory / _LOCK_NAME
    try:
        fd = os.open(_LOCK_NAME, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600, dir_fd=resources.dir_fd)
    except OSError as e:
        raise RuntimeError(f"NvmeSwapper: cannot create the lock file {path} ({e}); make nvme_path writable") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while another process is checking it
    except OSError as e:
        if e.errno not in _NO_LOCKS_ERRNOS:
            os.close(fd)
            raise RuntimeError(f"NvmeSwapper: cannot lock {path}: {e}") from e
        if not _warned_no_locks:
            _warned_no_locks = True
            log.warning("cannot flock %s (%s): swap directories of live runs cannot be told from leftovers", path, e)
    try:
        os.write(fd, f"{os.getpid()} {os.uname().nodename}\n".encode())
    except OSError as e:
        os.close(fd)
        raise RuntimeError(f"NvmeSwapper: cannot write the lock file {path} ({e}); is the disk full?") from e
    return fd


def _report_leftovers(resources: _Resources, stem: str, everyone: bool = False) -> None:
    """Warn once about each directory ``<stem>*`` (``everyone``: each swap directory of any prefix and
    rank, so that rank 0 names every leftover of a killed job) that a dead process on this host left
    behind."""
    try:
        names = sorted(n for n in os.listdir(resources.root_fd) if n != resources.name and (
            n.startswith(stem) or everyone and _SWAP_DIRECTORY.match(n)))
    except OSError:
        return
    for name in names:
        path = resources.root / name
        if str(path) in _reported_leftovers:
            continue
        pid = _dead_owner(resources.root_fd, name)
        if pid is not None:
            _reported_leftovers.add(str(path))
            log.warning(
                "NvmeSwapper: %s was left behind by pid %d on this host, which is gone (killed?); it is not "
                "removed automatically: delete it once you are sure no job uses it", path, pid
            )


def remove_directories_of(root: PathLike, pids: Iterable[int]) -> list[Path]:
    """Remove the swap directories in ``root`` that processes ``pids`` made and left behind: a launcher
    calls it for the ranks it started once they are dead (killed: nothing else cleans up after them).
    Only a directory of this user whose lock is free and names one of ``pids`` on this host, which no
    longer runs, is removed, with the files a swapper makes in it (``*.swp``, the probe, the lock);
    returns what was removed."""
    wanted = {int(p) for p in pids}
    removed: list[Path] = []
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return removed
    try:
        for name in sorted(os.listdir(root_fd)):
            if not _SWAP_DIRECTORY.match(name) or _dead_owner(root_fd, name) not in wanted:
                continue
            try:
                dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
            except OSError:
                continue
            try:
                for entry in os.listdir(dir_fd):
                    if entry.endswith(".swp") or entry in (_LOCK_NAME, _PROBE_NAME):
                        try:
                            os.unlink(entry, dir_fd=dir_fd)
                        except OSError:
                            pass
            finally:
                os.close(dir_fd)
            try:
                os.rmdir(name, dir_fd=root_fd)
                removed.append(Path(root) / name)
            except OSError as e:
                log.warning("could not remove swap directory %s of a dead rank: %s", Path(root) / name, e)
    finally:
        os.close(root_fd)
    return removed


def remove_live_files() -> None:
    """Remove the files and directories of every live swapper of this process, now (before the
    process is ended in a way that runs no cleanup: ``os._exit``, SIGKILL). Safe from any thread."""
    for resources in list(_live.values()):
        try:
            resources.remove_files()
        except Exception:
            pass


def _dead_owner(root_fd: int, name: str) -> Optional[int]:
    """The pid that created the swap directory ``name`` if it provably left it behind: a directory
    of this user (not a symlink) whose lock is free and whose pid no longer runs on this host.
    ``None`` at any doubt."""
    dir_fd = lock_fd = -1
    try:
        dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        if os.fstat(dir_fd).st_uid != os.geteuid():
            return None
        lock_fd = os.open(_LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its swapper is alive
        fields = os.read(lock_fd, 256).decode("utf-8", "replace").split()
        if len(fields) != 2 or not fields[0].isdigit() or fields[1] != os.uname().nodename:
            return None
        pid = int(fields[0])
        if pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        return None  # alive (or not ours to signal): maybe the pid was reused, maybe not
    except OSError:
        return None
    finally:
        for fd in (lock_fd, dir_fd):
            if fd >= 0:
                os.close(fd)


# Resources of every swapper that has not been cleaned up yet, for the signal handlers. Plain dict
# operations (atomic under the GIL), no lock: a handler or a finalizer can run at any bytecode.
_live: dict[int, _Resources] = {}
_signal_handlers: dict[int, "_CleanupHandler"] = {}
_dying = False
_warned_not_main_thread = False


class _CleanupHandler:
    """Replaces the default action of SIGTERM/SIGINT: remove every live swapper's files, then die by
    the signal (see "Signals")."""

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        if signal.getsignal(signum) is not self:
            # A handler installed after us calls us as one of several (Lightning's SIGTERM handler
            # does, then stops the trainer gracefully): the default action we stand in for is not
            # going to happen, so neither remove the files nor die.
            return
        global _dying
        if _dying:
            # The same signal again while we clean up (sent to the whole process group and forwarded by
            # a parent, such as ``timeout`` or Lightning's launcher): Python runs handlers between any
            # two bytecodes, this one too, so without this a second call would die half-way through
            # the first one's removal and leave the rest behind.
            return
        _dying = True
        for resources in list(_live.values()):
            resources.remove_files()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _track_live(resources: _Resources) -> None:
    global _warned_not_main_thread
    _live[id(resources)] = resources
    if threading.current_thread() is threading.main_thread():
        for signum in _CLEANUP_SIGNALS:
            current = signal.getsignal(signum)
            if isinstance(current, _CleanupHandler):
                _signal_handlers[signum] = current  # ours already (put back by someone), reused
            elif current == signal.SIG_DFL:
                handler = _CleanupHandler()
                signal.signal(signum, handler)
                _signal_handlers[signum] = handler
        return
    if any(signal.getsignal(s) == signal.SIG_DFL for s in _CLEANUP_SIGNALS) and not _warned_not_main_thread:
        _warned_not_main_thread = True
        log.warning(
            "NvmeSwapper created outside the main thread cannot install its SIGTERM handler, so a SIGTERM "
            "would leave %s behind (close() and a normal exit still remove it); create the first swapper "
            "from the main thread", resources.directory
        )


def _forget_live(resources: _Resources) -> None:
    """Drop ``resources`` from the registry; the last one out puts the default actions back."""
    _live.pop(id(resources), None)
    if _live or threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in list(_signal_handlers.items()):
        try:
            if signal.getsignal(signum) is handler:
                signal.signal(signum, signal.SIG_DFL)
        except (ValueError, TypeError, OSError):
            pass
        _signal_handlers.pop(signum, None)


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
        _check_arguments(rank, num_buffers, alignment, buffer_bytes, num_threads, prefix)
        self.root = _check_directory(Path(nvme_path))
        self._resources = _create_private_directory(self.root, prefix, rank)
        self._finalizer = weakref.finalize(self, self._resources.cleanup)
        self.directory = self._resources.directory
        self.rank = rank
        self.alignment = alignment
        self.buffer_bytes = buffer_bytes
        self.num_threads = num_threads
        self.direct_io: Optional[bool] = None  # decided by the first reserve()
        self._requested_direct = direct_io
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._bounce = _BouncePool(num_buffers, buffer_bytes, alignment, pin)
        self._staging = _StagingCache(num_buffers, alignment, pin)
        self._regions: dict[str, _Region] = {}
        self._reserved: set[str] = set()
        self._written: set[str] = set()
        self._last_op: dict[str, Future[None]] = {}
        self._staged: dict[str, _Staged] = {}
        self._failure = _Failure()
        self._closed = False
        io = ThreadPoolExecutor(num_threads, thread_name_prefix=f"{_THREAD_PREFIX}io-r{rank}")
        self._ops = ThreadPoolExecutor(_ASYNC_OP_THREADS, thread_name_prefix=f"{_THREAD_PREFIX}op-r{rank}")
        self._resources.executors += [self._ops, io]
        self._region_io = _RegionIO(self._resources.dir_fd, io, self._bounce, alignment, buffer_bytes, num_threads)
        _track_live(self._resources)
        _report_leftovers(self._resources, _directory_stem(prefix, rank), everyone=rank == 0)

    # -- declaration and reservation ------------------------------------------------------------

    def register(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Declare a region of ``numel`` elements of ``dtype``; takes effect at the next :meth:`reserve`."""
        self._check_open()
        if not isinstance(key, str) or not _KEY_PATTERN.fullmatch(key):
            raise ValueError(
                f"NvmeSwapper.register: key={key!r} must be 1-200 characters from [A-Za-z0-9_.-] not "
                "starting with '.', since it names a file"
            )
        if key in self._regions:
            raise ValueError(f"NvmeSwapper.register: key={key!r} is already registered")
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"NvmeSwapper.register({key!r}): numel={numel!r} must be an int >= 0")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"NvmeSwapper.register({key!r}): dtype={dtype} is not supported; use one of "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            )
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        name = f"{key}.swp"
        self._regions[key] = _Region(
            key, numel, dtype, nbytes, _align_up(nbytes, self.alignment), name, self.directory / name
        )

    def reserve(self) -> None:
        """Check free space for every registered, not yet reserved region, then create the files.

        The first call also decides between ``O_DIRECT`` and buffered I/O.
        """
        self._check_open()
        pending = [r for key, r in self._regions.items() if key not in self._reserved]
        if self.direct_io is None:
            self.direct_io = self._decide_direct_io()
            self._region_io.direct = self.direct_io
        needed = sum(r.file_bytes for r in pending)
        free = free_bytes(str(self.directory))
        if needed > free:
            raise RuntimeError(_too_small_message(self.root, needed, free, len(pending)))
        for region in pending:
            self._create_file(region, needed, free, len(pending))
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
        _check_tensor(region, tensor, "write")
        self._discard_staged(key)
        self._wait_last_op(key)
        self._written.add(key)
        self._transfer_now(region, _byte_view(tensor), write=True)

    def write_async(self, key: str, tensor: torch.Tensor) -> SwapHandle:
        """Start writing ``tensor`` to ``key``; do not modify ``tensor`` before the handle's ``wait()``."""
        self._check_failure()
        region = self._region(key)
        _check_tensor(region, tensor, "write_async")
        self._discard_staged(key)
        future = self._submit(key, functools.partial(self._region_io.transfer, region, _byte_view(tensor), True))
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
            _check_tensor(region, out, "prefetch")
            target, owned = _byte_view(out), False
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
        _check_tensor(region, out, "read")
        self._check_written(region)
        staged = self._staged.pop(key, None)
        if staged is None:
            self._wait_last_op(key)
            self._transfer_now(region, _byte_view(out), write=False)
            return
        try:
            self._wait(staged.future)
            destination = _byte_view(out)
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

    def _decide_direct_io(self) -> bool:
        requested = self._requested_direct
        if requested is False:
            return False
        files = self._resources.files
        files.add(_PROBE_NAME)  # so that a signal during the probe removes it too
        try:
            works = _direct_io_works(self._resources.dir_fd, self.directory, self.alignment)
        finally:
            files.discard(_PROBE_NAME)
        if works:
            return True
        fs = filesystem_type(self.directory)
        if requested:
            raise RuntimeError(
                f"NvmeSwapper: O_DIRECT not supported on {self.root} ({fs}); put nvme_path on a "
                "filesystem that supports it (ext4, xfs) or pass direct_io=None to fall back to "
                "buffered I/O"
            )
        if str(self.root) not in _warned_buffered:
            _warned_buffered.add(str(self.root))
            log.warning("O_DIRECT not supported on %s (%s), using buffered I/O", self.root, fs)
        return False

    def _create_file(self, region: _Region, needed: int, free: int, regions: int) -> None:
        files = self._resources.files
        # Exclusive creation: a name taken by anything (a planted symlink included) is an error and
        # stays untouched. A file of ours from an earlier, failed reserve() is reused.
        flags = os.O_RDWR | os.O_NOFOLLOW | (0 if region.name in files else os.O_CREAT | os.O_EXCL)
        try:
            fd = os.open(region.name, flags, 0o600, dir_fd=self._resources.dir_fd)
        except FileExistsError as e:
            raise RuntimeError(
                f"NvmeSwapper: cannot create swap file {region.path}: something this swapper did not "
                "create is already there (left untouched); check what else writes to nvme_path"
            ) from e
        except OSError as e:
            raise RuntimeError(
                f"NvmeSwapper: cannot create swap file {region.path} ({e}); make nvme_path writable "
                "or set it to a writable directory"
            ) from e
        files.add(region.name)
        try:
            if region.file_bytes:
                _preallocate(fd, region.file_bytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise RuntimeError(_too_small_message(self.root, needed, free, regions)) from e
            raise RuntimeError(f"NvmeSwapper: cannot preallocate swap file {region.path}: {e}") from e
        finally:
            os.close(fd)

    # -- internals: bookkeeping -------------------------------------------------------------------

    def _region(self, key: str, reserved: bool = True) -> _Region:
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

    def _check_written(self, region: _Region) -> None:
        if region.key not in self._written:
            raise ValueError(
                f"NvmeSwapper: key={region.key!r} has never been written, so there is nothing to read; "
                "write() it first"
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

    def _transfer_now(self, region: _Region, data: torch.Tensor, write: bool) -> None:
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


# ----------------------------------------------------------------------------------------------
# Checks and helpers
# ----------------------------------------------------------------------------------------------


def _check_arguments(
    rank: int, num_buffers: int, alignment: int, buffer_bytes: int, num_threads: int, prefix: str
) -> None:
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"NvmeSwapper: rank={rank!r} must be an int >= 0")
    if not isinstance(num_buffers, int) or num_buffers < 1:
        raise ValueError(f"NvmeSwapper: num_buffers={num_buffers!r} must be an int >= 1 (4 is typical)")
    if not isinstance(alignment, int) or alignment < 512 or alignment & (alignment - 1):
        raise ValueError(f"NvmeSwapper: alignment={alignment!r} must be a power of two >= 512 (4096 is typical)")
    if not isinstance(buffer_bytes, int) or buffer_bytes <= 0 or buffer_bytes % alignment:
        raise ValueError(
            f"NvmeSwapper: buffer_bytes={buffer_bytes!r} must be a positive multiple of alignment={alignment} "
            f"(e.g. {DEFAULT_BUFFER_BYTES})"
        )
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"NvmeSwapper: num_threads={num_threads!r} must be an int >= 1 (2 is typical)")
    if not _KEY_PATTERN.fullmatch(prefix):
        raise ValueError(f"NvmeSwapper: prefix={prefix!r} must be characters from [A-Za-z0-9_.-]")


def directory_problem(root: Path) -> Optional[str]:
    """Why ``root`` cannot hold swap files, as the end of a sentence naming it; None if it can.

    A write probe rather than permission bits: a read-only mount refuses root too, and root passes
    every permission check."""
    if not root.exists():
        return "does not exist; create it or set nvme_path to an existing directory on a fast local disk"
    if not root.is_dir():
        return "is not a directory; set nvme_path to a directory on a fast local disk"
    try:
        fd, probe = tempfile.mkstemp(prefix=".zeroq-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return (f"is not writable by this process ({err.strerror}); fix its permissions or set nvme_path to a "
                "writable directory")
    return None


def _check_directory(root: Path) -> Path:
    problem = directory_problem(root)
    if problem is not None:
        raise RuntimeError(f"NvmeSwapper: nvme_path={str(root)!r} {problem}")
    return root


def _check_tensor(region: _Region, tensor: torch.Tensor, op: str) -> None:
    where = f"NvmeSwapper.{op}({region.key!r})"
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.numel() != region.numel or tensor.dtype != region.dtype:
        raise ValueError(
            f"{where}: tensor has numel={tensor.numel()} dtype={tensor.dtype}, but the region was "
            f"registered with numel={region.numel} dtype={region.dtype}"
        )
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: tensor is on {tensor.device}; swap from a CPU (ideally pinned) tensor")
    if not tensor.is_contiguous():
        raise ValueError(f"{where}: tensor must be contiguous; pass tensor.contiguous() or a flat buffer")


def _preallocate(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # no fallocate on this filesystem: a sparse file, space checked above


def _direct_io_works(dir_fd: int, directory: Path, alignment: int) -> bool:
    """Whether the directory open as ``dir_fd`` accepts an ``O_DIRECT`` write and read of one aligned block."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return False
    block = aligned_empty(alignment, torch.uint8, alignment, pin_memory=False)
    block.fill_(0x5A)
    ours = True  # an open that fails after O_EXCL created the file (tmpfs and O_DIRECT) leaves ours
    try:
        fd = os.open(_PROBE_NAME, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | o_direct, 0o600, dir_fd=dir_fd)
        try:
            os.pwrite(fd, _memoryview(block), 0)
            block.zero_()
            got = os.preadv(fd, [_memoryview(block)], 0)
        finally:
            os.close(fd)
        return got == alignment and bool((block == 0x5A).all())
    except FileExistsError as e:
        ours = False
        raise RuntimeError(
            f"NvmeSwapper: cannot create the probe file {directory / _PROBE_NAME}: something this swapper did "
            "not create is already there (left untouched); check what else writes to nvme_path"
        ) from e
    except OSError as e:
        if e.errno in _UNSUPPORTED_DIRECT_ERRNOS:
            return False
        raise RuntimeError(f"NvmeSwapper: cannot write a probe file in {directory}: {e}") from e
    finally:
        if ours:
            try:
                os.unlink(_PROBE_NAME, dir_fd=dir_fd)
            except FileNotFoundError:
                pass


def _too_small_message(root: Path, needed: int, free: int, regions: int) -> str:
    return (
        f"NvmeSwapper: not enough free space in nvme_path={str(root)!r}: the swap files of {regions} "
        f"regions need {human_bytes(needed)} ({needed} bytes) but only {human_bytes(free)} ({free} bytes) "
        "are free. Free up space, set nvme_path to a larger disk, or offload less to NVMe "
        "(e.g. offload_optimizer_device='cpu')"
    )
