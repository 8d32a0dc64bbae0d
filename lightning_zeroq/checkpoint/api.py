"""The checkpoint door: everything the Trainer's and Fabric's strategies (``lightning_zeroq/lightning/``,
``lightning_zeroq/fabric/``) use of this package, and nothing else they import of it (``__all__``;
``tests/test_architecture.py`` keeps them to it). The protocol is written once, here:

- ``save(engine, path, state, trainer_state)``: the engine's sharded state (``engine_state``, or the Lightning
  dict's parts: ``sharded_model_state``, ``sharded_optimizer_state``, ``holds_sharded_state``) and the JSON
  trainer state (``register_type`` teaches it a type), the loss scaler's state added to it, to a DCP directory
  (``Checkpointer``: atomic, checksummed, asynchronous if asked).
- ``write_file(path, make)``: a weights-only checkpoint, one torch file written atomically by one rank.
- ``load(engine, path, ...) -> Loaded``: wait for a save in flight; on the checkpoint group, say what
  the path is (``store.classify``); a single file (Lightning's, Fabric's) or a DeepSpeed directory goes to the
  caller's ``read_file``, which knows its layout (``read_single_file`` reads it, ``load_torch_optimizer_state``
  puts its weights and optimizer state into the shards); a directory is validated on every rank and read into
  the engine (``engine_io.load_engine``); anything else is one agreed error naming the path and the fix.
  Then the loss scaler takes its state back. What the integration does with the trainer state (loops
  and callbacks, Fabric's entries filled in place) stays in its glue; ``read_lightning_meta`` reads the one
  Lightning's ``ModelParallelStrategy`` leaves beside a DCP directory (``LIGHTNING_META``).
- ``agree``, ``CheckpointError``: a step of the glue that can fail on one rank fails on every rank alike.
- ``remove_checkpoint``: a checkpoint directory or file, gone.
- ``check_pretrained``, ``load_pretrained``: a strategy's ``pretrained=`` options checked before any work, and
  the weights loaded into the engine just built (``pretrained.py``).

What a path is, the store says (``store.classify``, ``Located``). ``read_weights`` serves
``LightningModule.load_from_checkpoint(directory)``, which reads without any engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_zeroq.checkpoint import atomic, deepspeed, pretrained
from lightning_zeroq.checkpoint.agree import CheckpointError, agree, checkpoint_group, describe
from lightning_zeroq.checkpoint.checkpointer import Checkpointer
from lightning_zeroq.checkpoint.codec import register_type
from lightning_zeroq.checkpoint.convert import lightning_checkpoint
from lightning_zeroq.checkpoint.engine_io import (
    engine_state,
    holds_sharded_state,
    load_engine,
    save_state,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zeroq.checkpoint.pretrained import Allowance, NameMap, load_pretrained
from lightning_zeroq.checkpoint.store import ENGINE_KEY, LIGHTNING_META, MODEL_KEY, OPTIMIZER_KEY, classify
from lightning_zeroq.checkpoint.torch_file import load_torch_optimizer_state, torch_load
from lightning_zeroq.zero.state_dict import ShardedParts

__all__ = [
    "LIGHTNING_META",
    "MODEL_KEY",
    "OPTIMIZER_KEY",
    "Allowance",
    "CheckpointError",
    "Checkpointer",
    "Loaded",
    "NameMap",
    "ReadFile",
    "agree",
    "check_pretrained",
    "engine_state",
    "holds_sharded_state",
    "load",
    "load_pretrained",
    "load_torch_optimizer_state",
    "read_lightning_meta",
    "read_single_file",
    "read_weights",
    "register_type",
    "remove_checkpoint",
    "save",
    "sharded_model_state",
    "sharded_optimizer_state",
    "with_engine_state",
    "write_file",
]

ReadFile = Callable[[Path, Any], tuple[Any, bool]]
"""A single-file checkpoint's reader (the integration's: it knows the file's layout), given the path and
the checkpoint group: the trainer state to return and whether it loaded the engine's weights."""


@dataclass
class Loaded:
    """What a load found beside the engine state it read."""

    trainer_state: Any
    """The checkpoint's trainer state (its JSON, or a single file's dict), the loss scaler's entry taken
    out; ``{}`` for a DCP directory saved without ZeroQ's manifest."""
    weights_loaded: bool
    """The engine holds the checkpoint's weights (False: a single file the caller loads itself)."""
    foreign: bool = False
    """A DCP directory without ZeroQ's manifest (FSDP2's ``dcp.save``, Lightning's ModelParallelStrategy):
    its weights (and optimizer state) are loaded, its trainer state is the caller's to make."""


def check_pretrained(
    owner: str, path: Any, name_map: NameMap, allow_missing: Allowance, allow_unexpected: Allowance
) -> Path:
    """A strategy's ``pretrained*`` options checked before any work (a path that does not exist, a value of
    the wrong kind: one line naming ``owner``'s option and the fix); the local path of the checkpoint."""
    local = pretrained.check_path(path, f"{owner}(pretrained=...)")
    pretrained.name_mapper(name_map, f"{owner}(pretrained_name_map=...)")
    pretrained.check_allowance(allow_missing, f"{owner}(pretrained_allow_missing=...)", adapters=True)
    pretrained.check_allowance(allow_unexpected, f"{owner}(pretrained_allow_unexpected=...)", adapters=False)
    return local


