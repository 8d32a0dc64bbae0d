"""Saving and opening checkpoints: the protocol every rank follows, independent of the engine.

Save (``Checkpointer.save``; every rank calls it with its own ``state``, a nested dict whose
sharded tensors are ``LocalChunks``) is three steps in a line, ``stage`` -> ``write`` -> ``publish``,
carrying one ``SaveJob``:

1. ``stage``: wait for the previous asynchronous save; encode the trainer state as JSON (every rank,
   so a value that cannot be stored fails everywhere); rank 0 draws the save's token; ``agree``;
   rank 0 creates the temporary sibling directory; ``agree``. Asynchronous (``async_save=True``):
   the state is copied to host memory (the only part training waits for); ``agree``.
2. ``write``: ``torch.distributed.checkpoint.save`` with ``ChunkSavePlanner``/``ChunkWriter`` on the
   checkpoint group: each rank writes only its chunks (replicated tensors once; device tensors
   copied through the checkpointer's pinned ``StagingRing``), fsyncs its file, rank 0 writes
   ``.metadata``. DCP itself makes every rank raise if one rank's write fails. Asynchronous: the
   host copy, through ``torch.distributed.checkpoint.async_save``, in the background.
3. ``publish`` (``put_in_place``): ``agree`` (with each rank's file name and size); rank 0 writes
   ``zeroq.json`` last, fsyncs, publishes the directory atomically (``atomic.publish``) and removes
   leftovers of earlier interrupted saves of the same path (none a live save holds locked); ``agree`` again so
   no rank returns before the checkpoint is in place. Asynchronous: in a background thread once the write is
   done; ``wait()`` (the next save or load, teardown) returns then and raises its error, if any.

A step that fails on one rank fails on all (``agree``, DCP) and removes the temporary directory. Open (``open_checkpoint``) classifies the path, validates a ZeroQ directory completely (or a
foreign DCP directory's files) through ``store.Files`` (every file opened once; the load reads
through the same handles, checking each item's checksum) and ``agree``s, with each rank's save
token (ranks that opened different saves stop), before any state is touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_zeroq.checkpoint import atomic, codec
from lightning_zeroq.checkpoint.agree import CheckpointError, agree, checkpoint_group, describe, earlier
from lightning_zeroq.checkpoint.checksum import hasher
from lightning_zeroq.checkpoint.safe import METADATA_FILE, SafeReader, read_metadata, unwrap
from lightning_zeroq.checkpoint.store import (
    MANIFEST_FILE,
    Files,
    Located,
    Manifest,
    check_files,
    classify,
    sha256,
    validate,
)
from lightning_zeroq.checkpoint.writer import (
    HEADER_SIZE,
    SYNC_STAGING_BYTES,
    ChunkSavePlanner,
    ChunkWriter,
    StagingRing,
    stage_state,
    token_of,
)
from lightning_zeroq.nulls import nothing
from lightning_zeroq.ranks import LOCAL, Group, rank_and_size

log = logging.getLogger("lightning_zeroq")


@dataclass
class SaveTiming:
    blocked_s: float = 0.0
    """Time the caller waited (the whole save, or the staging of an asynchronous one)."""
    total_s: float = 0.0
    """Until the checkpoint was in place (asynchronous: measured in the background)."""


@dataclass(eq=False)
class SaveJob:
    """One save on its way from ``Checkpointer.stage`` to ``publish``."""

    path: Path
    state: Any
    """What ``write`` writes: the caller's state, or (asynchronous) its copy in host memory."""
    optimizer: bool
    extra: dict
    before_read: Callable[[int], None]
    after_read: Callable[[], None]
    pin: bool
    asynchronous: bool
    views_stable: bool
    start: float = field(default_factory=time.perf_counter)
    timing: SaveTiming = field(default_factory=SaveTiming)
    group: Group = LOCAL
    token: str = ""
    tmp: Path = Path()
    manifest: Optional[Manifest] = None
    writer: Optional[ChunkWriter] = None
    written: Optional[Future] = None
    """An asynchronous write in flight."""
    lock: Optional[int] = None  # rank 0: ``tmp``'s lock, keeping other saves' cleanup away (``atomic.create_owned``)

    def end_reads(self) -> None:
        self.after_read()

    def discard(self) -> None:
        """Rank 0 removes the temporary directory of a save that failed."""
        if rank_and_size(self.group)[0] == 0:
            with contextlib.suppress(OSError):
                atomic.remove(self.tmp)
            self.release()

    def release(self) -> None:
        self.lock = atomic.release(self.lock)  # None


