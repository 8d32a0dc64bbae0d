"""A single-file torch checkpoint (``strategy="ddp"``'s, or one ``zeroq-convert`` wrote) into the engine:
read safely on every rank with one agreement, its model checked as ``nn.Module.load_state_dict``
would, and a torch-format optimizer state put into the shards unit by unit. Used by the Trainer's
and Fabric's checkpoint glue alike, through the door (``api.py``: ``read_single_file``,
``load_torch_optimizer_state``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zeroq.checkpoint.agree import agree
from lightning_zeroq.checkpoint.engine_io import (
    load_sharded,
    model_entries,
    optimizer_kind_errors,
    sharded_optimizer_state,
)
from lightning_zeroq.checkpoint.store import MODEL_KEY, OPTIMIZER_KEY
from lightning_zeroq.zero.state_dict import ShardedParts


def torch_load(path: Path, weights_only: bool, group: Any) -> Any:
    errors, value = [], None
    try:
        value = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = (
            " It holds objects other than tensors and plain values; if you trust this file, allow the "
            "classes it names with torch.serialization.add_safe_globals([...]) before fit() (the Trainer "
            "does not pass fit(weights_only=False) on to this strategy), or pass weights_only=False to "
            "fabric.load()."
            if weights_only
            else ""
        )
        errors.append(f"{path} could not be loaded safely ({first}).{hint}")
    agree(errors, f"Loading checkpoint {path}", group)
    return value


def model_errors(engine: ShardedParts, model: dict, strict: bool) -> list[str]:
    """What is wrong with a full ``state_dict`` for this engine's module, as ``nn.Module.load_state_dict``
    judges it: a shape mismatch always, missing and unexpected keys under ``strict``."""
    expected = model_entries(engine)
    errors = [
        f"size mismatch for {k}: checkpoint {tuple(v.shape)}, model {tuple(expected[k][0])}"
        for k, v in model.items()
        if k in expected and isinstance(v, Tensor) and v.shape != expected[k][0]
    ]
    if strict:
        missing, unexpected = sorted(expected.keys() - model.keys()), sorted(model.keys() - expected.keys())
        if missing or unexpected:
            errors.append(f"missing keys {missing}, unexpected keys {unexpected} (pass strict=False to ignore them)")
    return errors


def _param_id(key: Any) -> Any:
    """An optimizer state's parameter key: torch's integer id (an int, or a digit string after JSON), or
    the parameter's name where the state is keyed by name (a consolidated ZeroQ or FSDP checkpoint)."""
    return int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else key


def load_torch_optimizer_state(
    engine: ShardedParts, model: dict, optimizer_state: dict, group: Any, strict: bool = True
) -> None:
    """A torch-format optimizer state (integer ids in param-group order, as ``strategy="ddp"`` saves
    it, or keyed by parameter name, as Lightning's consolidation of a ZeroQ directory gives it) into
    the shards, with the model's weights, unit by unit; ``model`` is checked first (``model_errors``),
    on every rank, before any state changes."""
    if engine.optimizer is None:
        raise ValueError(
            "A checkpoint's optimizer state needs an optimizer to load into; attach one first "
            "(fabric.setup(model, optimizer)), or load the model's weights only."
        )
    groups = sharded_optimizer_state(engine)["param_groups"]  # every parameter's name, by group
    saved = optimizer_state.get("param_groups", [])
    errors = model_errors(engine, model, strict)
    if len(saved) != len(groups):
        errors.append(f"the checkpoint's optimizer has {len(saved)} param group(s), this one {len(groups)}.")
    errors += optimizer_kind_errors(engine.optimizer, None, saved)  # a torch file does not record the kind
    names: dict[Any, str] = {}
    for g, (mine, theirs) in enumerate(zip(groups, saved)):
        if len(mine["params"]) != len(theirs["params"]):
            errors.append(
                f"param group {g} holds {len(theirs['params'])} parameters in the checkpoint, "
                f"{len(mine['params'])} here: configure_optimizers must build the same groups."
            )
        names.update(zip(map(_param_id, theirs["params"]), mine["params"]))
        renamed = [(t, m) for t, m in zip(theirs["params"], mine["params"]) if isinstance(t, str) and t != m]
        if renamed:  # a name-keyed state (a consolidated ZeroQ or FSDP checkpoint): the names must agree
            errors.append(
                f"param group {g} of the checkpoint's optimizer names {renamed[0][0]!r} where this "
                f"model has {renamed[0][1]!r}: the optimizer state belongs to another model."
            )
    shapes = {k: v.shape for k, v in model.items() if isinstance(v, Tensor)}
    for index, entry in optimizer_state.get("state", {}).items():
        name = names.get(_param_id(index))
        for key, value in entry.items() if name in shapes else ():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != shapes[name]:
                errors.append(
                    f"the checkpoint's optimizer state {key} of parameter #{index} has shape {tuple(value.shape)}, "
                    f"but #{index} is {name} here, of shape {tuple(shapes[name])}: ZeroQ numbers each param "
                    "group's parameters in the module's order; build the groups in that order."
                )
                break
    agree(errors, "Loading the optimizer state", group)
    flat: dict[str, Any] = {f"{MODEL_KEY}.{k}": v for k, v in model.items()}
    keys: dict[str, list[str]] = {}
    for index, entry in optimizer_state.get("state", {}).items():
        name = names.get(_param_id(index))
        if name is None:
            continue
        keys[name] = sorted(entry)
        for key, value in entry.items():
            flat[f"{OPTIMIZER_KEY}.state.{name}.{key}"] = value

    def read(targets: dict) -> None:
        for key, target in targets.items():
            value = flat.get(key)
            if value is None:  # not in the checkpoint (strict=False): the target keeps what it has
                continue
            if hasattr(target, "boxes"):  # LocalChunks
                target.target.copy_(value.reshape(-1)[target.start : target.start + target.numel])
            elif isinstance(target, Tensor):
                target.copy_(value)
            else:
                target.value, target.loaded = value, True

    load_sharded(
        engine,
        read,
        model_prefix=f"{MODEL_KEY}.",
        stored=set(model),
        optimizer_prefix=f"{OPTIMIZER_KEY}.",
        optimizer_keys=keys,
        param_groups=saved,
        agree_errors=lambda errs: agree(errs, "Loading the optimizer state", group),
    )
