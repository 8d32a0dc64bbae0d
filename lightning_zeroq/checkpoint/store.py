"""The checkpoint directory: what is in it, what a path points at, and whether it is complete.

A ZeroQ checkpoint is a ``torch.distributed.checkpoint`` directory plus one JSON manifest::

    <path>/.metadata          DCP's metadata (rank 0): every tensor's full shape, dtype and chunks
    <path>/__<r>_0.distcp     rank r's chunks (a 64-byte header naming the save, then DCP items)
    <path>/zeroq.json         written last (rank 0): the save's token, each data file's size, the
                              sha256 of .metadata, every stored item's checksum (checksum.py), the
                              trainer state (JSON, see codec.py) and a sha256 of all that

Keys follow Lightning's ``ModelParallelStrategy`` (FSDP2): ``state_dict.<name>`` for every entry of
the module's ``state_dict()`` and ``optimizer_0.state.<name>.<key>`` /
``optimizer_0.param_groups.<i>.<key>`` for the optimizer, as ``get_optimizer_state_dict`` returns it.
Where a callback moved the module's state to another key of Lightning's checkpoint dict and put a
state dict of its own under ``state_dict`` (Lightning's weight averaging: the module's own weights
under ``current_model_state``, the average under ``state_dict``), both are stored this way, each under
its key (``moved_entries``).

``classify`` says what a user's path is (a ZeroQ checkpoint, another DCP checkpoint, a DeepSpeed
checkpoint directory, a single file, a file inside a checkpoint directory, nothing): a directory with
``zeroq.json`` is ZeroQ's whatever else is in it (a ``latest`` file beside it names no DeepSpeed
checkpoint), and ``Located`` answers the questions a loader
asks of it (``Kind`` itself is named only here; ``api.py``, the door both integrations load through,
asks ``Located``); ``validate`` checks a ZeroQ directory completely (manifest, metadata, every file's size
and header) without reading any tensor, through ``Files``: the directory and each file opened once,
the handles every later read of the load goes through.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from torch.distributed.checkpoint.metadata import Metadata

from lightning_zeroq.checkpoint import atomic
from lightning_zeroq.checkpoint.agree import earlier
from lightning_zeroq.checkpoint.chunks import check_chunks
from lightning_zeroq.checkpoint.files import Files, check_name
from lightning_zeroq.checkpoint.safe import METADATA_FILE, UnsafeCheckpointError, read_metadata
from lightning_zeroq.checkpoint.writer import HEADER_SIZE, token_of

MANIFEST_FILE = "zeroq.json"
FORMAT = "lightning_zeroq.dcp"
VERSION = 2
"""The manifest's format version. 1: checksums optional (the first saves had none). 2: every save that
records checksums; a version-2 manifest without them (or without its own) was edited or damaged."""
CHECKSUMS_SINCE = 2
"""From this version on, a manifest must carry its item checksums and its own checksum; a save made
without checksums (``Checkpointer(checksums=False)``) is written as version ``CHECKSUMS_SINCE - 1``."""
MODEL_KEY = "state_dict"
OPTIMIZER_KEY = "optimizer_0"


LIGHTNING_META = "meta.pt"
"""Lightning's ModelParallelStrategy writes its trainer state here, beside its DCP files."""
ENGINE_KEY = "zeroq"
"""A Lightning checkpoint's entry for the engine's own state beside the model's (its loss scaler)."""


def moved_entries(keys: Iterable[str]) -> list[str]:
    """The top-level entries of a ZeroQ checkpoint's tensors beside ``state_dict`` and the optimizer's:
    where a callback moved the module's state (``current_model_state``)."""
    return sorted({key.split(".", 1)[0] for key in keys if "." in key} - {MODEL_KEY, OPTIMIZER_KEY})