class Checkpointer:
    """One per strategy (or per engine): the checkpoint group, the asynchronous save in flight, the
    host buffers asynchronous saves stage into and the ring synchronous saves copy device tensors
    through (``staging``: ``staging_bytes`` of pinned memory, allocated at the first synchronous save
    of a CUDA tensor and kept; 0: none, each device tensor is copied to a new pageable host tensor)."""

    def __init__(
        self, async_save: bool = False, staging_bytes: int = SYNC_STAGING_BYTES, checksums: bool = True
    ) -> None:
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 0:
            raise ValueError(
                f"Checkpointer(staging_bytes={staging_bytes!r}): give the bytes of pinned host memory "
                f"synchronous saves copy through, an int >= 0 (0: none; default {SYNC_STAGING_BYTES})."
            )
        if not isinstance(checksums, bool):
            raise ValueError(
                f"Checkpointer(checksums={checksums!r}): pass True (record a checksum of every stored "
                "item, checked on load; the default) or False (benchmarks: saves without them)."
            )
        self.checksums = checksums
        self.async_save = async_save
        self._pending: Optional[Future] = None
        self._pending_path: Optional[Path] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._staging: dict = {}
        self.staging: Optional[StagingRing] = StagingRing(staging_bytes, pin=None) if staging_bytes > 0 else None
        self.last = SaveTiming()

    # ------------------------------------------------------------------ save

    def save(
        self,
        path: Path,
        state: dict,
        trainer_state: Any,
        *,
        optimizer: bool,
        before_read: Callable[[int], None] = nothing,
        after_read: Callable[[], None] = nothing,
        pin: bool = False,
        allow_async: bool = True,
        extra: Optional[dict] = None,
        views_stable: bool = False,
    ) -> None:
        """Collective: ``stage`` -> ``write`` -> ``publish``, each called once and returning once.
        ``before_read(order)`` makes data resident before a ``LocalChunks`` of that order is read,
        ``after_read()`` ends that walk; ``pin``: stage into pinned memory (CUDA); ``allow_async``: the
        state may be copied to host memory for an asynchronous save; ``views_stable``: the host memory of
        what was read keeps its contents while ``before_read`` walks on (not so with NVMe offload, whose
        buffers are reused), so a synchronous save writes CPU views without copying them first."""
        job = self.stage(
            SaveJob(
                Path(path).absolute(),
                state,
                optimizer=optimizer,
                extra=extra or {},
                before_read=before_read,
                after_read=after_read,
                pin=pin,
                asynchronous=self.async_save and allow_async,
                views_stable=views_stable,
            ),
            trainer_state,
        )
        self.write(job)
        self.publish(job)

    def stage(self, job: SaveJob, trainer_state: Any) -> SaveJob:
        """Every rank: wait for the previous asynchronous save, encode the trainer state (a value that
        cannot be stored fails everywhere), draw the save's token (rank 0), create the temporary sibling
        directory (rank 0) and, for an asynchronous save, copy the state to host memory (the only part
        training waits for); ``agree`` after each."""
        self.wait()
        job.group = checkpoint_group()
        rank, world_size = rank_and_size(job.group)
        errors, encoded = [], None
        try:
            encoded = codec.encode(trainer_state, "the checkpoint")
        except codec.UnsupportedValue as error:
            errors.append(str(error))
        token = agree(errors, f"Saving checkpoint {job.path}", job.group, uuid.uuid4().hex if rank == 0 else None)[0]
        job.token, job.tmp = token, atomic.temp_dir(job.path, token)
        errors = []
        if rank == 0:
            try:
                job.lock = atomic.create_owned(job.tmp)
            except OSError as error:
                errors.append(f"cannot create {job.tmp}: {error}")
        agree(errors, f"Saving checkpoint {job.path}", job.group)
        job.manifest = Manifest(
            token=token,
            world_size=world_size,
            files={},
            metadata_sha256="",
            trainer_state=encoded,
            optimizer=job.optimizer,
            extra=job.extra,
        )
        if job.asynchronous:
            errors = []
            try:
                job.state = stage_state(job.state, job.before_read, job.pin, self._staging)
            except Exception as error:  # e.g. no pinned memory left: every rank must stop here
                errors.append(f"staging for the asynchronous save failed: {describe(error)}")
            finally:
                job.end_reads()
            try:
                agree(errors, f"Saving checkpoint {job.path}", job.group)
            except CheckpointError:
                job.discard()
                raise
        return job

    def write(self, job: SaveJob) -> None:
        """``torch.distributed.checkpoint`` writes each rank's chunks into the temporary directory: now
        (through the pinned ring), or, for an asynchronous save, in the background from the host copy."""
        if job.asynchronous:  # the staged buffers wait for the write: no copy of views
            job.writer = ChunkWriter(str(job.tmp), job.token, copy_views=False, checksums=self.checksums)
            future = dcp.async_save(
                job.state, storage_writer=job.writer, planner=ChunkSavePlanner(), process_group=_dcp_group(job.group)
            )
            assert isinstance(future, Future)  # an AsyncSaveResponse comes only with a non-blocking stager
            job.written = future
        else:
            job.writer = ChunkWriter(
                str(job.tmp), job.token, staging=self.staging, copy_views=not job.views_stable, checksums=self.checksums
            )
            try:
                dcp.save(
                    job.state,
                    storage_writer=job.writer,
                    planner=ChunkSavePlanner(job.before_read),
                    process_group=_dcp_group(job.group),
                )
            except CheckpointException as error:
                job.discard()
                raise CheckpointError(f"Saving checkpoint {job.path} failed: {describe(unwrap(error))}") from None
            finally:
                job.end_reads()

    def publish(self, job: SaveJob) -> None:
        """Put the written checkpoint in place atomically (``put_in_place``): now, or for an asynchronous
        save in the background once its write is done (``wait()`` returns then and raises its error)."""
        if job.written is None:
            put_in_place(job)
            job.timing.blocked_s = job.timing.total_s
        else:
            job.timing.blocked_s = time.perf_counter() - job.start
            self._pending_path = job.path
            self._pending = self._executor_().submit(put_in_place, job)
        self.last = job.timing

    def _executor_(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeroq-checkpoint")
        return self._executor

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is in place; raise its error."""
        pending, self._pending = self._pending, None
        self._pending_path = None
        if pending is not None:
            try:
                pending.result()
            except CheckpointError:
                raise
            except Exception as error:
                raise CheckpointError(f"The asynchronous checkpoint save failed: {describe(error)}") from error

    def pending_path(self) -> Optional[Path]:
        return self._pending_path if self._pending is not None and not self._pending.done() else None

    def release(self) -> None:
        """Wait for the save in flight, then free the staging buffers and the thread."""
        self.wait()
        self._staging.clear()
        if self.staging is not None:
            self.staging.free()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def put_in_place(job: SaveJob) -> None:
    """After the write (waited for, if asynchronous): ``agree`` with each rank's file names and sizes;
    rank 0 writes ``zeroq.json`` last, fsyncs, publishes the directory atomically (``atomic.publish``)
    and removes leftovers of earlier interrupted saves of the same path; ``agree`` again, so no rank
    returns before the checkpoint is in place."""
    if job.written is not None:
        try:
            job.written.result()
        except CheckpointException as error:
            job.discard()
            raise CheckpointError(f"Saving checkpoint {job.path} failed: {describe(unwrap(error))}") from None
    manifest, writer = job.manifest, job.writer
    assert manifest is not None and writer is not None  # stage and write made them
    atomic.fault("after_data")
    files = agree([], f"Saving checkpoint {job.path}", job.group, writer.written)
    rank, world_size = rank_and_size(job.group)
    errors = []
    if rank == 0:
        try:
            manifest.files = {name: size for written in files for name, size, _ in written}
            if writer.algorithm is not None:
                manifest.checksums = {
                    "algorithm": writer.algorithm,
                    "items": {name: sums for written in files for name, _, sums in written},
                }
            manifest.metadata_sha256 = sha256(job.tmp / METADATA_FILE)
            manifest.write(job.tmp)
            atomic.fault("after_manifest")
            atomic.publish(job.tmp, job.path, manifest.token, placed=job.release)  # unlocked once in place
            atomic.fault("after_publish")
            atomic.remove_leftovers(job.path)
        except OSError as error:
            job.release()
            errors.append(f"could not put the checkpoint in place at {job.path}: {error}")
    agree(errors, f"Saving checkpoint {job.path}", job.group)
    job.timing.total_s = time.perf_counter() - job.start
    nbytes = sum(size for written in files for _, size, _ in written)
    _log_saved(job.path, nbytes, world_size, rank, job.timing, asynchronous=job.written is not None)


def _log_saved(
    path: Path, nbytes: int, world_size: int, rank: int, timing: SaveTiming, asynchronous: bool = False
) -> None:
    """Rank 0 says what a save wrote and how long training waited for it (INFO)."""
    if rank == 0:
        waited = (
            f"training waited {timing.blocked_s:.2f} s of {timing.total_s:.2f} s"
            if asynchronous
            else f"in {timing.total_s:.2f} s"
        )
        log.info("Saved checkpoint %s: %.2f GiB from %d rank(s), %s", path, nbytes / 2**30, world_size, waited)


# ---------------------------------------------------------------------- load


@dataclass
class Opened:
    """A checkpoint directory validated on every rank, ready to read."""

    path: Path
    located: Located
    metadata: Metadata
    manifest: Optional[Manifest]
    reader: SafeReader

    def keys(self) -> dict[str, Any]:
        return self.metadata.state_dict_metadata

    decoded: Any = None

    def trainer_state(self) -> Any:
        return {} if self.decoded is None else self.decoded

    def close(self) -> None:
        """Close the files (a load that ends without it leaves them to the garbage collector)."""
        if self.reader.files is not None:
            self.reader.files.close()


def _dcp_group(group: Group) -> Any:
    """``torch.distributed.checkpoint``'s process group for a save on ``group``: a save is ``LOCAL`` only
    without a process group (``checkpoint_group``), where DCP writes as one process (``None``)."""
    return None if group is LOCAL else group


def open_checkpoint(path: Path, group: Group) -> Opened:
    """Collective: locate and validate ``path`` on every rank, then ``agree``."""
    located = classify(Path(path))
    errors: list[str] = []
    if located.displaced is not None:
        warnings.warn(
            f"{located.path} is missing but {located.displaced} holds the checkpoint an interrupted save "
            "displaced; loading that one.",
            stacklevel=3,
        )
        located = classify(located.displaced)
    problem = located.error()
    if problem is None and not located.is_directory_checkpoint:
        problem = f"{located.path} is {located.kind.value}, not a directory checkpoint."
    manifest = metadata = files = None
    if problem is not None:
        errors.append(problem)
    else:
        try:
            files = Files(located.path)
        except OSError as error:
            errors.append(f"{located.path} cannot be opened ({error}).")
    if files is not None and not located.is_foreign:
        manifest, metadata, errors = validate(files)
    elif files is not None:
        try:
            raw = files.read(METADATA_FILE)
            metadata = read_metadata(located.path, raw)
            errors = check_files(files, metadata, None)
            if not errors and any(
                token_of(files.read(name, 0, HEADER_SIZE)) is not None
                for name in {i.relative_path for i in metadata.storage_data.values()}
            ):
                errors.append(
                    f"{located.path} was written by ZeroQ but has no {MANIFEST_FILE}, which a save writes "
                    f"last: the checkpoint is incomplete. {earlier()}"
                )
        except Exception as error:
            errors = [describe(error)]
    decoded = None
    if not errors and manifest is not None and manifest.trainer_state is not None:
        try:
            decoded = codec.decode(manifest.trainer_state)
        except Exception as error:
            errors.append(f"{located.path / MANIFEST_FILE}: the trainer state cannot be read ({describe(error)}).")
    if not errors and manifest is not None and manifest.checksums is not None:
        try:
            hasher(manifest.checksums["algorithm"])
        except RuntimeError as error:
            errors.append(f"{located.path}: {error}")
    # Every rank must have opened the same save: a save replacing the directory between two ranks'
    # opens would otherwise make them load different checkpoints.
    try:
        tokens = agree(errors, f"Loading checkpoint {located.path}", group, manifest.token if manifest else None)
    except CheckpointError:
        if files is not None:
            files.close()
        raise
    if len(set(tokens)) > 1:
        if files is not None:
            files.close()
        raise CheckpointError(
            f"Loading checkpoint {located.path} failed: the ranks opened different saves "
            f"({sorted(set(map(str, tokens)))}); it was replaced while being opened. Load it again."
        )
    assert metadata is not None
    if manifest is not None and manifest.checksums is None:
        warnings.warn(
            f"{located.path} was saved without checksums (format version 1: by an earlier lightning_zeroq, "
            "or with Checkpointer(checksums=False)): damage to its data cannot be detected. Save it again "
            "to add them.",
            stacklevel=3,
        )
    reader = SafeReader(located.path, metadata, files, manifest.checksums if manifest is not None else None)
    opened = Opened(located.path, located, metadata, manifest, reader)
    opened.decoded = decoded
    return opened


def check_entries(
    opened: Opened, expected: dict[str, tuple[torch.Size, torch.dtype]], *, strict: bool, prefix: str, what: str
) -> list[str]:
    """Names, shapes and dtypes of ``expected`` (key without ``prefix``) against the checkpoint."""
    errors: list[str] = []
    stored = {k[len(prefix) :]: v for k, v in opened.keys().items() if k.startswith(prefix)}
    missing = [k for k in expected if k not in stored]
    if missing:
        errors.append(
            f"{what}: {len(missing)} entr{'y' if len(missing) == 1 else 'ies'} of the model are not in "
            f"{opened.path}: {missing[:6]}{' ...' if len(missing) > 6 else ''} (is it a checkpoint of "
            "another model?)"
        )
    if strict:
        unexpected = [k for k in stored if k not in expected]
        if unexpected:
            errors.append(
                f"{what}: {opened.path} has {len(unexpected)} entr{'y' if len(unexpected) == 1 else 'ies'} "
                f"the model lacks: {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''} (pass "
                "strict_loading=False to ignore them)"
            )
    for key, (shape, dtype) in expected.items():
        md = stored.get(key)
        if md is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            errors.append(f"{what}: {key!r} is not a tensor in {opened.path}.")
            continue
        if tuple(md.size) != tuple(shape):
            errors.append(
                f"{what}: {key!r} has shape {tuple(md.size)} in {opened.path}, the model's is {tuple(shape)}."
            )
        elif md.properties.dtype.is_floating_point != dtype.is_floating_point or (
            not dtype.is_floating_point and md.properties.dtype != dtype
        ):
            errors.append(f"{what}: {key!r} is {md.properties.dtype} in {opened.path}, the model's is {dtype}.")
    return errors


def bytes_keys(opened: Opened, prefix: str) -> list[str]:
    return [k for k, v in opened.keys().items() if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)]


def file_exists(path: Path) -> bool:
    return os.path.lexists(path)
