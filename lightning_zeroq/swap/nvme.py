"""NVMe swap space for offloaded optimizer state: named fixed-size regions in per-rank files.

The engine keeps one region per ZeRO unit and kind (fp32 master shard, each optimizer state such as
``exp_avg``/``exp_avg_sq``, the gradient shard) on a local disk and moves it to and from CPU
tensors it owns. :class:`NvmeSwapper` is that swap space; it knows nothing about ZeRO.

Files
    Every region has its own file, ``<nvme_path>/<prefix>_rank<rank:05d>/<key>.swp``, so that a
    region is one contiguous extent that starts at offset 0. Its size is rounded up to
    ``alignment`` bytes (4096 by default), which is what ``O_DIRECT`` asks of offsets and lengths.
    :meth:`NvmeSwapper.reserve` checks the free space for every registered region at once (before
    writing anything: failing at step 1 beats failing after an hour) and preallocates the files
    with ``posix_fallocate``, so a later write cannot run out of space. A file is opened for each
    transfer and closed after it, so there is no file-position or descriptor state to share between
    threads, no descriptor limit to hit with thousands of regions, and a file removed behind our
    back is noticed at the next transfer instead of being read through a stale descriptor.

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
    unit ``i+1`` ahead while unit ``i`` steps and unit ``i-1`` is written back.

Read-ahead
    :meth:`prefetch` reads a region into an aligned staging buffer of the region's (aligned) size;
    staging buffers are reused by size, at most ``num_buffers`` idle ones are kept. :meth:`read`
    then waits for it and copies into the caller's tensor. ``prefetch(key, out=t)`` reads straight
    into ``t`` instead (no staging buffer, no copy); ``t`` must then be left alone until
    ``read(key, t)``.

Error policy
    Bad arguments (unknown key, wrong numel/dtype/device, bad sizes) raise ``ValueError`` at once.
    A bad environment (missing, non-directory or read-only path, too little free space, no
    ``O_DIRECT`` when it was required) raises ``RuntimeError`` naming the path and the fix. A short
    read, a file that shrank or vanished after it was written, or an OS error in a transfer raises
    ``RuntimeError`` naming the file, the offset and the byte counts; data is never returned
    partially. An error in a background transfer is recorded and raised by the next
    ``read``/``write``/``write_async``/``prefetch``/``wait_all`` (and by the handle's ``wait``),
    and from then on by every call: after a failed transfer the contents of the swap space are no
    longer trustworthy, and training must not continue on them.

Lifetime
    :meth:`close` waits for outstanding transfers, then removes the files and the per-rank
    directory if this swapper created it. It is idempotent, and also runs (best effort, never
    raising) when the swapper is garbage collected or the interpreter exits.

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
import logging
import os
import re
import shutil
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional, Union

import torch

__all__ = ["NvmeSwapper", "SwapHandle", "aligned_empty", "free_bytes"]

log = logging.getLogger(__name__)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BUFFER_BYTES = 32 * 1024 * 1024
_ASYNC_OP_THREADS = 2
_THREAD_PREFIX = "zeroq-nvme-"
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}")
_PROBE_NAME = ".zeroq_odirect_probe"
_UNSUPPORTED_DIRECT_ERRNOS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
_warned_buffered: set[str] = set()

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
    path: Path


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


@dataclass
class _Resources:
    """What cleanup needs; held by a ``weakref.finalize`` so it must not reference the swapper."""

    directory: Path
    created_directory: bool = False
    files: set[Path] = field(default_factory=set)
    executors: list[ThreadPoolExecutor] = field(default_factory=list)

    def cleanup(self) -> None:
        # The last reference can die on one of our own threads, which must not join itself.
        on_own_thread = threading.current_thread().name.startswith(_THREAD_PREFIX)
        for executor in self.executors:
            executor.shutdown(wait=not on_own_thread, cancel_futures=True)
        for path in sorted(self.files):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not remove swap file %s: %s", path, e)
        self.files.clear()
        if self.created_directory:
            try:
                self.directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:  # not empty: someone else's files live there too
                log.warning("could not remove swap directory %s: %s", self.directory, e)
            self.created_directory = False


# ----------------------------------------------------------------------------------------------
# The swapper
# ----------------------------------------------------------------------------------------------


class NvmeSwapper:
    """Named fixed-size regions in per-rank swap files, moved to and from CPU tensors.

    Args:
        nvme_path: an existing, writable directory on a fast local disk.
        rank: the global rank; names the per-rank subdirectory.
        num_buffers: aligned bounce buffers in the pool (also the number of idle read-ahead
            staging buffers kept for reuse).
        alignment: bytes; file offsets and sizes are multiples of it, and so must be memory that
            ``O_DIRECT`` uses without a bounce buffer. A power of two >= 512.
        buffer_bytes: the chunk and bounce-buffer size; a positive multiple of ``alignment``.
        num_threads: I/O threads, i.e. chunk transfers in flight at once.
        direct_io: ``None`` probes for ``O_DIRECT`` and falls back to buffered I/O; ``True``
            requires it; ``False`` uses buffered I/O.
        pin_memory: pin the bounce and staging buffers; ``None`` pins when CUDA is available.
        prefix: the per-rank subdirectory is ``<prefix>_rank<rank:05d>``; use distinct prefixes for
            swappers that share ``nvme_path`` and rank.
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
        self.directory = self.root / f"{prefix}_rank{rank:05d}"
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
        self._failure: Optional[RuntimeError] = None
        self._failure_raised = False
        self._failure_lock = threading.Lock()
        self._closed = False
        self._io = ThreadPoolExecutor(num_threads, thread_name_prefix=f"{_THREAD_PREFIX}io-r{rank}")
        self._ops = ThreadPoolExecutor(_ASYNC_OP_THREADS, thread_name_prefix=f"{_THREAD_PREFIX}op-r{rank}")
        self._resources = _Resources(self.directory, executors=[self._ops, self._io])
        self._finalizer = weakref.finalize(self, self._resources.cleanup)

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
        path = self.directory / f"{key}.swp"
        self._regions[key] = _Region(key, numel, dtype, nbytes, _align_up(nbytes, self.alignment), path)

    def reserve(self) -> None:
        """Check free space for every registered, not yet reserved region, then create the files.

        The first call also creates the per-rank directory and decides between ``O_DIRECT`` and
        buffered I/O.
        """
        self._check_open()
        pending = [r for key, r in self._regions.items() if key not in self._reserved]
        self._make_directory()
        if self.direct_io is None:
            self.direct_io = self._decide_direct_io()
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
        data = _byte_view(tensor)
        future = self._submit(key, lambda: self._transfer(region, data, write=True))
        self._written.add(key)
        return SwapHandle(key, future, self._mark_failure_raised)

    def prefetch(self, key: str, out: Optional[torch.Tensor] = None) -> SwapHandle:
        """Start reading ``key`` ahead, into a staging buffer or, if given, straight into ``out``.

        Complete it with :meth:`read`. With ``out``, leave ``out`` alone until then. Prefetching a
        key that already has a read-ahead outstanding returns the existing one.
        """
        self._check_failure()
        region = self._region(key)
        self._check_written(region)
        if key in self._staged:
            return SwapHandle(key, self._staged[key].future, self._mark_failure_raised)
        if out is not None:
            _check_tensor(region, out, "prefetch")
            target, owned = _byte_view(out), False
        else:
            target, owned = self._staging.get(region.file_bytes), True
        # A staging buffer has the whole aligned file size, so the tail needs no bounce buffer.
        future = self._submit(key, lambda: self._transfer(region, target, write=False))
        self._staged[key] = _Staged(future, target, owned)
        return SwapHandle(key, future, self._mark_failure_raised)

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
        """Wait for outstanding transfers, remove the files (and the directory this swapper created).

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
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

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

    def _make_directory(self) -> None:
        try:
            self.directory.mkdir()
            self._resources.created_directory = True
        except FileExistsError:
            if not self.directory.is_dir():
                raise RuntimeError(
                    f"NvmeSwapper: {self.directory} exists and is not a directory; remove it or set "
                    "nvme_path to another directory"
                ) from None
        except OSError as e:
            raise RuntimeError(
                f"NvmeSwapper: cannot create {self.directory} in nvme_path={str(self.root)!r} ({e}); "
                "make nvme_path writable or set it to a writable directory"
            ) from e

    def _decide_direct_io(self) -> bool:
        requested = self._requested_direct
        if requested is False:
            return False
        if _direct_io_works(self.directory, self.alignment):
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
        try:
            fd = os.open(region.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        except OSError as e:
            raise RuntimeError(
                f"NvmeSwapper: cannot create swap file {region.path} ({e}); make nvme_path writable "
                "or set it to a writable directory"
            ) from e
        self._resources.files.add(region.path)
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
        failure = self._failure
        if failure is None:
            return
        self._failure_raised = True
        raise RuntimeError(
            f"NvmeSwapper for {self.directory} stopped after an I/O error, its contents can no longer "
            f"be trusted: {failure}"
        ) from failure

    def _record_failure(self, error: BaseException) -> None:
        with self._failure_lock:
            if self._failure is None:
                self._failure = error if isinstance(error, RuntimeError) else RuntimeError(str(error))

    def _mark_failure_raised(self) -> None:
        self._failure_raised = True

    def _transfer_now(self, region: _Region, data: torch.Tensor, write: bool) -> None:
        """A synchronous transfer; its failure is sticky too (a half-written region is garbage)."""
        try:
            self._transfer(region, data, write)
        except BaseException as e:
            self._record_failure(e)
            self._failure_raised = True
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
            staged.future.add_done_callback(lambda _: self._staging.put(staged.target))

    def _submit(self, key: str, operation: Callable[[], None]) -> "Future[None]":
        previous = self._last_op.get(key)
        future = self._ops.submit(self._run_op, previous, operation)
        self._last_op[key] = future
        return future

    def _run_op(self, previous: Optional["Future[None]"], operation: Callable[[], None]) -> None:
        if previous is not None:
            wait_futures([previous])  # FIFO pool: ``previous`` started first, so this cannot deadlock
        if self._failure is not None:
            raise RuntimeError(f"skipped after an earlier I/O error: {self._failure}")
        try:
            operation()
        except BaseException as e:
            self._record_failure(e)
            raise

    # -- internals: data movement -----------------------------------------------------------------

    def _chunks(self, nbytes: int) -> Iterator[_Chunk]:
        body = nbytes - nbytes % self.alignment
        for offset in range(0, body, self.buffer_bytes):
            yield _Chunk(offset, min(self.buffer_bytes, body - offset))
        if body < nbytes:
            yield _Chunk(body, nbytes - body)

    def _needs_bounce(self, memory: torch.Tensor) -> bool:
        if not self.direct_io:
            return False
        return memory.data_ptr() % self.alignment != 0 or memory.numel() % self.alignment != 0

    def _transfer(self, region: _Region, data: torch.Tensor, write: bool) -> None:
        """Move ``data`` (the caller's bytes, at most the file size) to or from ``region``'s file.

        Keeps up to ``num_threads`` chunks in flight on the I/O pool; bounce copies of one chunk
        overlap the I/O of the others.
        """
        flags = os.O_RDWR | (os.O_DIRECT if self.direct_io else 0)
        try:
            fd = os.open(region.path, flags)
        except FileNotFoundError as e:
            raise RuntimeError(
                f"swap file {region.path} of key {region.key!r} is missing (removed after reserve()?); "
                "its contents are lost. Check that nothing cleans up nvme_path during training"
            ) from e
        except OSError as e:
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
            future = self._io.submit(_pwrite_all, fd, view, chunk.offset, region.path)
        else:
            future = self._io.submit(_pread_all, fd, view, chunk.offset, region.path, bool(self.direct_io))
        return _InFlight(future, memory, bounce)

    def _finish_chunk(self, chunk: _InFlight, write: bool) -> None:
        try:
            chunk.future.result()
            if not write and chunk.bounce is not None:
                chunk.memory.copy_(chunk.bounce[: chunk.memory.numel()])
        finally:
            if chunk.bounce is not None:
                self._bounce.release(chunk.bounce)

    def _acquire_bounce(self, in_flight: "collections.deque[_InFlight]", write: bool) -> torch.Tensor:
        """A bounce buffer; finishes this transfer's oldest chunks rather than wait holding buffers."""
        while True:
            buf = self._bounce.try_acquire()
            if buf is not None:
                return buf
            if not in_flight:
                return self._bounce.acquire()  # holding none, so other transfers will free one
            self._finish_chunk(in_flight.popleft(), write)

    def _abandon(self, in_flight: "collections.deque[_InFlight]") -> None:
        """After a failed chunk: let the others finish (they use the descriptor) and free buffers."""
        if not in_flight:
            return
        wait_futures([c.future for c in in_flight])
        for chunk in in_flight:
            if chunk.bounce is not None:
                self._bounce.release(chunk.bounce)
        in_flight.clear()


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


def _check_directory(root: Path) -> Path:
    if not root.exists():
        raise RuntimeError(
            f"NvmeSwapper: nvme_path={str(root)!r} does not exist; create it or set nvme_path to an "
            "existing directory on a fast local disk"
        )
    if not root.is_dir():
        raise RuntimeError(
            f"NvmeSwapper: nvme_path={str(root)!r} is not a directory; set nvme_path to a directory "
            "on a fast local disk"
        )
    if not os.access(root, os.W_OK | os.X_OK):
        raise RuntimeError(
            f"NvmeSwapper: nvme_path={str(root)!r} is not writable by this process; fix its "
            "permissions or set nvme_path to a writable directory"
        )
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


def _direct_io_works(directory: Path, alignment: int) -> bool:
    """Whether ``directory`` accepts an ``O_DIRECT`` write and read of one aligned block."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return False
    probe = directory / _PROBE_NAME
    block = aligned_empty(alignment, torch.uint8, alignment, pin_memory=False)
    block.fill_(0x5A)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_TRUNC | o_direct, 0o600)
        try:
            os.pwrite(fd, _memoryview(block), 0)
            block.zero_()
            got = os.preadv(fd, [_memoryview(block)], 0)
        finally:
            os.close(fd)
        return got == alignment and bool((block == 0x5A).all())
    except OSError as e:
        if e.errno in _UNSUPPORTED_DIRECT_ERRNOS:
            return False
        raise RuntimeError(f"NvmeSwapper: cannot write a probe file in {directory}: {e}") from e
    finally:
        try:
            probe.unlink()
        except FileNotFoundError:
            pass


def _too_small_message(root: Path, needed: int, free: int, regions: int) -> str:
    return (
        f"NvmeSwapper: not enough free space in nvme_path={str(root)!r}: the swap files of {regions} "
        f"regions need {human_bytes(needed)} ({needed} bytes) but only {human_bytes(free)} ({free} bytes) "
        "are free. Free up space, set nvme_path to a larger disk, or offload less to NVMe "
        "(e.g. offload_optimizer_device='cpu')"
    )
