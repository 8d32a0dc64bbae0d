"""Checksums of a checkpoint's stored items: each tensor item and each non-tensor item of every data
file, computed by the writer thread from the bytes it writes (no extra pass over the data) and
checked by the reader on the bytes it read, before anything is decoded.

Hashing runs beside the I/O, not after it: a large write is hashed by a second thread while the
writing thread copies the same bytes to the file, and a large read is hashed chunk by chunk while
the next chunk is read. Both threads only read the buffer and ``xxhash`` releases the GIL on large
inputs, so a save or load costs the longer of the two, not their sum.

``xxh3_64`` (the ``xxhash`` package, a dependency): about 13 GiB/s on one core, five times zlib's
CRC32 and about a fifth of what ``torch.save`` already spends on its zip records' CRC32. Where
``xxhash`` is not installed, saves fall back to ``zlib.crc32`` (recorded as ``crc32``); loading a
checkpoint needs the algorithm it was saved with.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; the fallback keeps saves working
    xxhash = None  # type: ignore[assignment]  # the usual optional-import idiom: None marks it missing

ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"

OVERLAP_BYTES = 4 << 20
"""Writes and reads at least this large are hashed on the checksum thread beside the I/O; smaller
ones inline (handing them over would cost more than hashing them)."""

READ_CHUNK = 64 << 20
"""A checked read goes in chunks of this size, each hashed while the next is read."""

waited_s = 0.0
"""Seconds (process total) that writers and readers spent hashing inline or waiting for the checksum
thread after their own I/O was done: what checksums add to a save's or load's critical path. The
benchmarks read it around a save; nothing else does."""

_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = 0


def _beside(fn: Callable[..., Any], *args: Any) -> "Future[Any]":
    """Run ``fn(*args)`` on this process's one checksum thread (FIFO: updates of one hash keep their
    order). A forked child makes its own thread: the parent's does not exist there."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeroq-checksum")
            _pool_pid = os.getpid()
        return _pool.submit(fn, *args)


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def hasher(algorithm: str = ALGORITHM) -> Any:
    """A fresh hash object (``update(bytes-like)``, ``hexdigest()``)."""
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise RuntimeError(
                "this checkpoint's checksums are xxh3_64, which needs the xxhash package: pip install xxhash"
            )
        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return _Crc32()
    raise RuntimeError(
        f"unknown checksum algorithm {algorithm!r} (this lightning_zeroq knows xxh3_64 and crc32): "
        "upgrade lightning_zeroq to load this checkpoint."
    )


class HashingWriter:
    """A file wrapper for ``torch.save``: writes through to ``file`` and hashes what passes."""

    __slots__ = ("file", "hash")

    def __init__(self, file: Any, algorithm: Optional[str]) -> None:
        self.file = file
        self.hash = hasher(algorithm) if algorithm else None

    def write(self, data: Any) -> int:
        if self.hash is None:
            return self.file.write(data)
        view = memoryview(data)
        if view.nbytes < OVERLAP_BYTES:
            _timed(self.hash.update, view)
            return self.file.write(view)
        hashing = _beside(self.hash.update, view)  # reads ``data`` while this thread writes it out
        try:
            return self.file.write(view)
        finally:
            _timed(hashing.result)  # ``data`` may be freed once this call returns

    def flush(self) -> None:
        self.file.flush()

    def hexdigest(self) -> Optional[str]:
        return None if self.hash is None else self.hash.hexdigest()


def read_hashed(read_into: Callable[[int, memoryview], int], buffer: memoryview, algorithm: str) -> tuple[int, str]:
    """Fill ``buffer`` through ``read_into(position, view) -> bytes read`` in chunks, hashing each
    chunk while the next is read; returns the bytes read (short at the end of a file) and the
    checksum of those bytes."""
    h = hasher(algorithm)
    done = 0
    hashing: Optional[Future] = None
    try:
        while done < len(buffer):
            part = buffer[done : done + READ_CHUNK]
            got = read_into(done, part)
            if hashing is not None:
                _timed(hashing.result)
                hashing = None
            if got <= 0:
                break
            if got >= OVERLAP_BYTES:
                hashing = _beside(h.update, part[:got])
            else:
                _timed(h.update, part[:got])
            done += got
            if got < len(part):
                break
    finally:
        if hashing is not None:
            _timed(hashing.result)
    return done, h.hexdigest()


def _timed(fn: Callable[..., Any], *args: Any) -> None:
    global waited_s
    start = time.perf_counter()
    try:
        fn(*args)
    finally:
        waited_s += time.perf_counter() - start
