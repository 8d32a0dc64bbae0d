"""``torch.save`` of a structure whose large tensors are filled in afterwards, one at a time, with
``pwrite`` (what ``zeroq-convert`` writes its torch files with).

``save_skeleton`` runs ``torch.save`` under ``torch.serialization.skip_data`` into memory: the pickle
and the zip headers are kept as pieces (a few bytes per tensor), the records' data are holes, and
the total size and which storage got which record key are known before anything touches the disk.
``write_skeleton`` then reserves the whole file (``os.posix_fallocate``), writes the pieces and
returns each record's data offset; the caller ``pwrite``s each storage's bytes there. Nothing is
memory-mapped, so a full disk is an ``OSError`` (never SIGBUS), and ``no_room`` turns one into a
line saying how many bytes were needed, how many were free (or the file-size limit) and the fix.
The structure is pickled once, by torch, and never unpickled here: any picklable value (an
OmegaConf ``DictConfig`` of hyperparameters) goes into the file as ``torch.save`` writes it.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
import struct
import types
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header: 30 bytes


class Skeleton:
    """What ``torch.save`` wrote under ``skip_data``: ``pieces`` (offset, bytes), the file's ``size``,
    and ``storages``: record key -> the storage pickled under it."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, bytes]] = []
        self.size = 0
        self.storages: dict[str, torch.UntypedStorage] = {}
        self._pos = 0

    # the file object torch.save writes to
    def write(self, data: Any) -> int:
        piece = bytes(data)
        self.pieces.append((self._pos, piece))
        self._pos += len(piece)
        self.size = max(self.size, self._pos)
        return len(piece)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:  # skip_data skips a record's data
        self._pos = (
            offset if whence == io.SEEK_SET else self._pos + offset if whence == io.SEEK_CUR else self.size + offset
        )
        self.size = max(self.size, self._pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass


def _recording_pickle(storages: dict[str, torch.UntypedStorage]) -> types.ModuleType:
    """A pickle module for ``torch.save`` that records the record key each storage is saved under:
    torch subclasses its ``Pickler`` with the ``persistent_id`` that assigns the keys, which this
    class wraps as the subclass is made."""

    class Pickler(pickle.Pickler):
        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            assign = cls.persistent_id

            def persistent_id(self: Any, obj: Any) -> Any:
                pid = assign(self, obj)
                if isinstance(pid, tuple) and pid and pid[0] == "storage":  # ("storage", type, key, location, n)
                    storages[pid[2]] = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                return pid

            cls.persistent_id = persistent_id  # type: ignore[method-assign]

    module = types.ModuleType("zeroq_recording_pickle")
    module.Pickler = Pickler  # type: ignore[attr-defined]
    module.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]
    return module


def save_skeleton(structure: Any) -> Skeleton:
    skeleton = Skeleton()
    with torch.serialization.skip_data():
        torch.save(structure, skeleton, pickle_module=_recording_pickle(skeleton.storages))  # type: ignore[arg-type]
    return skeleton


def write_skeleton(skeleton: Skeleton, f: BinaryIO, path: Path) -> dict[str, int]:
    """Reserve ``skeleton.size`` bytes for the empty file ``f`` (at ``path``), write the pieces, and
    return each record key's data offset. A full disk or a file-size limit raises ``no_room``'s error."""
    fd = f.fileno()
    try:
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, skeleton.size)
            except OSError as error:  # a file system without it: pwrite still fails cleanly when full
                if error.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, skeleton.size)
        else:
            os.ftruncate(fd, skeleton.size)
        for offset, piece in skeleton.pieces:
            pwrite_all(fd, memoryview(piece), offset)
    except OSError as error:
        raise no_room(error, path, skeleton.size) from error
    offsets = {}
    with zipfile.ZipFile(f) as archive:  # the central directory, as torch wrote it
        for info in archive.infolist():
            archive_dir, _, key = info.filename.partition("/data/")
            if not _ or "/" in archive_dir or key not in skeleton.storages:
                continue
            f.seek(info.header_offset)
            fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            offsets[key] = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
            if info.file_size != skeleton.storages[key].nbytes():
                raise RuntimeError(
                    f"{path}: torch.save wrote record {info.filename} with {info.file_size} bytes "
                    f"where its storage has {skeleton.storages[key].nbytes()}."
                )
    missing = sorted(set(skeleton.storages) - set(offsets))
    if missing:
        raise RuntimeError(
            f"{path}: torch.save wrote no record for storage(s) {missing[:3]}; this torch's file "
            "format is not the one zeroq-convert knows."
        )
    return offsets


def as_bytes(storage: torch.UntypedStorage) -> memoryview:
    """A storage's bytes, without a copy."""
    array: Any = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return memoryview(array).cast("B")


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + (1 << 30)], offset + done)


def no_room(error: OSError, path: Path, needed: int, *, at_least: bool = False) -> BaseException:
    """``error`` (writing ``needed`` bytes to ``path``) as one line naming the cause, the sizes and the
    fix where it is a full disk, a quota or the file-size limit; else ``error`` itself."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    size = f"{'at least ' if at_least else ''}{needed} bytes"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(path.parent).free
        try:
            free += os.stat(path).st_blocks * 512  # what the unfinished file holds is freed with it
        except (OSError, AttributeError):
            pass
        return RuntimeError(
            f"the output could not be written in {path.parent} ({reason}): it needs {size} "
            f"({needed / 2**20:.1f} MiB) and that file system has {free} bytes ({free / 2**20:.1f} MiB) free "
            "for it; free space there or write the output to another file system."
        )
    if error.errno == errno.EFBIG:
        return RuntimeError(f"the output file in {path.parent} could not grow to {size} ({reason}): {_size_limit()}.")
    return error


def _size_limit() -> str:
    """What keeps a file from growing, and the fix: this process's file-size limit, or the file system's."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        unlimited = limit == resource.RLIM_INFINITY
    except (ImportError, OSError):
        unlimited = True
    if unlimited:
        return "the file system's largest file is smaller; write the output to another file system"
    return (
        f"this process may write files of at most {limit} bytes (ulimit -f); raise the limit "
        "(ulimit -f unlimited) and run it again"
    )
