"""Aligned host buffers for the swap space.

Buffers
    ``O_DIRECT`` also needs the memory address aligned. A transfer is cut into chunks of
    ``buffer_bytes``; a chunk whose memory is aligned (tensors from :func:`aligned_empty`, pinned
    host memory) goes straight between the caller's tensor and the file. Others, and the sub-block
    tail of every region, go through a bounce buffer from a pool of ``num_buffers`` aligned buffers
    (pinned when CUDA is available, so the engine's H2D copies from them are fast). In buffered
    mode every chunk goes straight from the caller's memory.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import weakref
from typing import Optional

import torch


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


PAGE = 4096
EXACT_PIN_BYTES = 1 << 20
"""From this size on, :func:`pinned_empty` pins exactly the bytes asked for (below, torch's pinned
allocator, whose rounding costs at most this much)."""


_REGISTERED = [0]


def registered_bytes() -> int:
    """Host bytes :func:`pinned_empty` holds page-locked now (torch's host-memory statistics count only
    its own allocator's)."""
    return _REGISTERED[0]


def _unregister(pointer: int, mapping: mmap.mmap) -> None:
    # torch's pinned allocator keeps a freed block until the copies queued on it are done; these pages
    # go back to the system, so first every copy queued on the device ends (a buffer dies rarely: when
    # an engine closes or a unit's state moves to the device).
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(pointer)
    _REGISTERED[0] -= len(mapping)
    del mapping  # the pages go back only now, after their registration ended


def pinned_empty(numel: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """An uninitialized 1-D host tensor, page-locked (where ``pin``) for asynchronous copies to and
    from a GPU, holding exactly its bytes. torch's pinned allocator (``pin_memory=True``) rounds
    every allocation up to a power of two: a 216 MiB buffer (one block of a 3.8B GPT in bf16) takes
    256 MiB, a 188 MiB one 256 MiB, so the pinned buffers of an offloaded model cost up to twice
    their size. Here large ones are anonymous pages registered with CUDA (``cudaHostRegister``),
    unregistered when the last tensor over them goes. Page-aligned, so ``O_DIRECT`` reads take them
    as they are."""
    if numel < 0:
        raise ValueError(f"pinned_empty: numel={numel} must be >= 0")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not pin or nbytes < EXACT_PIN_BYTES:
        return torch.empty(numel, dtype=dtype, pin_memory=pin)
    mapping = mmap.mmap(-1, align_up(nbytes, PAGE))
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    pointer = host.data_ptr()
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, host.numel(), 0))
    if error != 0:  # CUDA keeps it as its last error: the next CUDA call would report it anyway
        raise RuntimeError(
            f"CUDA could not page-lock {nbytes / 2**30:.2f} GiB of host memory for an offloaded "
            f"buffer (cudaHostRegister error {error}): free host memory, or offload less"
        )
    _REGISTERED[0] += len(mapping)
    release = weakref.finalize(host.untyped_storage(), _unregister, pointer, mapping)
    release.atexit = False  # at exit the process's pages go anyway, and CUDA may be gone first
    return host[:nbytes].view(dtype)


def aligned_empty(
    numel: int, dtype: torch.dtype, alignment: int = 4096, pin_memory: Optional[bool] = None
) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor whose data starts at an ``alignment``-byte boundary.

    Tensors from here (or pinned host memory) let ``O_DIRECT`` transfers skip the bounce buffers.
    ``pin_memory=None`` pins when CUDA is available (exactly its bytes: :func:`pinned_empty`).
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel={numel} must be >= 0")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if pin_memory and nbytes >= EXACT_PIN_BYTES and PAGE % alignment == 0:
        return pinned_empty(numel, dtype)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin_memory)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset : offset + nbytes].view(dtype)


def memoryview_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor's memory (the caller keeps ``t`` alive)."""
    n = t.numel()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 tensor (``t`` contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


class BouncePool:
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


class StagingCache:
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
