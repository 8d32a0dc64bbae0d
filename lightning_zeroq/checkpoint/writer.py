"""Writing a ``torch.distributed.checkpoint`` directory in which each rank writes only its own chunks.

``ChunkSavePlanner`` is DCP's default planner (flattening, deduplication of replicated tensors, the
global metadata with every tensor's chunk list, coverage checks) plus ``LocalChunks`` leaves: each
becomes one ``WriteItem`` per box at the tensor's full shape, ordered by ``LocalChunks.order``.
``resolve_data`` reads a ``LocalChunks`` only when the writer reaches it, after calling
``before_read(order)``: an engine with NVMe offload makes one unit resident at a time there.

``ChunkWriter`` is DCP's ``FileSystemWriter`` (same ``.metadata``, same file names ``__<rank>_0.distcp``,
same item encoding, readable by stock DCP and FSDP2) except that each rank writes its items in plan
order into one file that starts with a 64-byte header naming the save (``header``), fsyncs it, and
records its size; readers seek to the items' offsets, so the header is invisible to them, and the
validator uses it to spot a data file from another save. The calling thread resolves each item and
copies it to the host while a writer thread serializes the previous ones (``torch.save``, as DCP
does). A device tensor is copied through ``StagingRing``: a bounded host buffer (pinned with CUDA,
so the copy is asynchronous at pinned bandwidth) reused item after item and save after save, each
region handed back by the writer thread once its item is written; an item the ring does not take
(larger than the ring, not contiguous) is copied as before, to a new host tensor. A CPU view (a
box of a flat master or optimizer state) is copied to a tensor of its own only where its memory may
be reused before the writer gets to it (``copy_views``: NVMe offload's buffer pool); otherwise the
writer gets the view's bytes cut out of its storage, without a copy. Either way ``torch.save`` gets
a CPU tensor that owns exactly the item's elements, so the bytes in the file are the same. Its ``stage`` is the identity: callers that save asynchronously stage the state
themselves (``stage_state``) and hand the writer host tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import threading
import warnings
from typing import IO, Any, Callable, Optional, Union, cast

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_zeroq.checkpoint import atomic, checksum
from lightning_zeroq.checkpoint.chunks import LocalChunks
from lightning_zeroq.nulls import nothing

HEADER_SIZE = 64
MAGIC = b"ZEROQDCP1"
PIPELINE = 2
"""Items copied to the host ahead of the one being written."""
SYNC_STAGING_BYTES = 2 * 256 * 2**20
"""Host memory (pinned with CUDA) a synchronous save copies device tensors through (``StagingRing``)."""
STAGING_ALIGN = 512
"""Every region of the ring starts at a multiple of this many bytes."""


def header(token: str) -> bytes:
    raw = MAGIC + token.encode("ascii")
    assert len(raw) <= HEADER_SIZE
    return raw.ljust(HEADER_SIZE, b"\0")


def token_of(raw: bytes) -> Optional[str]:
    """The save token in a data file's first ``HEADER_SIZE`` bytes, or None if it has no header."""
    if not raw.startswith(MAGIC):
        return None
    return raw[len(MAGIC) : HEADER_SIZE].rstrip(b"\0").decode("ascii", "replace")


