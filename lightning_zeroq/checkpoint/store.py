"""The checkpoint directory: what is in it, what a path points at, and whether it is complete.

A ZeroQ checkpoint is a ``torch.distributed.checkpoint`` directory plus one JSON manifest::

    <path>/.metadata          DCP's metadata (rank 0): every tensor's full shape, dtype and chunks
    <path>/__<r>_0.distcp     rank r's chunks (a 64-byte header naming the save, then DCP items)
    <path>/zeroq.json         written last (rank 0): the save's token, each data file's size, the
                              sha256 of .metadata, the trainer state (JSON, see codec.py)

Keys follow Lightning's ``ModelParallelStrategy`` (FSDP2): ``state_dict.<name>`` for every entry of
the module's ``state_dict()`` and ``optimizer_0.state.<name>.<key>`` /
``optimizer_0.param_groups.<i>.<key>`` for the optimizer, as ``get_optimizer_state_dict`` returns it.

``classify`` says what a user's path is (a ZeroQ checkpoint, another DCP checkpoint, the old
``meta.pt`` + ``zero_shard_rank*.pt`` format, a single file, a file inside a checkpoint directory,
nothing); ``validate`` checks a ZeroQ directory completely (manifest, metadata, every file's size
and header) without reading any tensor.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from torch.distributed.checkpoint.metadata import Metadata

from lightning_zeroq.checkpoint import atomic
from lightning_zeroq.checkpoint.safe import METADATA_FILE, UnsafeCheckpointError, read_metadata
from lightning_zeroq.checkpoint.writer import HEADER_SIZE, token_of

MANIFEST_FILE = "zeroq.json"
FORMAT = "lightning_zeroq.dcp"
VERSION = 1
MODEL_KEY = "state_dict"
OPTIMIZER_KEY = "optimizer_0"
LEGACY_META = "meta.pt"
LEGACY_SHARD_PREFIX = "zero_shard_rank"


class Kind(enum.Enum):
    ZEROQ = "a ZeroQ checkpoint directory"
    DCP = "a torch.distributed.checkpoint directory"
    LEGACY = "a checkpoint in the old lightning_zeroq format (meta.pt + zero_shard_rank*.pt)"
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


def _is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in (MANIFEST_FILE, METADATA_FILE, LEGACY_META))


def classify(path: Path) -> Located:
    path = Path(path)
    if not os.path.exists(path):
        return Located(Kind.MISSING, path, atomic.recover(path))
    if path.is_dir():
        if (path / MANIFEST_FILE).is_file():
            return Located(Kind.ZEROQ, path)
        if (path / METADATA_FILE).is_file():
            return Located(Kind.DCP, path)
        if (path / LEGACY_META).is_file() or any(p.name.startswith(LEGACY_SHARD_PREFIX) for p in path.iterdir()):
            return Located(Kind.LEGACY, path)
        return Located(Kind.OTHER, path)
    inside = (path.name in (MANIFEST_FILE, METADATA_FILE, LEGACY_META) or path.suffix == ".distcp"
              or path.name.startswith(LEGACY_SHARD_PREFIX))
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

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "token": self.token, "world_size": self.world_size,
                           "files": self.files, "metadata_sha256": self.metadata_sha256, "optimizer": self.optimizer,
                           "extra": self.extra, "trainer_state": self.trainer_state}, allow_nan=True)

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        file = directory / MANIFEST_FILE
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{file} could not be read ({error}); the checkpoint is damaged or incomplete.") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{file} is not a ZeroQ checkpoint manifest (format {data.get('format')!r}).")
        if data.get("version", 0) > VERSION:
            raise ValueError(f"{file} has format version {data['version']}; this lightning_zeroq reads up to "
                             f"{VERSION}: upgrade lightning_zeroq to load it.")
        try:
            return cls(token=str(data["token"]), world_size=int(data["world_size"]),
                       files={str(k): int(v) for k, v in data["files"].items()},
                       metadata_sha256=str(data["metadata_sha256"]), trainer_state=data.get("trainer_state"),
                       optimizer=bool(data.get("optimizer")), extra=dict(data.get("extra") or {}))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{file} lacks or garbles {error}; the checkpoint is damaged.") from None

    def write(self, directory: Path) -> None:
        file = directory / MANIFEST_FILE
        with open(file, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())


def validate(directory: Path) -> tuple[Optional[Manifest], Optional[Metadata], list[str]]:
    """Manifest, metadata and every problem found (an empty list: complete and consistent)."""
    errors: list[str] = []
    try:
        manifest = Manifest.read(directory)
    except ValueError as error:
        return None, None, [str(error)]
    try:
        metadata = read_metadata(directory)
    except (UnsafeCheckpointError, RuntimeError, OSError) as error:
        return manifest, None, [str(error)]
    if sha256(directory / METADATA_FILE) != manifest.metadata_sha256:
        errors.append(f"{directory / METADATA_FILE} is not the one this checkpoint was saved with (its sha256 "
                      f"differs from {MANIFEST_FILE}'s); it was replaced or damaged.")
    errors += check_files(directory, metadata, manifest)
    return manifest, metadata, errors


def check_files(directory: Path, metadata: Metadata, manifest: Optional[Manifest]) -> list[str]:
    """Every data file the metadata refers to exists, is long enough, and (ZeroQ) is this save's."""
    errors = []
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    expected = manifest.files if manifest is not None else {}
    for name in sorted(set(needed) | set(expected)):
        file = directory / name
        if not file.is_file():
            errors.append(f"{file} is missing (rank {_rank_of(name)}'s data); the checkpoint is incomplete. "
                          "Resume from an earlier checkpoint.")
            continue
        size = file.stat().st_size
        if name in expected and size != expected[name] or size < needed.get(name, 0):
            errors.append(f"{file} has {size} bytes, the checkpoint recorded {expected.get(name, needed.get(name))}: "
                          "it is truncated or was replaced. Resume from an earlier checkpoint.")
            continue
        if manifest is not None:
            with open(file, "rb") as f:
                token = token_of(f.read(HEADER_SIZE))
            if token != manifest.token:
                errors.append(f"{file} belongs to another save (its header names save {token!r}, this "
                              f"checkpoint is save {manifest.token!r}); it was copied in from elsewhere. Resume "
                              "from an earlier checkpoint.")
    return errors


def _rank_of(name: str) -> str:
    parts = name.split("_")
    return parts[2] if name.startswith("__") and len(parts) > 3 else "?"
