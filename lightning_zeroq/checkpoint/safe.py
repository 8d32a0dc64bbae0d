"""Reading a ``torch.distributed.checkpoint`` directory without running code from it.

Stock DCP (torch 2.13) reads ``.metadata`` with plain ``pickle.load`` and, in ``DefaultLoadPlanner``,
non-tensor items with ``torch.load(..., weights_only=False)``: a doctored checkpoint runs code on
load. Here:

- ``read_metadata`` unpickles ``.metadata`` with an allow-list: DCP's metadata classes, the
  filesystem's ``_StorageInfo``, ``torch.Size``, dtypes, layouts, memory formats and paths; any
  other global (``os.system``, ``builtins.eval``, ...) raises ``UnsafeCheckpointError`` naming the
  file and the global, before anything is constructed from it.
- ``SafeLoadPlanner`` reads tensor items as DCP does (``torch.load(weights_only=True)``, in the
  stock ``FileSystemReader.read_data``) and non-tensor items with ``weights_only=True`` too, so they
  can only be plain Python values; each tensor item must hold the shape its chunk has in the metadata
  (``chunks.chunk_mismatch``: a chunk list edited to other sizes is refused, never narrowed into place).
- ``read_entries`` loads a dict of targets (``LocalChunks``, full tensors, ``BytesTarget``) with
  ``dcp.load(..., no_dist=True)``: every rank reads only what it asked for, with no collective, so
  a rank that fails cannot leave the others waiting.
"""

from __future__ import annotations

import io
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from lightning_zeroq.checkpoint.agree import CheckpointError, earlier
from lightning_zeroq.checkpoint.checksum import read_hashed
from lightning_zeroq.checkpoint.chunks import BytesTarget, LocalChunks, chunk_mismatch
from lightning_zeroq.checkpoint.files import Files

METADATA_FILE = ".metadata"


class UnsafeCheckpointError(RuntimeError):
    pass


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source} refers to {module}.{name}, which a checkpoint's metadata never needs; it was not "
            "loaded, because unpickling it could run code. The file is damaged or was made to attack: do not "
            "load it with torch.distributed.checkpoint's own reader either."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source} holds a persistent reference {pid!r}; it was not loaded.")


