"""Fabric glue for checkpoints: what ``ZeroQFabricStrategy.save_checkpoint/load_checkpoint`` do.

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 10, ...})`` writes the same
checkpoint directory as the Trainer (``engine_io``): the model under ``state_dict.*`` and the
optimizer under ``optimizer_0.*``, sharded, so it loads at another world size, stage or layout, into
the Trainer's strategy or FSDP2. The other entries are the manifest's JSON trainer state: plain values
as they are, objects with ``state_dict``/``load_state_dict`` (an LR scheduler) as their state dict;
the entry names of the model and the optimizer are recorded so ``fabric.load`` finds them.

``fabric.load(path, {"model": model, "optimizer": optimizer, "step": 0})`` validates the checkpoint
on every rank, reads this rank's part into the engine, fills the other entries in place (as Fabric's
own strategies do) and returns what the checkpoint holds beyond them. ``strict`` asks that every
requested entry be there and that the model's names match. A checkpoint saved with
``exclude_frozen_parameters=True`` lacks the frozen parameters on purpose (its manifest names them): they keep
the values the set-up model holds. A single file (``fabric.save`` under
``strategy="ddp"``) loads too: its model and optimizer state go into the shards.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_zeroq.checkpoint import api
from lightning_zeroq.checkpoint.api import MODEL_KEY, OPTIMIZER_KEY, Checkpointer, CheckpointError
from lightning_zeroq.zero import state_dict as zsd
from lightning_zeroq.zero.state_dict import ShardedParts

FABRIC_KEY = "zeroq_fabric"
"""In the trainer state: which entries were the model, the optimizer and stateful objects."""


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _roles(engine: ShardedParts, state: dict, what: str) -> tuple[Optional[str], Optional[str]]:
    """The keys of ``state`` that hold the engine's module and its optimizer (either may be absent)."""
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    optimizers = [k for k, v in state.items() if isinstance(v, Optimizer)]
    bound = engine.optimizer
    problems = [
        f"{k!r} is a module that ZeroQFabricStrategy did not set up"
        for k in modules
        if state[k] is not engine.parts.module
    ]
    problems += [
        f"{k!r} is an optimizer that ZeroQFabricStrategy did not set up"
        for k in optimizers
        if state[k] is not bound and state[k] is not getattr(bound, "_zeroq_handed_back", None)
    ]
    if len(modules) > 1 or len(optimizers) > 1:
        problems.append(
            f"it holds {len(modules)} modules and {len(optimizers)} optimizers; the strategy has one of each"
        )
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems) + ". Pass the model and optimizer returned by fabric.setup.")
    return (modules[0] if modules else None), (optimizers[0] if optimizers else None)


def save(
    engine: Optional[ShardedParts],
    path: Path,
    state: dict,
    filter: Optional[dict],
    checkpointer: Checkpointer,
    exclude_frozen: bool = False,
) -> None:
    """``exclude_frozen``: the model's frozen parameters are left out (the manifest names them)."""
    if filter is not None:
        raise ValueError(
            f"ZeroQFabricStrategy.save_checkpoint does not take filter (got keys {sorted(filter)}): the model is saved "
            "sharded, whole (without its frozen parameters with ZeroQFabricStrategy(exclude_frozen_parameters=True)). To "
            "save another subset of the weights, take fabric.strategy.full_state_dict() (a collective) and torch.save the "
            "part you want on rank 0."
        )
    if engine is None:
        raise RuntimeError("fabric.save with ZeroQFabricStrategy needs a model set up with fabric.setup first.")
    module_key, optimizer_key = _roles(engine, state, f"fabric.save({str(path)!r}, ...)")
    if module_key is None:
        raise ValueError(
            f"fabric.save({str(path)!r}, ...): the state holds no model; put the model returned by "
            "fabric.setup in it (e.g. {'model': model, 'optimizer': optimizer})."
        )
    stateful = [k for k, v in state.items() if k not in (module_key, optimizer_key) and _stateful(v)]
    items = {
        k: (v.state_dict() if k in stateful else v) for k, v in state.items() if k not in (module_key, optimizer_key)
    }
    trainer_state = {
        "items": items,
        FABRIC_KEY: {"model": module_key, "optimizer": optimizer_key, "stateful": stateful},
    }
    api.save(
        engine,
        path,
        api.engine_state(engine, optimizer=optimizer_key is not None, exclude_frozen=exclude_frozen),
        trainer_state,
        checkpointer,
        exclude_frozen=exclude_frozen,
    )