def lightning_version() -> str:
    """The installed Lightning's version, for a file in Lightning's layout (Lightning reads it to migrate
    the layout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning")
    except PackageNotFoundError:
        return "2.0.0"


class Kind(enum.Enum):
    ZEROQ = "a ZeroQ checkpoint directory"
    DCP = "a torch.distributed.checkpoint directory"
    DEEPSPEED = "a DeepSpeed checkpoint directory"
    FILE = "a single-file checkpoint"
    INSIDE = "a file inside a checkpoint directory"
    MISSING = "nothing"
    OTHER = "a directory that is no checkpoint"


@dataclass
class Located:
    kind: Kind
    path: Path
    directory: Optional[Path] = None
    """INSIDE: the checkpoint directory; MISSING with a recoverable save: the displaced one."""

    @property
    def is_directory_checkpoint(self) -> bool:
        """A DCP directory, ZeroQ's (with its manifest) or another's."""
        return self.kind in (Kind.ZEROQ, Kind.DCP)

    @property
    def is_foreign(self) -> bool:
        """A DCP directory without ZeroQ's manifest (FSDP2's ``dcp.save``, Lightning's ModelParallelStrategy)."""
        return self.kind is Kind.DCP

    @property
    def is_deepspeed(self) -> bool:
        """A DeepSpeed ZeRO checkpoint directory (its ``latest`` file, or a tag directory of rank files),
        without ZeroQ's manifest or DCP's metadata: ``checkpoint/deepspeed.py`` reads it."""
        return self.kind is Kind.DEEPSPEED

    @property
    def is_single_file(self) -> bool:
        return self.kind is Kind.FILE

    @property
    def is_missing(self) -> bool:
        return self.kind is Kind.MISSING

    @property
    def is_inside(self) -> bool:
        """A file inside a checkpoint directory (``directory``)."""
        return self.kind is Kind.INSIDE

    @property
    def displaced(self) -> Optional[Path]:
        """Nothing is here, but an interrupted save displaced the checkpoint to this directory."""
        return self.directory if self.kind is Kind.MISSING else None

    def error(self) -> Optional[str]:
        """Why this cannot be loaded as a directory checkpoint, with the fix (None: it can)."""
        if self.kind is Kind.MISSING:
            return f"checkpoint path {self.path} does not exist (check the path, or pass ckpt_path='last')."
        if self.kind is Kind.INSIDE:
            return (
                f"{self.path} is a file inside the checkpoint directory {self.directory}; the directory is "
                f"the checkpoint: pass ckpt_path={str(self.directory)!r}."
            )
        if self.kind is Kind.OTHER:
            return (
                f"{self.path} is a directory but no checkpoint (no zeroq.json, no .metadata): pass the "
                "directory trainer.save_checkpoint() wrote."
            )
        return None


def _is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in (MANIFEST_FILE, METADATA_FILE))


DEEPSPEED_LATEST = "latest"
DEEPSPEED_OPTIMIZER_FILE = r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt"
"""A DeepSpeed rank's optimizer state file, its rank the group."""


