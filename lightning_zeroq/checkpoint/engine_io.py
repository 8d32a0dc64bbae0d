"""A ZeRO engine's checkpoint: save and load ``ZeroEngine`` state at any world size, stage or layout.

Used by the Lightning and Fabric strategies and usable from plain PyTorch::

    from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine
    save_engine(engine, "ckpt/step100", trainer_state={"step": 100})   # collective
    state = load_engine(engine, "ckpt/step100")                        # collective; returns trainer_state

The engine is seen through its sharded view (``lightning_zeroq.zero.state_dict.ShardedView``: per
parameter, the global shape and this rank's flat range, read and written by functions), nothing else.

- Save: ``sharded_model_state`` / ``sharded_optimizer_state`` are this rank's part of every parameter
  and of every per-element optimizer state tensor as ``LocalChunks`` of the full shape, keyed like
  ``state_dict()`` and ``get_optimizer_state_dict``; nothing is copied: the data is read when the
  writer reaches it, after the view's walk made its unit resident (NVMe: one unit at a time). The
  model is stored under ``state_dict.<name>`` and the optimizer under ``optimizer_0.*`` (``store.py``).
- Load: reads DCP checkpoints written by ZeroQ or by FSDP2 (``get_state_dict``) under
  ``state_dict``/``optimizer_0`` (Lightning's ``ModelParallelStrategy``), ``model``/``optim`` or at
  the top level. It validates everything on every rank first (files, names, shapes, dtypes,
  optimizer kind and param groups) and ``agree``s, then reads only this rank's chunks, batch by
  batch of resident units (``load_sharded``), and republishes.
- Frozen parameters left out (``exclude_frozen_parameters``): a save with ``exclude_frozen=True`` writes no
  frozen parameter (``requires_grad=False``; stage 3's sharded frozen parts and those kept whole alike) and
  names them in the manifest's ``extra`` (``FROZEN_EXCLUDED``). A load expects exactly those names absent
  where this model holds them frozen too, and leaves their values as the model holds them (the base it was
  built with); any other missing entry, a trainable parameter's above all, is refused as before.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from lightning_zeroq.checkpoint.agree import CheckpointError, agree, checkpoint_group, describe
from lightning_zeroq.checkpoint.checkpointer import Checkpointer, Opened, bytes_keys, check_entries, open_checkpoint
from lightning_zeroq.checkpoint.chunks import BytesTarget, LocalChunks
from lightning_zeroq.checkpoint.safe import read_entries
from lightning_zeroq.checkpoint.store import MODEL_KEY, OPTIMIZER_KEY, moved_entries
from lightning_zeroq.zero.state_dict import KERNEL_CHOICES, Part, ShardedParts, ShardedView

MODEL_PREFIXES = (MODEL_KEY + ".", "model.", "app.model.", "")
OPTIMIZER_PREFIXES = (OPTIMIZER_KEY + ".", "optim.", "optimizer.", "app.optim.", "")
OPTIMIZER_CLASS = "optimizer_class"
"""In the manifest's ``extra``: the class (``module.qualname``) of the optimizer whose state a save holds."""
ANY_GROUP_KEYS = frozenset({"params", "param_names", "initial_lr"}) | KERNEL_CHOICES
"""Param-group entries that say nothing of an optimizer's kind (LR schedulers add ``initial_lr``)."""
FROZEN_EXCLUDED = "frozen_excluded"
"""In the manifest's ``extra``: the names of the frozen parameters a save left out (``exclude_frozen``), which a
load expects absent."""


def _chunks(part: Part) -> LocalChunks:
    """What the writer writes of ``part``: read when it gets there."""
    return LocalChunks(part.shape, part.dtype, part.offset, part.numel, order=part.order, read=part.read)


