"""A ZeRO engine's checkpoint: save and load ``ZeroEngine`` state at any world size, stage or layout.

Used by the Lightning strategy and usable from plain PyTorch or Fabric::

    from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine
    save_engine(engine, "ckpt/step100", trainer_state={"step": 100})   # collective
    state = load_engine(engine, "ckpt/step100")                        # collective; returns trainer_state

The model is stored under ``state_dict.<name>`` and the optimizer under ``optimizer_0.*`` (see
``store.py``); loading also reads DCP checkpoints written by FSDP2 (``get_state_dict``) under
``state_dict``/``optimizer_0`` (Lightning's ``ModelParallelStrategy``), ``model``/``optim`` or at
the top level. Loading validates everything on every rank first (files, names, shapes, dtypes,
optimizer kind and param groups) and ``agree``s, then reads only this rank's chunks.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from lightning_zeroq.checkpoint.agree import CheckpointError, agree, checkpoint_group, describe
from lightning_zeroq.checkpoint.checkpointer import Checkpointer, Opened, bytes_keys, check_entries, open_checkpoint
from lightning_zeroq.checkpoint.chunks import BytesTarget
from lightning_zeroq.checkpoint.safe import read_entries
from lightning_zeroq.checkpoint.store import MODEL_KEY, OPTIMIZER_KEY
from lightning_zeroq.checkpoint import engine_state as chunked
from lightning_zeroq.zero import state_dict as zsd

MODEL_PREFIXES = (MODEL_KEY + ".", "model.", "app.model.", "")
OPTIMIZER_PREFIXES = (OPTIMIZER_KEY + ".", "optim.", "optimizer.", "app.optim.", "")


def engine_state(engine: Any, optimizer: bool) -> dict:
    """Collective (the optimizer's param groups are gathered): the nested state a save writes."""
    state: dict[str, Any] = {MODEL_KEY: chunked.sharded_model_state(engine)}
    if optimizer and engine.optimizer is not None:
        state[OPTIMIZER_KEY] = chunked.sharded_optimizer_state(engine)
    return state


def save_state(engine: Any, path: Path, state: dict, trainer_state: Any, checkpointer: Checkpointer) -> None:
    if getattr(engine, "closed", False):  # what the engine released; an empty optimizer state is fine (plain SGD)
        # No collective: every rank closes its engine at the same point (a new fit), and an asynchronous
        # save may still be using the checkpoint group.
        raise CheckpointError(
            f"Saving checkpoint {path}: the engine that held its state was closed (a new fit replaced it), so its "
            "master shards and optimizer state are gone (with NVMe offload, their swap files); save during fit "
            "(ModelCheckpoint) or before the next fit starts.")
    residency = chunked.Residency(engine)
    pin = engine.device.type == "cuda" and torch.cuda.is_available()
    nvme = type(engine.placement).__name__.startswith("Nvme")
    if nvme and checkpointer.async_save and not getattr(checkpointer, "_warned_nvme", False):
        checkpointer._warned_nvme = True  # type: ignore[attr-defined]
        warnings.warn("async_checkpoint with NVMe optimizer offload: saves stay synchronous (an asynchronous save "
                      "would need the whole optimizer state in host memory, which NVMe offload exists to avoid).",
                      stacklevel=3)
    checkpointer.save(Path(path), state, trainer_state, optimizer=OPTIMIZER_KEY in state,
                      before_read=residency.ensure, after_read=residency.close, pin=pin, allow_async=not nvme,
                      extra={"world_size": engine.world_size, "stage": getattr(engine.config, "stage", None)},
                      views_stable=not nvme)


def save_engine(engine: Any, path: Path, *, trainer_state: Any = None, optimizer: bool = True,
                checkpointer: Optional[Checkpointer] = None) -> None:
    """Collective: write ``engine``'s model (and optimizer) state and ``trainer_state`` (JSON) to ``path``."""
    save_state(engine, path, engine_state(engine, optimizer), trainer_state or {}, checkpointer or Checkpointer())


def _prefix(opened: Opened, candidates: tuple[str, ...], probe: list[str]) -> str:
    keys = opened.keys()
    best, best_hits = candidates[0], -1
    for prefix in candidates:
        hits = sum(prefix + p in keys for p in probe)
        if hits == len(probe):
            return prefix
        if hits > best_hits:
            best, best_hits = prefix, hits
    return best


def _optimizer_prefix(opened: Opened) -> Optional[str]:
    for prefix in OPTIMIZER_PREFIXES:
        if any(k.startswith(prefix + "param_groups.") for k in opened.keys()):
            return prefix
    return None


def _read_param_groups(opened: Opened, prefix: str) -> list[dict]:
    targets = {k: BytesTarget() for k in bytes_keys(opened, prefix + "param_groups.")}
    read_entries(opened.reader, targets)
    groups: dict[int, dict] = {}
    for key, target in targets.items():
        index, name = key[len(prefix + "param_groups."):].split(".", 1)
        groups.setdefault(int(index), {})[name] = target.value
    return [groups[i] for i in sorted(groups)]


def _optimizer_plan(engine: Any, opened: Opened, prefix: str, groups: list[dict]) -> tuple[dict, list[str]]:
    """name -> state keys in the checkpoint, and what does not match this optimizer."""
    optimizer = engine.optimizer
    errors: list[str] = []
    if len(groups) != len(optimizer.param_groups):
        errors.append(f"the checkpoint's optimizer has {len(groups)} param group(s), this one "
                      f"{len(optimizer.param_groups)}: configure_optimizers must build the same groups.")
        return {}, errors
    names = zsd.parameter_names(engine.module)
    shapes = {names[id(p)][0]: p.shape for u in engine.units for p in u.params}
    per_element = chunked.per_element_keys(optimizer)
    keys: dict[str, list[str]] = {}
    stored = opened.keys()
    base = prefix + "state."
    by_name: dict[str, list[str]] = {}
    for key in stored:
        if key.startswith(base):
            head, _, last = key[len(base):].rpartition(".")
            by_name.setdefault(head, []).append(last)
    for name, shape in shapes.items():
        found = by_name.get(name)
        if not found:
            continue
        keys[name] = sorted(found)
        if per_element and not per_element <= set(found):
            errors.append(f"the checkpoint's optimizer state of {name!r} has {sorted(found)}, this "
                          f"{type(optimizer).__name__} keeps {sorted(per_element)}: it was saved with another "
                          "optimizer.")
        for k in per_element & set(found):
            md = stored[base + name + "." + k]
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(shape):
                errors.append(f"the checkpoint's optimizer state {name}.{k} has shape "
                              f"{tuple(getattr(md, 'size', ()))}, the parameter's is {tuple(shape)}.")
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, groups)):
        members = set(saved.get("params", []))
        mine = {names[id(u.params[seg.param])][0] for u in engine.units for seg, view in
                zip(u.segments, u.segment_masters) if any(view is v for v in group["params"])}
        outside = sorted(mine - members)
        if members and outside:
            errors.append(f"param group {g} of this optimizer holds {outside[:4]}, which the checkpoint's group {g} "
                          "does not: configure_optimizers must put the same parameters in the same groups.")
    return keys, errors