def _is_deepspeed_dir(path: Path) -> bool:
    """DeepSpeed's layout: a ``latest`` entry (a link or a directory too: the reader refuses those, in
    DeepSpeed's words), or a tag directory's rank files."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return DEEPSPEED_LATEST in names or any(re.fullmatch(DEEPSPEED_OPTIMIZER_FILE, n) for n in names)


def classify(path: Path) -> Located:
    path = Path(path)
    if not os.path.exists(path):
        return Located(Kind.MISSING, path, atomic.recover(path))
    if path.is_dir():
        if (path / MANIFEST_FILE).is_file():
            return Located(Kind.ZEROQ, path)
        if (path / METADATA_FILE).is_file():
            return Located(Kind.DCP, path)
        if _is_deepspeed_dir(path):
            return Located(Kind.DEEPSPEED, path)
        return Located(Kind.OTHER, path)
    inside = path.name in (MANIFEST_FILE, METADATA_FILE, LIGHTNING_META) or path.suffix == ".distcp"
    if inside and _is_checkpoint_dir(path.parent):
        return Located(Kind.INSIDE, path, path.parent)
    return Located(Kind.FILE, path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Manifest:
    token: str
    world_size: int
    files: dict[str, int]
    metadata_sha256: str
    trainer_state: Any = None
    """JSON (``codec.encode``), decoded by the caller."""
    optimizer: bool = False
    extra: dict = field(default_factory=dict)
    checksums: Optional[dict] = None
    """``{"algorithm": name, "items": {file: {offset: checksum}}}``: every stored item's (``checksum.py``);
    None in checkpoints saved without them (format version 1: before they existed, or
    ``Checkpointer(checksums=False)``); a manifest of version ``CHECKSUMS_SINCE`` or later must have them."""

    def to_json(self) -> str:
        version = VERSION if self.checksums is not None else CHECKSUMS_SINCE - 1
        data = {
            "format": FORMAT,
            "version": version,
            "token": self.token,
            "world_size": self.world_size,
            "files": self.files,
            "metadata_sha256": self.metadata_sha256,
            "optimizer": self.optimizer,
            "extra": self.extra,
            "trainer_state": self.trainer_state,
        }
        if self.checksums is not None:
            data["checksums"] = self.checksums
        data[SELF_CHECKSUM] = _self_checksum(data)
        return json.dumps(data, allow_nan=True)

    @classmethod
    def read(cls, directory: Path, files: Optional[Files] = None) -> "Manifest":
        file = directory / MANIFEST_FILE
        try:
            raw = files.read(MANIFEST_FILE) if files is not None else file.read_bytes()
            data = json.loads(raw.decode("utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{file} could not be read ({error}); the checkpoint is damaged or incomplete.") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(
                f"{file} is not a ZeroQ checkpoint manifest (format "
                f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r})."
            )
        stored = data.pop(SELF_CHECKSUM, None)
        if stored is not None and stored != _self_checksum(data):
            raise ValueError(
                f"{file} does not match its own checksum: it was edited or damaged after the save. {earlier()}"
            )
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(
                f"{file} has no format version ({version!r}), which every save writes: it was edited "
                f"or damaged after the save. {earlier()}"
            )
        if version > VERSION:
            raise ValueError(
                f"{file} has format version {version}; this lightning_zeroq reads up to "
                f"{VERSION}: upgrade lightning_zeroq to load it."
            )
        missing = [
            key
            for key, value in ((SELF_CHECKSUM, stored), ("checksums", data.get("checksums")))
            if version >= CHECKSUMS_SINCE and value is None
        ]
        if missing:
            raise ValueError(
                f"{file} has format version {version}, which is always saved with checksums, but its "
                f"checksums are missing ({' and '.join(missing)}): it was edited or damaged after the "
                f"save, so damage to its data could not be detected. {earlier()}"
            )
        try:
            checksums = data.get("checksums")
            if checksums is not None:
                checksums = {
                    "algorithm": str(checksums["algorithm"]),
                    "items": {
                        str(f): {str(o): str(c) for o, c in items.items()} for f, items in checksums["items"].items()
                    },
                }
            return cls(
                token=str(data["token"]),
                world_size=int(data["world_size"]),
                files={str(k): int(v) for k, v in data["files"].items()},
                metadata_sha256=str(data["metadata_sha256"]),
                trainer_state=data.get("trainer_state"),
                optimizer=bool(data.get("optimizer")),
                extra=dict(data.get("extra") or {}),
                checksums=checksums,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{file} lacks or garbles {error}; the checkpoint is damaged.") from None

    def write(self, directory: Path) -> None:
        file = directory / MANIFEST_FILE
        with open(file, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())


SELF_CHECKSUM = "manifest_sha256"


def _self_checksum(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, allow_nan=True).encode("utf-8")).hexdigest()


def validate(files: Files) -> tuple[Optional[Manifest], Optional[Metadata], list[str]]:
    """Manifest, metadata and every problem found (an empty list: complete and consistent), all read
    through ``files``."""
    directory = files.directory
    try:
        manifest = Manifest.read(directory, files)
    except ValueError as error:
        return None, None, [str(error)]
    try:
        raw = files.read(METADATA_FILE)
    except (ValueError, OSError) as error:
        return (
            manifest,
            None,
            [(f"{directory / METADATA_FILE} could not be read ({error}); the checkpoint is damaged or incomplete.")],
        )
    if hashlib.sha256(raw).hexdigest() != manifest.metadata_sha256:  # checked before anything is unpickled
        return (
            manifest,
            None,
            [
                (
                    f"{directory / METADATA_FILE} is not the one this checkpoint was saved with (its sha256 differs from "
                    f"{MANIFEST_FILE}'s); it was replaced or damaged. {earlier()}"
                )
            ],
        )
    try:
        metadata = read_metadata(directory, raw)
    except (UnsafeCheckpointError, RuntimeError, OSError) as error:
        return manifest, None, [str(error)]
    return manifest, metadata, check_files(files, metadata, manifest)


def check_files(files: Files, metadata: Metadata, manifest: Optional[Manifest]) -> list[str]:
    """Every tensor's chunks are consistent (``chunks.check_chunks``, what every reader checks); every data
    file the metadata refers to is inside the directory, exists, is long enough, and (ZeroQ) is this
    save's; every item has its checksum (ZeroQ with checksums)."""
    directory = files.directory
    errors = check_chunks(metadata, str(directory / METADATA_FILE))
    needed: dict[str, int] = {}
    try:
        for info in metadata.storage_data.values():
            check_name(info.relative_path, directory)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except (ValueError, AttributeError, TypeError) as error:
        return [
            str(error)
            if isinstance(error, ValueError)
            else f"{directory / METADATA_FILE} holds a malformed storage entry ({error}); the checkpoint is damaged."
        ]
    expected = manifest.files if manifest is not None else {}
    for name in sorted(set(needed) | set(expected)):
        file = directory / name
        try:
            exists = files.is_file(name)
        except (ValueError, OSError) as error:
            errors.append(str(error))
            continue
        if not exists:
            errors.append(
                f"{file} is missing (rank {_rank_of(name)}'s data); the checkpoint is incomplete. {earlier()}"
            )
            continue
        size = files.size(name)
        if name in expected and size != expected[name] or size < needed.get(name, 0):
            errors.append(
                f"{file} has {size} bytes, the checkpoint recorded {expected.get(name, needed.get(name))}: "
                f"it is truncated or was replaced. {earlier()}"
            )
            continue
        if manifest is not None:
            token = token_of(files.read(name, 0, HEADER_SIZE))
            if token != manifest.token:
                errors.append(
                    f"{file} belongs to another save (its header names save {token!r}, this "
                    f"checkpoint is save {manifest.token!r}); it was copied in from elsewhere. "
                    f"{earlier()}"
                )
    if manifest is not None and manifest.checksums is not None and not errors:
        items = manifest.checksums["items"]
        unlisted = [
            (i.relative_path, i.offset)
            for i in metadata.storage_data.values()
            if str(i.offset) not in items.get(i.relative_path, {})
        ]
        if unlisted:
            errors.append(
                f"{directory / MANIFEST_FILE} has no checksum for {len(unlisted)} stored item(s) (first: "
                f"{unlisted[0][0]} at byte {unlisted[0][1]}); the manifest or the metadata was replaced."
            )
    if errors and files.replaced():
        errors.insert(
            0,
            f"{directory} was replaced or removed while it was being opened (a save to the same path?); load it again.",
        )
    return errors


def _rank_of(name: str) -> str:
    parts = name.split("_")
    return parts[2] if name.startswith("__") and len(parts) > 3 else "?"