class ChunkSavePlanner(DefaultSavePlanner):
    def __init__(self, before_read: Callable[[int], None] = nothing) -> None:
        super().__init__()
        self.before_read = before_read
        self._current: Optional[tuple[str, Tensor]] = None

    def set_up_planner(self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.chunked = {k: v for k, v in self.state_dict.items() if isinstance(v, LocalChunks)}
        self.state_dict = {k: v for k, v in self.state_dict.items() if not isinstance(v, LocalChunks)}

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        items = list(plan.items)
        for fqn, chunks in sorted(self.chunked.items(), key=lambda kv: kv[1].order):
            properties = TensorProperties(dtype=chunks.dtype)
            for box in chunks.boxes:
                offsets = torch.Size(box.offsets)
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets, torch.Size(box.sizes)),
                            properties=properties,
                            size=chunks.shape,
                        ),
                    )
                )
        plan = dataclasses.replace(plan, items=items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        chunks = self.chunked.get(write_item.index.fqn)
        if chunks is None:
            return super().resolve_data(write_item)
        assert chunks.read is not None and write_item.index.offset is not None  # saved chunks read; boxes have offsets
        if self._current is None or self._current[0] != write_item.index.fqn:
            self.before_read(chunks.order)
            self._current = (write_item.index.fqn, chunks.read())
        return chunks.box_view(self._current[1], chunks.box_index(tuple(write_item.index.offset)))


class Staged:
    """An item copied into a region of a ``StagingRing``: ``tensor`` owns exactly that region (so
    ``torch.save`` writes just it), with the item's shape, strides and dtype."""

    __slots__ = ("tensor", "_ring", "_region", "_event")

    def __init__(self, tensor: Tensor, ring: "StagingRing", region: tuple[int, int], event: Any) -> None:
        self.tensor = tensor
        self._ring: Optional[StagingRing] = ring
        self._region = region
        self._event = event

    def wait(self) -> Tensor:
        """The host tensor, once the copy into it is complete."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.tensor

    def release(self) -> None:
        """Hand the region back to the ring (once; later calls do nothing)."""
        ring, self._ring = self._ring, None
        if ring is not None:
            self.tensor = None  # type: ignore[assignment]
            ring._release(self._region)


class StagingRing:
    """Bounded host memory that a synchronous save copies device tensors through.

    One buffer of ``capacity`` bytes, allocated at the first item it takes (pinned when ``pin``;
    None: when CUDA is available) and kept for the next saves, used as a ring: the producer takes a
    region for each item in write order (waiting while the ring is full), copies the item into it
    (from a CUDA tensor into pinned memory: asynchronously, the writer waits on the copy's event)
    and the writer releases the region once the item is in the file. The regions in use never
    overlap and never add up to more than ``capacity`` (``peak``: the most bytes held at once).

    ``takes`` refuses what the caller copies as before: a CPU tensor (unless ``cpu_sources``: tests
    force the ring on CPU tensors), an empty or non-contiguous one, one larger than the ring, and
    everything once the buffer could not be allocated. Pieces of a larger item would not do:
    ``torch.save`` needs an item's bytes in one storage (its zip record's CRC and the file's
    serialization id are computed from them), so they would be copied together again.
    """

    def __init__(self, capacity: int, pin: Optional[bool] = None, cpu_sources: bool = False) -> None:
        self.capacity = int(capacity)
        self.pin = pin
        self.cpu_sources = cpu_sources
        self.buffer: Optional[Tensor] = None
        self.held = 0
        self.peak = 0
        self._regions: "collections.deque[tuple[int, int]]" = collections.deque()
        self._cond = threading.Condition()
        self._failed = False

    def __getstate__(self) -> dict:  # a pickled Trainer carries its strategy's ring: settings only
        return {"capacity": self.capacity, "pin": self.pin, "cpu_sources": self.cpu_sources}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def takes(self, tensor: Tensor) -> bool:
        if (
            self._failed
            or tensor.layout != torch.strided
            or tensor.is_quantized
            or tensor.is_conj()
            or tensor.is_neg()
            or not tensor.is_contiguous()
        ):
            return False
        if tensor.device.type != "cuda" and not (self.cpu_sources and tensor.device.type == "cpu"):
            return False
        nbytes = tensor.numel() * tensor.element_size()
        return 0 < _aligned(nbytes) <= self.capacity and self._allocate()

    def stage(self, tensor: Tensor) -> Staged:
        """Copy ``tensor`` (``takes(tensor)`` is true) into a region, waiting for one to be free."""
        if not self._allocate():
            raise RuntimeError("the staging ring has no buffer")
        nbytes = tensor.numel() * tensor.element_size()
        region = self._acquire(_aligned(nbytes))
        try:
            assert self.buffer is not None
            start = region[0]
            # The source's strides, as tensor.to("cpu") keeps them (a contiguous tensor's size-1
            # dimensions may have any stride, and torch.save writes the strides).
            destination = (
                self.buffer[start : start + nbytes].view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
            )
            asynchronous = bool(self.pin) and tensor.device.type == "cuda"
            destination.copy_(tensor, non_blocking=asynchronous)
            event = None
            if asynchronous:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(tensor.device))  # the stream the copy ran on
            owned = torch.empty(0, dtype=tensor.dtype).set_(
                self.buffer.untyped_storage()[start : start + nbytes], 0, tensor.shape, tensor.stride()
            )
        except BaseException:
            self._release(region)
            raise
        return Staged(owned, self, region, event)

    def free(self) -> None:
        """Drop the buffer (the next item allocates it again); nothing may be in flight."""
        with self._cond:
            assert not self._regions, "staging regions still in flight"
            self.buffer = None

    def _allocate(self) -> bool:
        if self.buffer is None:
            if self.pin is None:
                self.pin = torch.cuda.is_available()
            try:
                self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pin)
            except RuntimeError as error:  # no pinned memory left: the saves copy as before
                self._failed = True
                warnings.warn(
                    f"checkpoint staging: cannot allocate {self.capacity / 2**20:.0f} MiB of "
                    f"{'pinned ' if self.pin else ''}host memory ({error}); synchronous saves copy "
                    "device tensors to new host tensors instead.",
                    stacklevel=4,
                )
                return False
        return True

    def _place(self, size: int) -> Optional[int]:
        """Where a region of ``size`` bytes fits now, or None. The regions in use lie, in the order
        they were taken, around the ring from the oldest's start to the newest's end."""
        if not self._regions:
            return 0
        first = self._regions[0][0]
        last_start, last_size = self._regions[-1]
        end = last_start + last_size
        if last_start >= first:  # not wrapped: free space after the newest and before the oldest
            if size <= self.capacity - end:
                return end
            return 0 if size <= first else None
        return end if size <= first - end else None

    def _acquire(self, size: int) -> tuple[int, int]:
        with self._cond:
            while True:
                start = self._place(size)
                if start is not None:
                    break
                self._cond.wait()
            region = (start, size)
            self._regions.append(region)
            self.held += size
            self.peak = max(self.peak, self.held)
            return region

    def _release(self, region: tuple[int, int]) -> None:
        with self._cond:
            if self._regions and self._regions[0] == region:
                self._regions.popleft()
            else:  # out of order (a failed copy): the span in use still covers every region left
                self._regions.remove(region)
            self.held -= region[1]
            self._cond.notify_all()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN


class ChunkWriter(FileSystemWriter):
    def __init__(
        self,
        path: str,
        token: str,
        sync_files: bool = True,
        staging: Optional[StagingRing] = None,
        copy_views: bool = True,
        checksums: bool = True,
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1, overwrite=True)
        self.token = token
        self.staging = staging
        self.copy_views = copy_views
        self.algorithm = checksum.ALGORITHM if checksums else None
        self.written: list[tuple[str, int, dict[str, str]]] = []
        """Per data file: its name, its size and (``checksums``) each item's offset -> checksum."""

    def stage(self, state_dict: dict) -> dict:  # the caller staged it (stage_state)
        return state_dict

    def write_data(self, plan: SavePlan, planner: Any) -> "Future[list[WriteResult]]":
        """Items in plan order; this thread resolves each item and copies it to the host while a
        writer thread serializes the previous ones to the file (at most ``PIPELINE`` items ahead,
        and, for items in the staging ring, at most its capacity)."""
        name = f"{plan.storage_data.prefix}0.distcp"
        results: list[WriteResult] = []
        sums: dict[str, str] = {}
        pending: "queue.Queue" = queue.Queue(maxsize=PIPELINE)
        failure: list[BaseException] = []

        def write_all(f: Any) -> None:
            try:
                while True:
                    entry = pending.get()
                    if entry is None:
                        return
                    item, data = entry
                    offset = f.tell()
                    out = checksum.HashingWriter(f, self.algorithm)  # hashes the bytes as they are written
                    sink = cast(IO[bytes], out)  # torch.save writes to any object with write(); its stubs ask IO
                    if item.type == WriteItemType.BYTE_IO:
                        out.write(data.getbuffer())
                    elif isinstance(data, Staged):
                        try:
                            torch.save(data.wait(), sink)
                        finally:
                            data.release()
                    else:
                        torch.save(data, sink)
                    length = f.tell() - offset
                    digest = out.hexdigest()
                    if digest is not None:  # checksums on
                        sums[str(offset)] = digest
                    results.append(
                        WriteResult(
                            index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)
                        )
                    )
                    if len(results) == 1:
                        f.flush()
                        atomic.fault("mid_data")  # crash tests: a data file cut after its first item
            except BaseException as error:  # reported by the producer below
                failure.append(error)
                while True:  # let the producer finish; its staged items go back to the ring
                    entry = pending.get()
                    if entry is None:
                        break
                    if isinstance(entry[1], Staged):
                        entry[1].release()

        with open(os.path.join(self.path, name), "wb") as f:
            f.write(header(self.token))
            writer = threading.Thread(target=write_all, args=(f,), name="zeroq-checkpoint-writer", daemon=True)
            writer.start()
            try:
                for item in plan.items:
                    if failure:
                        break
                    data = planner.resolve_data(item)
                    pending.put((item, data if item.type == WriteItemType.BYTE_IO else self._to_host(data)))
            finally:
                pending.put(None)
                writer.join()
            if failure:
                raise failure[0]
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
            self.written.append((name, f.tell(), sums))
        future: Future = Future()
        future.set_result(results)
        return future

    def _to_host(self, tensor: Tensor) -> Union[Tensor, Staged]:
        tensor = tensor.detach()
        if self.staging is not None and self.staging.takes(tensor):
            return self.staging.stage(tensor)
        if not self.copy_views and tensor.device.type == "cpu":
            return _cut(tensor)
        return _standalone(tensor)