def read_metadata(path: Path, data: Optional[bytes] = None) -> Metadata:
    """The DCP metadata of checkpoint directory ``path`` (or its bytes ``data``, read by the caller),
    read with an allow-list unpickler."""
    file = Path(path) / METADATA_FILE
    with open(file, "rb") if data is None else io.BytesIO(data) as f:
        try:
            metadata = _MetadataUnpickler(f, str(file)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as error:
            raise RuntimeError(
                f"{file} could not be read ({type(error).__name__}: {error}); the checkpoint is damaged or incomplete."
            ) from error
    if not isinstance(metadata, Metadata):
        raise RuntimeError(f"{file} holds a {type(metadata).__name__}, not DCP metadata.")
    return metadata


class ItemError(CheckpointError):
    """A stored item failed its checksum or could not be decoded; names the file, the item and the fix."""


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read safely once and then reused, and whose data is read
    through ``files`` (``store.Files``: the handles the checkpoint was validated through): each item's
    bytes are read once, checked against ``checksums`` (``{"algorithm": ..., "items": {file: {offset:
    checksum}}}``; None: not checked) and only then decoded."""

    def __init__(
        self, path: Path, metadata: Optional[Metadata] = None, files: Any = None, checksums: Optional[dict] = None
    ) -> None:
        super().__init__(str(path))
        self._metadata = metadata
        self.files = files
        self.checksums = checksums
        self._buffer: Optional[bytearray] = None
        self._chunks: Optional[dict[tuple[str, tuple[int, ...]], tuple[int, ...]]] = None
        self.error: Optional[BaseException] = None
        """The first error of the last ``read_data`` (DCP wraps it; ``read_entries`` raises it as it was)."""

    def release(self) -> None:
        """Free the buffer items are read into (reused item after item, as large as the largest read so far);
        the next read allocates it again."""
        self._buffer = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(Path(self.path))
        return self._metadata

    def _chunk_sizes(self, fqn: str, offsets: Any) -> Optional[tuple[int, ...]]:
        """The sizes the metadata gives the chunk of ``fqn`` at ``offsets`` (None: no such chunk)."""
        if self._chunks is None:
            self._chunks = {
                (name, tuple(c.offsets)): tuple(c.sizes)
                for name, md in self.read_metadata().state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)
                for c in md.chunks
            }
        return self._chunks.get((fqn, tuple(offsets or ())))

    def _files(self) -> Any:
        if self.files is None:
            self.files = Files(Path(self.path))
        return self.files

    def _item(self, read_item: ReadItem) -> memoryview:
        """The stored bytes of ``read_item``'s item (in a buffer reused item after item, valid until the
        next call), checked against its checksum."""
        info = self.storage_data[read_item.storage_index]
        if self._buffer is None or len(self._buffer) < info.length:
            self._buffer = bytearray(info.length)
        data = memoryview(self._buffer)[: info.length]
        files = self._files()
        got: Optional[str] = None
        if self.checksums is None:
            data = data[: files.read_into(info.relative_path, info.offset, data)]
        else:  # hashed chunk by chunk while the next chunk is read
            n, got = read_hashed(
                lambda at, view: files.read_into(info.relative_path, info.offset + at, view),
                data,
                self.checksums["algorithm"],
            )
            data = data[:n]
        where = f"{Path(self.path) / info.relative_path}: item {read_item.storage_index.fqn!r}"
        if len(data) != info.length:
            raise ItemError(
                f"{where} ends after {len(data)} of its {info.length} bytes: the file is truncated. {earlier()}"
            )
        if self.checksums is not None:
            expected = self.checksums["items"].get(info.relative_path, {}).get(str(info.offset))
            if got != expected:
                raise ItemError(
                    f"{where} (bytes {info.offset}-{info.offset + info.length}) fails its checksum "
                    f"({self.checksums['algorithm']} {got}, saved {expected}): the file is damaged. "
                    f"{earlier()}"
                )
        return data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        self.error = None
        try:
            self._read_data(plan, planner)
        except BaseException as error:
            self.error = error
            raise
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """As ``FileSystemReader.read_data``, each item read once, in file order, checked, then decoded."""
        order = sorted(
            plan.items,
            key=lambda r: (self.storage_data[r.storage_index].relative_path, self.storage_data[r.storage_index].offset),
        )
        cached: tuple[Any, Any] = (None, None)
        for req in order:
            info = self.storage_data[req.storage_index]
            where = f"{Path(self.path) / info.relative_path}: item {req.storage_index.fqn!r}"
            data: Any
            if cached[0] != (info.relative_path, info.offset):
                data = self._item(req)
                if info.transform_descriptors:
                    data = self.transforms.transform_load_stream(
                        req, info.transform_descriptors, io.BytesIO(data)
                    ).read(-1)
                cached = ((info.relative_path, info.offset), data)
            data = cached[1]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data))
                continue
            if not isinstance(data, Tensor):
                try:
                    data = torch.load(
                        _MemoryFile(data),  # type: ignore[arg-type]  # any readable object does
                        map_location="cpu",
                        weights_only=True,
                    )
                    if not isinstance(data, Tensor):
                        raise TypeError(f"it holds a {type(data).__name__}, not a tensor")
                except Exception as error:
                    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                    raise ItemError(
                        f"{where} could not be decoded ({type(error).__name__}: {first}): the file is "
                        f"damaged. {earlier()}"
                    ) from None
                cached = (cached[0], data)
            fqn = req.storage_index.fqn
            sizes = self._chunk_sizes(fqn, req.storage_index.offset)
            md = self.read_metadata().state_dict_metadata[fqn]
            mismatch = chunk_mismatch(
                str(Path(self.path) / METADATA_FILE),
                fqn,
                tuple(getattr(md, "size", ())),
                sizes if sizes is not None else (),
                tuple(data.size()),
            )
            if mismatch is not None:
                raise ItemError(mismatch)
            tensor = _narrow(data, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise ItemError(
                    f"{where} holds a chunk of shape {tuple(tensor.size())} where the metadata says "
                    f"{tuple(target.size())}: the checkpoint is damaged."
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)


class _MemoryFile:
    """A read-only file over a buffer, for ``torch.load``: ``readinto`` copies straight into the
    storage torch allocates (``io.BytesIO`` would first copy a writable buffer into its own)."""

    def __init__(self, data: Any) -> None:
        self.data, self.pos = memoryview(data).cast("B"), 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else len(self.data) + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(min(len(out), len(self.data) - self.pos), 0)
        out[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size is None or size < 0 else min(self.pos + size, len(self.data))
        out = bytes(self.data[self.pos : end])
        self.pos = max(end, self.pos)
        return out

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def _narrow(tensor: Tensor, offsets: torch.Size, lengths: torch.Size) -> Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if tensor.size(dim) != length:
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class SafeLoadPlanner(LoadPlanner):
    """Reads each target's own chunks; non-tensor items with ``torch.load(weights_only=True)``."""

    def set_up_planner(
        self, state_dict: dict, metadata: Optional[Metadata] = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict, self.metadata = state_dict, metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        assert self.metadata is not None  # DCP's load passes it to set_up_planner
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(obj, BytesTarget):
                index = MetadataIndex(fqn)
                items.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=index,
                        dest_offsets=torch.Size((0,)),
                        storage_index=index,
                        storage_offsets=torch.Size((0,)),
                        lengths=torch.Size((0,)),
                    )
                )
            elif isinstance(obj, LocalChunks):
                assert isinstance(md, TensorStorageMetadata)  # check_entries rejected non-tensors before the load
                chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in obj.boxes]
                items += create_read_items_for_chunk_list(fqn, md, chunks)
            else:
                assert isinstance(md, TensorStorageMetadata)  # as above
                chunk = ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.size())
                items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as error:
            raise UnsafeCheckpointError(
                f"the checkpoint's item {fqn!r} is not a plain value ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); it was not loaded, because unpickling it could "
                "run code."
            ) from error
        target = self.state_dict[fqn]
        target.value, target.loaded = loaded, True

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        obj = self.state_dict[read_item.dest_index.fqn]
        if isinstance(obj, LocalChunks):
            assert obj.target is not None and read_item.dest_index.index is not None  # a loading target's box
            obj = obj.box_view(obj.target, read_item.dest_index.index)
        return _narrow(obj, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        pass


def unwrap(error: BaseException) -> BaseException:
    """The first failing rank's own exception inside DCP's ``CheckpointException``.

    ``failures`` maps a rank to ``(exception, traceback.StackSummary)`` (torch 2.11 to 2.13) or, in
    other versions, to an object with ``.exception`` or to the exception itself; a nested
    ``CheckpointException`` is unwrapped in turn. Anything else becomes a ``RuntimeError`` of its text."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return error
    inner: object = (
        failures[min(failures)] if all(isinstance(k, int) for k in failures) else next(iter(failures.values()))
    )
    if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
        inner = inner[0]
    inner = getattr(inner, "exception", inner)
    if isinstance(inner, BaseException):
        return unwrap(inner) if isinstance(getattr(inner, "failures", None), dict) and inner is not error else inner
    return RuntimeError(str(inner))


def read_entries(reader: SafeReader, targets: dict[str, Any]) -> None:
    """Fill ``targets`` (checkpoint key -> ``LocalChunks`` with a target, tensor, ``BytesTarget``)."""
    if targets:
        try:
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": no_dist is meant
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointException as error:  # DCP wraps whatever the read raised, Ctrl-C too
            if reader.error is not None:
                raise reader.error from None
            raise unwrap(error) from None  # a KeyboardInterrupt stays one: the caller says "interrupted"


def assert_safe_modules_loaded() -> None:
    """The allow-listed modules must be importable (find_class imports them)."""
    for module in _ALLOWED:
        __import__(module)
        assert module in sys.modules