def sharded_model_state(engine: ShardedParts, exclude_frozen: bool = False) -> dict[str, Any]:
    """Every ``state_dict()`` entry: this rank's chunks of the fp32 masters and of stage 3's frozen parts
    (``LocalChunks``, read later; the frozen ones in their own dtype), the other frozen parameters and buffers
    as they are (replicated: DCP writes them once). ``exclude_frozen``: no frozen parameter (buffers stay)."""
    view = ShardedView(engine.parts, engine.optimizer)
    left_out = set(view.frozen_names()) if exclude_frozen else set()
    chunks: dict[str, Any] = {}
    for pv in view.params:
        if pv.part is not None:
            value: Any = _chunks(pv.part)
        elif pv.shape.numel() == 0 and view.rank == 0:  # no rank owns an element: rank 0 writes the empty tensor
            value = torch.empty(pv.shape)
        else:
            continue  # owned by other ranks: they write it
        for name in pv.names:
            chunks[name] = value
    unmanaged = view.unmanaged()
    return {
        key: chunks[key] if key in chunks else unmanaged[key]
        for key in view.state_dict_keys()
        if (key in chunks or key in unmanaged) and key not in left_out
    }


def holds_sharded_state(value: Any) -> bool:
    """Whether ``value`` is a module state dict as ``sharded_model_state`` makes it (found by its chunks, also
    where a callback moved it in Lightning's checkpoint dict)."""
    return isinstance(value, dict) and any(isinstance(v, LocalChunks) for v in value.values())


def sharded_optimizer_state(engine: ShardedParts) -> dict[str, Any]:
    """Collective on the engine's group (training's, on the calling thread, so it never meets an
    asynchronous save's collectives): ``{"state": {name: {key: value}}, "param_groups": [...]}`` as
    ``get_optimizer_state_dict`` has it: per-element state as ``LocalChunks`` of the parameter's
    shape, scalar state (Adam's ``step``) from the rank that owns the parameter's first element,
    ``param_groups`` with every parameter's canonical name (gathered from all ranks)."""
    view = ShardedView(engine.parts, engine.optimizer)
    optimizer = view.optimizer
    assert optimizer is not None
    state: dict[str, dict[str, Any]] = {}
    for group in view.groups():
        for pv in group:
            entry = {k: _chunks(v) if isinstance(v, Part) else v for k, v in pv.state().items()}
            if entry:
                state[pv.name] = entry
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": members}
        for group, members in zip(optimizer.param_groups, view.group_names())
    ]
    return {"state": state, "param_groups": groups}