def _standalone(tensor: Tensor) -> Tensor:
    """A CPU tensor that owns exactly its elements (``torch.save`` writes a view's whole storage)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu")
    if not tensor.is_contiguous() or tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _cut(tensor: Tensor) -> Tensor:
    """``_standalone`` without the copy for a contiguous CPU view: its bytes cut out of its storage
    (the result keeps that storage alive; torch.save writes the same as for the clone)."""
    if (
        tensor.numel()
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        if tensor.storage_offset() == 0 and storage.nbytes() == nbytes:
            return tensor
        start = tensor.storage_offset() * tensor.element_size()
        region = storage[start : start + nbytes]
        # torch's stubs lack set_(source, offset, size), whose stride defaults to the contiguous one
        return torch.empty(0, dtype=tensor.dtype).set_(region, 0, tensor.shape)  # type: ignore[call-overload]
    return _standalone(tensor)


def stage_state(state: Any, before_read: Callable[[int], None], pin: bool, cache: dict) -> Any:
    """A copy of ``state`` that training cannot change: every ``LocalChunks`` read now (in ``order``)
    into a host buffer (pinned with CUDA, kept in ``cache`` by key and reused by the next save), every
    tensor cloned to the host. The copy's ``LocalChunks`` read their buffers."""
    leaves: list[tuple[tuple, LocalChunks]] = []

    def walk(value: Any, path: tuple) -> Any:
        if isinstance(value, LocalChunks):
            leaves.append((path, value))
            return value
        if isinstance(value, Tensor):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            return {k: walk(v, path + (k,)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, path + (i,)) for i, v in enumerate(value))
        return value

    staged = walk(state, ())
    for path, chunks in sorted(leaves, key=lambda pc: pc[1].order):
        before_read(chunks.order)
        key = (path, chunks.start, chunks.numel, chunks.dtype)
        buffer = cache.get(key)
        if buffer is None:
            buffer = torch.empty(chunks.numel, dtype=chunks.dtype, pin_memory=pin)
            cache[key] = buffer
        assert chunks.read is not None  # a state to save holds readable chunks
        buffer.copy_(chunks.read().reshape(-1), non_blocking=pin)
        copy = LocalChunks(
            chunks.shape, chunks.dtype, chunks.start, chunks.numel, read=lambda b=buffer: b, order=chunks.order
        )
        _set(staged, path, copy)
    if pin:
        torch.cuda.synchronize()
    return staged


def _set(container: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = value