def with_engine_state(engine: Optional[ShardedParts], trainer_state: dict) -> dict:
    """``trainer_state`` and the engine's own state beside it (its loss scaler, under ``ENGINE_KEY``), as
    ``load`` restores it: a directory's trainer state, or a single file's top level."""
    if engine is None or engine.loss_scaler is None:
        return trainer_state
    return {**trainer_state, ENGINE_KEY: {"loss_scaler": engine.loss_scaler.state_dict()}}


def save(
    engine: ShardedParts,
    path: Path,
    state: dict,
    trainer_state: dict,
    checkpointer: Checkpointer,
    exclude_frozen: bool = False,
) -> None:
    """Collective: ``state`` (the engine's sharded entries) and ``trainer_state`` (JSON) to ``path``;
    ``exclude_frozen``: ``state`` holds no frozen parameter, and the manifest says which it lacks."""
    save_state(engine, path, state, with_engine_state(engine, trainer_state), checkpointer, exclude_frozen)


def write_file(path: Path, make: Optional[Callable[[], Any]]) -> None:
    """Collective on the checkpoint group: the one rank that passes ``make`` writes what it returns to ``path``
    as one torch file (the others pass None), atomically: a fresh sibling, fsynced, then renamed over ``path``
    (a directory there is removed first). An error making or writing it ends every rank alike."""
    group = checkpoint_group()
    errors = []
    if make is not None:
        try:
            out = make()
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic.new_file(path) as (fd, _):
                with os.fdopen(fd, "wb") as f:  # written through the descriptor mkstemp opened
                    torch.save(out, f)
                    f.flush()
                    os.fsync(f.fileno())
                if path.is_dir() and not path.is_symlink():
                    atomic.remove(path)
        except Exception as error:
            errors.append(f"could not write {path}: {describe(error)}")
    agree(errors, f"Saving checkpoint {path}", group)


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory or file (a link: the link, never its target); nothing if absent."""
    atomic.remove(path)


def load(
    engine: Optional[ShardedParts],
    path: Any,
    *,
    optimizer: bool,
    strict: bool,
    checkpointer: Checkpointer,
    read_file: ReadFile,
    moved: bool = False,
) -> Loaded:
    """Collective: read ``path`` into ``engine`` (its optimizer state too with ``optimizer``; ``strict``:
    every entry the engine expects must be there; ``moved``: a directory's entries a callback moved the
    module's state to come back in the trainer state, whole, with ``state_dict``: ``engine_io.load_engine``).
    See the module docstring."""
    checkpointer.wait()
    path = Path(path)
    group = checkpoint_group()
    located = classify(path)
    if located.is_single_file or located.is_deepspeed:
        trainer_state, weights_loaded = read_file(path, group)
        _restore_loss_scaler(engine, trainer_state)
        return Loaded(trainer_state, weights_loaded)
    if engine is None:
        problem: Optional[str] = f"{path} cannot be loaded before the strategy has set up its engine."
    elif located.displaced is not None:
        problem = None  # an interrupted save displaced it: open_checkpoint loads the displaced one, and says so
    else:
        problem = located.error()
    agree([problem] if problem else [], f"Loading checkpoint {path}", group)
    assert engine is not None  # agreed above
    trainer_state = load_engine(engine, path, load_optimizer=optimizer, strict=strict, moved=moved)
    _restore_loss_scaler(engine, trainer_state)
    return Loaded(trainer_state, True, foreign=located.is_foreign)


def _restore_loss_scaler(engine: Optional[ShardedParts], trainer_state: Any) -> None:
    saved = (trainer_state.pop(ENGINE_KEY, None) or {}) if isinstance(trainer_state, dict) else {}
    scaler = saved.get("loss_scaler")
    if scaler is not None and engine is not None and engine.loss_scaler is not None:
        engine.loss_scaler.load_state_dict(scaler)


def read_single_file(
    path: Path, group: Any, *, optimizer: bool, weights_only: bool, state_dict_only: bool = False
) -> Any:
    """Collective on ``group`` (the one ``load`` hands to ``read_file``): a single-file checkpoint read on every
    rank, ``torch.load`` memory-mapped (``weights_only``: tensors and plain values only), or a DeepSpeed
    directory as the single Lightning file ``zeroq-convert`` would make of it (its optimizer state with
    ``optimizer``; ``state_dict_only``: its model's state dict alone, as a file of ``torch.save(state_dict)``
    holds it). One that cannot be read is the same ``CheckpointError`` on every rank."""
    if deepspeed.is_deepspeed(path):
        checkpoint = deepspeed.load_agreed(path, optimizer, group)
        return checkpoint["state_dict"] if state_dict_only else checkpoint
    return torch_load(path, weights_only, group)


def read_lightning_meta(path: Path) -> Any:
    """Collective: the trainer state Lightning's ``ModelParallelStrategy`` writes beside the DCP files of the
    directory ``path`` (``LIGHTNING_META``), read safely on every rank."""
    return torch_load(path / LIGHTNING_META, True, checkpoint_group())


def read_weights(path: Path, map_location: Any = None) -> Optional[dict]:
    """A directory checkpoint's weights consolidated in memory as a Lightning checkpoint (one process, no
    process group: ``load_from_checkpoint``); None for what is not a directory checkpoint (a single file
    is the caller's to read); a file inside a checkpoint directory is an error naming the directory."""
    located = classify(Path(path))
    if located.is_directory_checkpoint:
        return lightning_checkpoint(located.path, map_location)
    if located.is_inside:
        raise CheckpointError(located.error())
    return None
