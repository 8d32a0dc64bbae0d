"""Moving a region's bytes between memory and its file: chunked ``pread``/``pwrite`` on an I/O pool,
the sticky failure of asynchronous operations, their handles, and the ``O_DIRECT`` probe.

Direct I/O
    ``reserve()`` probes once whether the directory accepts ``O_DIRECT`` (open, write and read back
    one aligned block). If it does, every transfer bypasses the page cache, so the swap space costs
    no host memory beyond its buffers and runs at the disk's own bandwidth. If the probe fails with
    ``EINVAL``/``EOPNOTSUPP`` the swapper logs once, ``O_DIRECT not supported on <path> (<fs>),
    using buffered I/O``, and uses plain buffered ``pread``/``pwrite`` (no ``fsync``: the files are
    scratch space that is thrown away at exit, so durability buys nothing). ``direct_io=True``
    makes the probe's failure an error; ``direct_io=False`` skips the probe.

Threads
    Two small thread pools. The *I/O pool* (``num_threads`` threads) only runs ``pread``/``pwrite``
    of one chunk; it never waits on anything but the disk. The *op pool* runs whole asynchronous
    operations (``NvmeSwapper.write_async``, ``prefetch``), each of which keeps up to ``num_threads``
    chunks in flight on the I/O pool while it copies the next chunk into (or the last one out of) a
    bounce buffer; synchronous ``write``/``read`` do the same from the caller's thread.
    Because ops wait on I/O tasks and I/O tasks wait on nothing, neither pool can starve the
    other. Operations on one key run in the order they were issued (an op first waits for the
    previous op on its key); operations on different keys overlap, which is how the engine reads
    unit ``i+1`` ahead while unit ``i`` steps and unit ``i-1`` is written back. Background work and
    the handles it returns reference only the transfer machinery (:class:`RegionIO`,
    :class:`Failure`, the buffer pools), never the swapper, so they do not keep it alive.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from lightning_zeroq.swap.buffers import BouncePool, align_up, aligned_empty, memoryview_of
from lightning_zeroq.swap.regions import PathLike, Region

PROBE_NAME = ".zeroq_odirect_probe"
_UNSUPPORTED_DIRECT_ERRNOS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
_warned_buffered: set[str] = set()

log = logging.getLogger(__name__)


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
                f"I/O error writing swap file {path} at offset {offset + done} ({len(mem) - done} bytes): {e}"
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
                f"I/O error reading swap file {path} at offset {offset + done} ({len(mem) - done} bytes): {e}"
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
# Bookkeeping of a transfer
# ----------------------------------------------------------------------------------------------


class _Chunk(NamedTuple):
    offset: int  # bytes from the start of the region (and of the caller's tensor)
    length: int


class _InFlight(NamedTuple):
    future: "Future[None]"
    memory: torch.Tensor  # the caller's bytes for this chunk
    bounce: Optional[torch.Tensor]  # bounce buffer the I/O went through, if any


class Failure:
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


class RegionIO:
    """Moves bytes between memory and a region's file, keeping ``num_threads`` chunks in flight.

    Background operations run :meth:`transfer`, so it holds what a transfer needs and nothing that
    references the swapper. ``direct`` is decided by the swapper's first ``reserve()``.
    """

    def __init__(
        self,
        dir_fd: int,
        io: ThreadPoolExecutor,
        bounce: BouncePool,
        alignment: int,
        buffer_bytes: int,
        num_threads: int,
    ) -> None:
        self.dir_fd, self.io, self.bounce = dir_fd, io, bounce
        self.alignment, self.buffer_bytes, self.num_threads = alignment, buffer_bytes, num_threads
        self.direct = False

    def transfer(self, region: Region, data: torch.Tensor, write: bool) -> None:
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
        region: Region,
        chunk: _Chunk,
        memory: torch.Tensor,
        bounce: Optional[torch.Tensor],
        write: bool,
    ) -> _InFlight:
        if bounce is None:
            io_memory = memory
        else:
            io_memory = bounce[: align_up(chunk.length, self.alignment)]
            if write:
                bounce[: chunk.length].copy_(memory)
                io_memory[chunk.length :].zero_()
        view = memoryview_of(io_memory)
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


def direct_io_works(dir_fd: int, directory: Path, alignment: int) -> bool:
    """Whether the directory open as ``dir_fd`` accepts an ``O_DIRECT`` write and read of one aligned block."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return False
    block = aligned_empty(alignment, torch.uint8, alignment, pin_memory=False)
    block.fill_(0x5A)
    ours = True  # an open that fails after O_EXCL created the file (tmpfs and O_DIRECT) leaves ours
    try:
        fd = os.open(PROBE_NAME, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | o_direct, 0o600, dir_fd=dir_fd)
        try:
            os.pwrite(fd, memoryview_of(block), 0)
            block.zero_()
            got = os.preadv(fd, [memoryview_of(block)], 0)
        finally:
            os.close(fd)
        return got == alignment and bool((block == 0x5A).all())
    except FileExistsError as e:
        ours = False
        raise RuntimeError(
            f"NvmeSwapper: cannot create the probe file {directory / PROBE_NAME}: something this swapper did "
            "not create is already there (left untouched); check what else writes to nvme_path"
        ) from e
    except OSError as e:
        if e.errno in _UNSUPPORTED_DIRECT_ERRNOS:
            return False
        raise RuntimeError(f"NvmeSwapper: cannot write a probe file in {directory}: {e}") from e
    finally:
        if ours:
            try:
                os.unlink(PROBE_NAME, dir_fd=dir_fd)
            except FileNotFoundError:
                pass


def choose_direct_io(
    requested: Optional[bool], dir_fd: int, files: set[str], root: Path, directory: Path, alignment: int
) -> bool:
    """Whether a swapper uses ``O_DIRECT`` in ``directory`` (open as ``dir_fd``; ``files`` are the names it
    created there), as ``direct_io=requested`` asks (see "Direct I/O")."""
    if requested is False:
        return False
    files.add(PROBE_NAME)  # so that a signal during the probe removes it too
    try:
        works = direct_io_works(dir_fd, directory, alignment)
    finally:
        files.discard(PROBE_NAME)
    if works:
        return True
    fs = filesystem_type(directory)
    if requested:
        raise RuntimeError(
            f"NvmeSwapper: O_DIRECT not supported on {root} ({fs}); put nvme_path on a "
            "filesystem that supports it (ext4, xfs) or pass direct_io=None to fall back to "
            "buffered I/O"
        )
    if str(root) not in _warned_buffered:
        _warned_buffered.add(str(root))
        log.warning("O_DIRECT not supported on %s (%s), using buffered I/O", root, fs)
    return False
