"""Writing a ``torch.distributed.checkpoint`` directory in which each rank writes only its own chunks.

``ChunkSavePlanner`` is DCP's default planner (flattening, deduplication of replicated tensors, the
global metadata with every tensor's chunk list, coverage checks) plus ``LocalChunks`` leaves: each
becomes one ``WriteItem`` per box at the tensor's full shape, ordered by ``LocalChunks.order``.
``resolve_data`` reads a ``LocalChunks`` only when the writer reaches it, after calling
``before_read(order)``: an engine with NVMe offload makes one unit resident at a time there.

``ChunkWriter`` is DCP's ``FileSystemWriter`` (same ``.metadata``, same file names ``__<rank>_0.distcp``,
same item encoding, readable by stock DCP and FSDP2) except that each rank writes its items in plan
order into one file that starts with a 64-byte header naming the save (``header``), fsyncs it, and
records its size (the copy of item i+1 to the host overlaps the serialization of item i); readers seek to the items' offsets, so the header is invisible to them, and the
validator uses it to spot a data file from another save. Its ``stage`` is the identity: callers
that save asynchronously stage the state themselves (``stage_state``).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from torch.futures import Future
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from lightning_zeroq.checkpoint import atomic
from lightning_zeroq.checkpoint.chunks import LocalChunks

HEADER_SIZE = 64
MAGIC = b"ZEROQDCP1"
PIPELINE = 2
"""Items copied to the host ahead of the one being written."""


def header(token: str) -> bytes:
    raw = MAGIC + token.encode("ascii")
    assert len(raw) <= HEADER_SIZE
    return raw.ljust(HEADER_SIZE, b"\0")


def token_of(raw: bytes) -> Optional[str]:
    """The save token in a data file's first ``HEADER_SIZE`` bytes, or None if it has no header."""
    if not raw.startswith(MAGIC):
        return None
    return raw[len(MAGIC):HEADER_SIZE].rstrip(b"\0").decode("ascii", "replace")


class ChunkSavePlanner(DefaultSavePlanner):
    def __init__(self, before_read: Optional[Callable[[int], None]] = None) -> None:
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
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size(box.sizes)),
                                                properties=properties, size=chunks.shape)))
        plan = dataclasses.replace(plan, items=items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        chunks = self.chunked.get(write_item.index.fqn)
        if chunks is None:
            return super().resolve_data(write_item)
        if self._current is None or self._current[0] != write_item.index.fqn:
            if self.before_read is not None:
                self.before_read(chunks.order)
            self._current = (write_item.index.fqn, chunks.read())
        return chunks.box_view(self._current[1], chunks.box_index(tuple(write_item.index.offset)))


class ChunkWriter(FileSystemWriter):
    def __init__(self, path: str, token: str, sync_files: bool = True) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1, overwrite=True)
        self.token = token
        self.written: list[tuple[str, int]] = []

    def stage(self, state_dict: dict) -> dict:  # the caller staged it (stage_state)
        return state_dict

    def write_data(self, plan: SavePlan, planner: Any) -> "Future[list[WriteResult]]":
        """Items in plan order; this thread resolves each item and copies it to the host while a
        writer thread serializes the previous ones to the file (at most ``PIPELINE`` items ahead)."""
        name = f"{plan.storage_data.prefix}0.distcp"
        results: list[WriteResult] = []
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
                    if item.type == WriteItemType.BYTE_IO:
                        f.write(data.getbuffer())
                    else:
                        torch.save(data, f)
                    length = f.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
                    if len(results) == 1:
                        f.flush()
                        atomic.fault("mid_data")  # crash tests: a data file cut after its first item
            except BaseException as error:  # reported by the producer below
                failure.append(error)
                while pending.get() is not None:  # let the producer finish
                    pass

        with open(os.path.join(self.path, name), "wb") as f:
            f.write(header(self.token))
            writer = threading.Thread(target=write_all, args=(f,), name="zeroq-checkpoint-writer", daemon=True)
            writer.start()
            try:
                for item in plan.items:
                    if failure:
                        break
                    data = planner.resolve_data(item)
                    pending.put((item, data if item.type == WriteItemType.BYTE_IO else _standalone(data)))
            finally:
                pending.put(None)
                writer.join()
            if failure:
                raise failure[0]
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
            self.written.append((name, f.tell()))
        future: Future = Future()
        future.set_result(results)
        return future


def _standalone(tensor: Tensor) -> Tensor:
    """A CPU tensor that owns exactly its elements (``torch.save`` writes a view's whole storage)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu")
    if not tensor.is_contiguous() or tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def stage_state(state: Any, before_read: Optional[Callable[[int], None]], pin: bool, cache: dict) -> Any:
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
        if before_read is not None:
            before_read(chunks.order)
        key = (path, chunks.start, chunks.numel, chunks.dtype)
        buffer = cache.get(key)
        if buffer is None:
            buffer = torch.empty(chunks.numel, dtype=chunks.dtype, pin_memory=pin)
            cache[key] = buffer
        buffer.copy_(chunks.read().reshape(-1), non_blocking=pin)
        copy = LocalChunks(chunks.shape, chunks.dtype, chunks.start, chunks.numel, read=lambda b=buffer: b,
                           order=chunks.order)
        _set(staged, path, copy)
    if pin:
        torch.cuda.synchronize()
    return staged


def _set(container: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = value
