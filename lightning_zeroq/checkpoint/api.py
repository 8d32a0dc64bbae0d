"""The checkpoint door: what the Trainer's and Fabric's strategies call to save an engine's state and
to load any checkpoint lightning_zeroq reads. The protocol is written once, here:

- ``save(engine, path, state, trainer_state)``: the engine's sharded state (``engine_io.engine_state``
  or the Lightning dict's parts) and the JSON trainer state, the loss scaler's state added to it, to a
  DCP directory (``checkpointer.Checkpointer``: atomic, checksummed, asynchronous if asked).
- ``load(engine, path, ...) -> Loaded``: wait for a save in flight; on the checkpoint group, say what
  the path is (``store.classify``); a single file (Lightning's, Fabric's) or a DeepSpeed directory goes to the
  caller's ``read_file``, which knows its layout; a directory is validated on every rank and read into
  the engine (``engine_io.load_engine``); anything else is one agreed error naming the path and the fix.
  Then the loss scaler takes its state back. What the integration does with the trainer state (loops
  and callbacks, Fabric's entries filled in place) stays in its glue.

What a path is, the store says (``store.classify``, ``Located``). ``read_weights`` serves
``LightningModule.load_from_checkpoint(directory)``, which reads without any engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from lightning_zeroq.checkpoint.agree import CheckpointError, agree, checkpoint_group
from lightning_zeroq.checkpoint.checkpointer import Checkpointer
from lightning_zeroq.checkpoint.convert import lightning_checkpoint
from lightning_zeroq.checkpoint.engine_io import load_engine, save_state
from lightning_zeroq.checkpoint.store import ENGINE_KEY, classify
from lightning_zeroq.zero.state_dict import ShardedParts

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


def with_engine_state(engine: Optional[ShardedParts], trainer_state: dict) -> dict:
    """``trainer_state`` and the engine's own state beside it (its loss scaler, under ``ENGINE_KEY``), as
    ``load`` restores it: a directory's trainer state, or a single file's top level."""
    if engine is None or engine.loss_scaler is None:
        return trainer_state
    return {**trainer_state, ENGINE_KEY: {"loss_scaler": engine.loss_scaler.state_dict()}}


def save(engine: ShardedParts, path: Path, state: dict, trainer_state: dict, checkpointer: Checkpointer,
         exclude_frozen: bool = False) -> None:
    """Collective: ``state`` (the engine's sharded entries) and ``trainer_state`` (JSON) to ``path``;
    ``exclude_frozen``: ``state`` holds no frozen parameter, and the manifest says which it lacks."""
    save_state(engine, path, state, with_engine_state(engine, trainer_state), checkpointer, exclude_frozen)


def load(engine: Optional[ShardedParts], path: Any, *, optimizer: bool, strict: bool, checkpointer: Checkpointer,
         read_file: ReadFile, moved: bool = False) -> Loaded:
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