def load_engine(engine: Any, path: Path, *, load_optimizer: bool = True, strict: bool = True,
                opened: Optional[Opened] = None) -> Any:
    """Collective: validate ``path`` against ``engine`` on every rank, then load this rank's part of the
    model (and, if ``load_optimizer`` and the engine has an optimizer, its state). Returns the trainer
    state the checkpoint holds (``{}`` for a foreign DCP checkpoint)."""
    group = checkpoint_group()
    if opened is not None:
        return _load_opened(engine, opened, group, load_optimizer, strict)
    opened = open_checkpoint(Path(path), group)
    try:
        return _load_opened(engine, opened, group, load_optimizer, strict)
    finally:
        opened.close()


def _load_opened(engine: Any, opened: Opened, group: Any, load_optimizer: bool, strict: bool) -> Any:
    expected = chunked.model_entries(engine)
    model_prefix = _prefix(opened, MODEL_PREFIXES, list(expected)[:8])
    errors = check_entries(opened, expected, strict=strict, prefix=model_prefix, what="the model")
    optimizer_prefix = optimizer_keys = groups = None
    if load_optimizer and engine.optimizer is not None:
        optimizer_prefix = _optimizer_prefix(opened)
        if optimizer_prefix is None:
            errors.append(f"{opened.path} has no optimizer state (it holds weights only); resume from a checkpoint "
                          "saved with the optimizer, or load these weights into the module before fit().")
        else:
            try:
                groups = _read_param_groups(opened, optimizer_prefix)
                optimizer_keys, more = _optimizer_plan(engine, opened, optimizer_prefix, groups)
                errors += more
            except Exception as error:
                errors.append(describe(error))
    agree(errors, f"Loading checkpoint {opened.path}", group)
    stored = {k[len(model_prefix):] for k in opened.keys() if k.startswith(model_prefix)}

    def scalar_target(key: str) -> Any:
        md = opened.keys()[key]
        if isinstance(md, BytesStorageMetadata):
            return BytesTarget()
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)

    errors = []
    try:
        chunked.load_sharded(engine, lambda targets: read_entries(opened.reader, targets), model_prefix=model_prefix,
                             stored=stored, optimizer_prefix=optimizer_prefix, optimizer_keys=optimizer_keys,
                             param_groups=groups, scalar_target=scalar_target,
                             settle=lambda errs: agree(errs, f"Loading checkpoint {opened.path}", group))
    except CheckpointError:  # agreed: every rank raises it
        raise
    except Exception as error:
        errors.append(f"{describe(error)} (the state of this rank may be partly loaded: do not train on)")
    agree(errors, f"Loading checkpoint {opened.path}", group)
    return opened.trainer_state()