def model_entries(engine: ShardedParts) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """What a checkpoint must hold for this model: name -> (shape, dtype); fp32 for the engine's."""
    view = ShardedView(engine.parts, engine.optimizer)
    managed = {n: pv.shape for pv in view.params for n in pv.names}
    unmanaged = view.unmanaged()
    return {
        key: (managed[key], torch.float32) if key in managed else (unmanaged[key].shape, unmanaged[key].dtype)
        for key in view.state_dict_keys()
        if key in managed or isinstance(unmanaged.get(key), Tensor)
    }


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as a checkpoint records it (the user's class, not the engine's routing subclass)."""
    cls = getattr(type(optimizer), "_zeroq_base", type(optimizer))
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_kind_errors(
    optimizer: torch.optim.Optimizer, saved_kind: Optional[str], saved_groups: list[dict]
) -> list[str]:
    """Why a checkpoint's optimizer state cannot go into ``optimizer``: another class (``saved_kind``, as
    the save recorded it); where the checkpoint does not record it (saved by lightning_zeroq before it
    did, by FSDP2 or DDP), param groups that both hold hyperparameters this optimizer does not have and
    lack ones it has (a missing one alone is kept from this optimizer, as a newer torch may add one)."""
    mine = optimizer_kind(optimizer)
    fix = (
        "resume with the same optimizer (configure_optimizers, or the optimizer passed to fabric.load), or "
        "load the weights only (fabric.load without the optimizer, or LightningModule.load_from_checkpoint "
        "before fit)"
    )
    if saved_kind is not None:
        return (
            []
            if saved_kind == mine
            else [f"the checkpoint holds the state of a {saved_kind} optimizer, this one is a {mine}: {fix}."]
        )
    saved = set().union(*(g.keys() for g in saved_groups)) - ANY_GROUP_KEYS
    own = set(optimizer.defaults).union(*(g.keys() for g in optimizer.param_groups)) - ANY_GROUP_KEYS
    foreign, lacking = sorted(saved - own), sorted(set(optimizer.defaults) - ANY_GROUP_KEYS - saved)
    if foreign and lacking:
        return [
            (
                f"the checkpoint's optimizer param groups hold {foreign} and lack {lacking}, which this {mine} "
                f"has: its state is another kind of optimizer's (the checkpoint does not record which): {fix}."
            )
        ]
    return []


def engine_state(engine: ShardedParts, optimizer: bool, exclude_frozen: bool = False) -> dict:
    """Collective (the optimizer's param groups are gathered): the nested state a save writes
    (``exclude_frozen``: without the frozen parameters)."""
    state: dict[str, Any] = {MODEL_KEY: sharded_model_state(engine, exclude_frozen)}
    if optimizer and engine.optimizer is not None:
        state[OPTIMIZER_KEY] = sharded_optimizer_state(engine)
    return state


def save_state(
    engine: ShardedParts,
    path: Path,
    state: dict,
    trainer_state: Any,
    checkpointer: Checkpointer,
    exclude_frozen: bool = False,
) -> None:
    """Collective: write ``state`` (``engine_state`` or the like) and ``trainer_state`` to ``path``.
    ``exclude_frozen``: ``state`` was made without the frozen parameters; the manifest names those it lacks."""
    view = ShardedView(engine.parts, engine.optimizer)
    if view.closed:  # what the engine released; an empty optimizer state is fine (plain SGD)
        # No collective: every rank closes its engine at the same point (a new fit), and an asynchronous
        # save may still be using the checkpoint group.
        raise CheckpointError(
            f"Saving checkpoint {path}: the engine that held its state was closed (a new fit replaced it), so its "
            "master shards and optimizer state are gone (with NVMe offload, their swap files); save during fit "
            "(ModelCheckpoint) or before the next fit starts."
        )
    if not view.stable and checkpointer.async_save and not getattr(checkpointer, "_warned_nvme", False):
        checkpointer._warned_nvme = True  # type: ignore[attr-defined]
        warnings.warn(
            "async_checkpoint with NVMe optimizer offload: saves stay synchronous (an asynchronous save "
            "would need the whole optimizer state in host memory, which NVMe offload exists to avoid).",
            stacklevel=3,
        )
    extra: dict[str, Any] = {
        "world_size": view.job_world_size,
        "shard_group_size": view.world_size,
        "stage": view.stage,
    }
    if OPTIMIZER_KEY in state and view.optimizer is not None:
        extra[OPTIMIZER_CLASS] = optimizer_kind(view.optimizer)
    if exclude_frozen:
        model = state.get(MODEL_KEY) or {}
        left_out = [name for name in view.frozen_names() if name not in model]
        if left_out:
            extra[FROZEN_EXCLUDED] = left_out
    walk = view.walk()
    checkpointer.save(
        Path(path),
        state,
        trainer_state,
        optimizer=OPTIMIZER_KEY in state,
        before_read=walk.ensure,
        after_read=walk.close,
        pin=view.pin,
        allow_async=view.stable,
        extra=extra,
        views_stable=view.stable,
    )


def save_engine(
    engine: ShardedParts,
    path: Path,
    *,
    trainer_state: Any = None,
    optimizer: bool = True,
    checkpointer: Optional[Checkpointer] = None,
    exclude_frozen: bool = False,
) -> None:
    """Collective: write ``engine``'s model (and optimizer) state and ``trainer_state`` (JSON) to ``path``;
    ``exclude_frozen``: without the frozen parameters (``requires_grad=False``), which a load then expects absent."""
    save_state(
        engine,
        path,
        engine_state(engine, optimizer, exclude_frozen),
        trainer_state or {},
        checkpointer or Checkpointer(),
        exclude_frozen,
    )


# ---------------------------------------------------------------------- load


def _read_agreed(
    read: Callable[[dict], None], targets: dict, agree_errors: Optional[Callable[[list[str]], object]]
) -> None:
    """``read(targets)``, then ``agree_errors`` (every rank, whatever happened): a read that fails on one rank
    becomes the error every rank raises, before any rank enters a collective of the engine."""
    if agree_errors is None:
        read(targets)
        return
    errors = []
    try:
        read(targets)
    except Exception as error:
        errors.append(describe(error))
    agree_errors(errors)


def _value(target: Any) -> Any:
    return target.value if isinstance(target, BytesTarget) else target


@torch.no_grad()
def load_sharded(
    engine: ShardedParts,
    read: Callable[[dict], None],
    *,
    model_prefix: str,
    stored: set[str],
    optimizer_prefix: Optional[str] = None,
    optimizer_keys: Optional[dict[str, list[str]]] = None,
    param_groups: Optional[list[dict]] = None,
    scalar_target: Callable[[str], Any] = lambda key: BytesTarget(),
    agree_errors: Optional[Callable[[list[str]], object]] = None,
    left_out: frozenset[str] = frozenset(),
) -> None:
    """Read this rank's part of every entry, batch by batch of resident units (``read(targets)`` fills
    a dict of checkpoint key -> ``LocalChunks``/tensor/``BytesTarget``). ``stored``: the checkpoint's
    keys without the model prefix (a tied parameter is read under whichever of its names is there).
    ``optimizer_keys``: name -> state keys in the checkpoint, if the optimizer state is to be loaded;
    ``scalar_target(key)``: what to read a non-per-element state entry into (a 0-d tensor or a
    ``BytesTarget``, as the checkpoint stores it). ``agree_errors(errors)``: collective, called by every rank
    after each read with what failed there (raises the agreed error on every rank, e.g. ``agree``):
    every read is agreed on before the units it filled are published (the engine's collectives), so a
    rank whose read fails never leaves the others in a gather. ``left_out``: frozen parameters' names the
    checkpoint lacks on purpose (``frozen_left_out``): not read, they keep the values they have."""
    view = ShardedView(engine.parts, engine.optimizer)
    rest = {model_prefix + k: v for k, v in view.unmanaged().items() if isinstance(v, Tensor) and k not in left_out}
    _read_agreed(read, rest, agree_errors)
    optimizer = view.optimizer if optimizer_keys is not None else None
    per_element = view.per_element_keys()
    for batch in view.load(optimizer=optimizer is not None):
        targets: dict[str, Any] = {}
        writes: list[tuple[Callable[..., None], Any]] = []
        for pv in batch:
            assert pv.part is not None  # a batch holds the parameters with a part here
            if left_out and all(n in left_out for n in pv.names):
                continue
            name = next((n for n in pv.names if n in stored), pv.name)
            buffer = pv.part.buffer()
            targets[model_prefix + name] = LocalChunks(
                pv.shape, pv.part.dtype, pv.part.offset, pv.part.numel, target=buffer
            )
            writes.append((pv.part.write, buffer))
            keys = optimizer_keys.get(pv.name) if optimizer_keys is not None and pv.group is not None else None
            for key in keys or ():
                ckpt_key = f"{optimizer_prefix}state.{pv.name}.{key}"
                if key in per_element:
                    part = pv.state_part(key)
                    state_buffer = part.buffer()
                    targets[ckpt_key] = LocalChunks(
                        pv.shape, torch.float32, part.offset, part.numel, target=state_buffer
                    )
                    writes.append((part.write, state_buffer))
                else:
                    targets[ckpt_key] = target = scalar_target(ckpt_key)
                    writes.append((lambda value, pv=pv, key=key: pv.write_scalar(key, _value(value)), target))
        _read_agreed(read, targets, agree_errors)
        for write, value in writes:
            write(value)
    if optimizer is not None and param_groups is not None:
        view.set_hyperparameters(param_groups)


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
        index, name = key[len(prefix + "param_groups.") :].split(".", 1)
        groups.setdefault(int(index), {})[name] = target.value
    return [groups[i] for i in sorted(groups)]


def _optimizer_plan(engine: ShardedParts, opened: Opened, prefix: str, groups: list[dict]) -> tuple[dict, list[str]]:
    """name -> state keys in the checkpoint, and what does not match this optimizer."""
    view = ShardedView(engine.parts, engine.optimizer)
    optimizer = view.optimizer
    assert optimizer is not None
    errors: list[str] = []
    if len(groups) != len(optimizer.param_groups):
        errors.append(
            f"the checkpoint's optimizer has {len(groups)} param group(s), this one "
            f"{len(optimizer.param_groups)}: configure_optimizers must build the same groups."
        )
        return {}, errors
    shapes = {pv.name: pv.shape for pv in view.params}
    per_element = view.per_element_keys()
    keys: dict[str, list[str]] = {}
    stored = opened.keys()
    base = prefix + "state."
    by_name: dict[str, list[str]] = {}
    for key in stored:
        if key.startswith(base):
            head, _, last = key[len(base) :].rpartition(".")
            by_name.setdefault(head, []).append(last)
    for name, shape in shapes.items():
        found = by_name.get(name)
        if not found:
            continue
        keys[name] = sorted(found)
        if per_element and not per_element <= set(found):
            errors.append(
                f"the checkpoint's optimizer state of {name!r} has {sorted(found)}, this "
                f"{type(optimizer).__name__} keeps {sorted(per_element)}: it was saved with another "
                "optimizer."
            )
        for k in per_element & set(found):
            md = stored[base + name + "." + k]
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(shape):
                errors.append(
                    f"the checkpoint's optimizer state {name}.{k} has shape "
                    f"{tuple(getattr(md, 'size', ()))}, the parameter's is {tuple(shape)}."
                )
    for g, (mine, saved) in enumerate(zip(view.groups(), groups)):
        members = set(saved.get("params", []))
        outside = sorted({pv.name for pv in mine} - members)
        if members and outside:
            errors.append(
                f"param group {g} of this optimizer holds {outside[:4]}, which the checkpoint's group {g} "
                "does not: configure_optimizers must put the same parameters in the same groups."
            )
    return keys, errors


def load_engine(
    engine: ShardedParts,
    path: Path,
    *,
    load_optimizer: bool = True,
    strict: bool = True,
    opened: Optional[Opened] = None,
    moved: bool = False,
) -> Any:
    """Collective: validate ``path`` against ``engine`` on every rank, then load this rank's part of the
    model (and, if ``load_optimizer`` and the engine has an optimizer, its state). Returns the trainer
    state the checkpoint holds (``{}`` for a foreign DCP checkpoint). ``moved``: where a callback had moved
    the module's state to another entry (``store.moved_entries``), that entry and ``state_dict`` are added
    to the trainer state in full (every rank reads them whole, as from a single file), for the callback's
    load hook; the engine takes ``state_dict``, as from any checkpoint."""
    group = checkpoint_group()
    if opened is not None:
        return _load_opened(engine, opened, group, load_optimizer, strict, moved)
    opened = open_checkpoint(Path(path), group)
    try:
        return _load_opened(engine, opened, group, load_optimizer, strict, moved)
    finally:
        opened.close()


def _read_whole(opened: Opened, entries: list[str], group: Any) -> dict[str, dict[str, Tensor]]:
    """Every tensor under each of the top-level ``entries``, whole, by name (collective: the ranks agree)."""
    out: dict[str, dict[str, Tensor]] = {entry: {} for entry in entries}
    targets: dict[str, Any] = {}
    for key, md in opened.keys().items():
        entry, _, name = key.partition(".")
        if entry in out and isinstance(md, TensorStorageMetadata):
            out[entry][name] = targets[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    _read_agreed(
        lambda t: read_entries(opened.reader, t),
        targets,
        lambda errs: agree(errs, f"Loading checkpoint {opened.path}", group),
    )
    return out


def frozen_left_out(engine: ShardedParts, opened: Opened, expected: dict[str, Any]) -> tuple[frozenset[str], list[str]]:
    """The entries of ``expected`` (``model_entries``) that a checkpoint saved with ``exclude_frozen`` lacks: named in
    its manifest (``FROZEN_EXCLUDED``) and absent from it. Returns those frozen in this model too (absent on purpose:
    they keep the values the model holds) and, sorted, those trainable here (their values would be missing)."""
    record = opened.manifest.extra.get(FROZEN_EXCLUDED) if opened.manifest is not None else None
    if not isinstance(record, list):
        return frozenset(), []
    stored = opened.keys()  # a checkpoint with a manifest is ZeroQ's: its model is under MODEL_KEY
    absent = {
        name for name in record if isinstance(name, str) and name in expected and f"{MODEL_KEY}.{name}" not in stored
    }
    frozen = set(ShardedView(engine.parts, engine.optimizer).frozen_names())
    return frozenset(absent & frozen), sorted(absent - frozen)


def _trainable_left_out(path: Path, names: list[str]) -> list[str]:
    if not names:
        return []
    return [
        (
            f"the model: {path} was saved with exclude_frozen_parameters=True, so it lacks {len(names)} parameter(s) "
            f"that were frozen then and are trainable in this model: {names[:6]}{' ...' if len(names) > 6 else ''}. "
            "Freeze them again (requires_grad=False) before the load, or resume from a checkpoint saved with "
            "exclude_frozen_parameters=False."
        )
    ]


def _load_opened(
    engine: ShardedParts, opened: Opened, group: Any, load_optimizer: bool, strict: bool, moved: bool = False
) -> Any:
    expected = model_entries(engine)
    left_out, trainable = frozen_left_out(engine, opened, expected)
    errors = _trainable_left_out(opened.path, trainable)
    expected = {k: v for k, v in expected.items() if k not in left_out and k not in trainable}  # said above
    model_prefix = _prefix(opened, MODEL_PREFIXES, list(expected)[:8])
    errors += check_entries(opened, expected, strict=strict, prefix=model_prefix, what="the model")
    optimizer_prefix = optimizer_keys = groups = None
    if load_optimizer and engine.optimizer is not None:
        optimizer_prefix = _optimizer_prefix(opened)
        if optimizer_prefix is None:
            errors.append(
                f"{opened.path} has no optimizer state (it holds weights only); resume from a checkpoint "
                "saved with the optimizer, or load these weights into the module before fit()."
            )
        else:
            try:
                groups = _read_param_groups(opened, optimizer_prefix)
                saved_kind = opened.manifest.extra.get(OPTIMIZER_CLASS) if opened.manifest is not None else None
                more = optimizer_kind_errors(
                    engine.optimizer, saved_kind if isinstance(saved_kind, str) else None, groups
                )
                if not more:
                    optimizer_keys, more = _optimizer_plan(engine, opened, optimizer_prefix, groups)
                errors += more
            except Exception as error:
                errors.append(describe(error))
    agree(errors, f"Loading checkpoint {opened.path}", group)
    stored = {k[len(model_prefix) :] for k in opened.keys() if k.startswith(model_prefix)}

    def scalar_target(key: str) -> Any:
        md = opened.keys()[key]
        if isinstance(md, BytesStorageMetadata):
            return BytesTarget()
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)

    errors = []
    try:
        load_sharded(
            engine,
            lambda targets: read_entries(opened.reader, targets),
            model_prefix=model_prefix,
            stored=stored,
            optimizer_prefix=optimizer_prefix,
            optimizer_keys=optimizer_keys,
            param_groups=groups,
            scalar_target=scalar_target,
            agree_errors=lambda errs: agree(errs, f"Loading checkpoint {opened.path}", group),
            left_out=left_out,
        )
    except CheckpointError:  # agreed: every rank raises it
        raise
    except Exception as error:
        errors.append(f"{describe(error)} (the state of this rank may be partly loaded: do not train on)")
    agree(errors, f"Loading checkpoint {opened.path}", group)
    state = opened.trainer_state()
    entries = moved_entries(opened.keys()) if moved and opened.manifest is not None else []
    if entries and isinstance(state, dict):
        state = {**state, **_read_whole(opened, [MODEL_KEY, *entries], group)}
    return state