def load(
    engine: Optional[ShardedParts],
    path: Path,
    state: Any,
    strict: bool,
    weights_only: Optional[bool],
    checkpointer: Checkpointer,
) -> dict:
    what = f"fabric.load({str(path)!r}, ...)"
    if engine is None:
        raise RuntimeError(
            f"{what} with ZeroQFabricStrategy needs a model set up with fabric.setup first: the "
            "checkpoint is read into its shards."
        )
    raw = isinstance(state, nn.Module)  # fabric.load_raw(path, model): the model's weights alone
    if raw:
        state = {"model": state}
    if not isinstance(state, dict) or not state:
        raise ValueError(
            f"{what}: pass the objects to load into, e.g. fabric.load(path, {{'model': model, "
            "'optimizer': optimizer}); a ZeroQ checkpoint is read into the model's shards, never "
            f"returned whole (got {type(state).__name__})."
        )
    module_key, optimizer_key = _roles(engine, state, what)
    requested = [k for k in state if k not in (module_key, optimizer_key)]

    def read_file(file: Path, group: Any) -> tuple[dict, bool]:
        return _load_single_file(
            engine, file, weights_only, None if raw else module_key, optimizer_key, strict, group, requested
        ), True

    saved = api.load(
        engine, path, optimizer=optimizer_key is not None, strict=strict, checkpointer=checkpointer, read_file=read_file
    ).trainer_state
    if raw:
        return {}
    roles = saved.get(FABRIC_KEY, {})
    items = dict(saved.get("items", {}))
    missing = [k for k in requested if k not in items and k not in saved.get("lost", ())]  # lost: warned of
    if strict and missing:
        raise KeyError(
            f"{what}: the checkpoint has no {missing} (it holds {sorted(items)}); pass strict=False "
            "to load what is there."
        )
    for key in requested:
        if key not in items:
            continue
        value = items.pop(key)
        if _stateful(state[key]) and key in roles.get("stateful", [key]):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return items


def _from_trainer_layout(
    path: Path, checkpoint: dict, module_key: str, optimizer_key: Optional[str], requested: list[str]
) -> tuple[dict, list[str]]:
    """A file in the Trainer's layout (``state_dict``, ``optimizer_0`` or ``optimizer_states``), as Lightning's
    ``_load_distributed_checkpoint`` makes of a ZeroQ directory or ``zeroq-convert --lightning`` writes: its
    model and optimizer under the caller's keys, its Fabric entries (``items``) beside them. Lightning's
    consolidation reads only the tensors, so the other entries are gone: a warning says where they are kept."""
    if not isinstance(checkpoint.get(MODEL_KEY), dict):
        return checkpoint, []
    out = dict(checkpoint.get("items") or {}) if FABRIC_KEY in checkpoint else {}
    out[module_key] = checkpoint[MODEL_KEY]
    optimizer = checkpoint.get(OPTIMIZER_KEY)
    if optimizer is None and checkpoint.get("optimizer_states"):
        optimizer = checkpoint["optimizer_states"][0]
    if optimizer_key is not None and optimizer is not None:
        out[optimizer_key] = optimizer
    lost = [k for k in requested if k not in out] if FABRIC_KEY not in checkpoint else []
    if lost:
        warnings.warn(
            f"{path} holds the model and optimizer in the Trainer's layout but not {lost}: Lightning's "
            "_load_distributed_checkpoint drops a ZeroQ directory's other entries (kept in its zeroq.json); "
            "they keep the values passed to fabric.load. To keep them, consolidate with `zeroq-convert "
            "--lightning --optimizer DIR OUT.pt` or lightning_zeroq.checkpoint.convert.consolidate(DIR, OUT, "
            "lightning=True, optimizer=True).",
            stacklevel=3,
        )
    return out, lost


def _load_single_file(
    engine: ShardedParts,
    path: Path,
    weights_only: Optional[bool],
    module_key: Optional[str],
    optimizer_key: Optional[str],
    strict: bool,
    group: Any,
    requested: Optional[list[str]] = None,
) -> dict:
    """A checkpoint file written by ``fabric.save`` under another strategy (DDP), or a consolidated ZeroQ
    directory in the Trainer's layout (``_from_trainer_layout``): a dict of entries; with ``module_key=None``
    (``load_raw``) the file is the model's state dict itself."""
    requested = requested or []
    lost: list[str] = []
    # A DeepSpeed directory comes in the Trainer's layout, as zeroq-convert writes it.
    checkpoint = api.read_single_file(
        path,
        group,
        optimizer=optimizer_key is not None,
        weights_only=weights_only is not False,
        state_dict_only=module_key is None,
    )
    if module_key is not None and isinstance(checkpoint, dict) and module_key not in checkpoint:
        checkpoint, lost = _from_trainer_layout(path, checkpoint, module_key, optimizer_key, requested)
    errors = []
    if not isinstance(checkpoint, dict) or (module_key is not None and module_key not in checkpoint):
        errors.append(
            f"{path} holds no {module_key!r} entry with the model's state dict."
            if module_key is not None
            else f"{path} holds no state dict (a {type(checkpoint).__name__})."
        )
    api.agree(errors, f"Loading checkpoint {path}", group)
    model = checkpoint.pop(module_key) if module_key is not None else checkpoint
    if module_key is None:
        checkpoint = {}
    optimizer = checkpoint.pop(optimizer_key, None) if optimizer_key is not None else None
    if optimizer is not None:  # the weights and the optimizer state in one pass, checked first
        api.load_torch_optimizer_state(engine, model, optimizer, group, strict=strict)
        return {"items": checkpoint, "lost": lost}
    missing, unexpected = zsd.load_module_state_dict(engine.parts, engine.parts.module, model)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Loading checkpoint {path}: missing keys {missing}, unexpected keys {unexpected}; "
            "pass strict=False to ignore them."
        )
    return {"items": checkpoint, "lost": lost}
