"""An engine's state as the checkpoint format sees it: full-shape chunks, any world size.

- ``sharded_model_state`` / ``sharded_optimizer_state``: this rank's part of every parameter and of
  every per-element optimizer state tensor as ``LocalChunks`` of the full shape, keyed like
  ``state_dict()`` and ``get_optimizer_state_dict``; nothing is copied: the data is read when the
  writer reaches it, after ``Residency.ensure`` made its unit resident (NVMe: one unit at a time).
- ``load_sharded``: read this rank's part of every parameter and optimizer state from a checkpoint
  of any world size, unit layout or stage (``read`` fills targets), unit by unit, and republish.
- ``model_entries``: what a checkpoint must hold for a model (names, shapes, dtypes).
- ``full_optimizer_state``: collective, every parameter's optimizer state at full shape (tests, exports).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq.checkpoint.agree import describe
from lightning_zeroq.checkpoint.chunks import BytesTarget, LocalChunks
from lightning_zeroq.zero import access, comm
from lightning_zeroq.zero.offload import OptimizerPlacement
from lightning_zeroq.zero.offload.nvme import per_element_state_keys
from lightning_zeroq.zero.state_dict import ShardedParts, parameter_names, unit_parameter_names
from lightning_zeroq.zero.unit import Unit


class Residency:
    """Walks ``placement.resident`` lazily: ``ensure(i)`` makes unit ``i`` resident (units in
    increasing index only), ``close()`` finishes the walk (NVMe writes the last units back)."""

    def __init__(self, engine: ShardedParts) -> None:
        self._walk = engine.placement.resident(engine.units)
        self.current = -1

    def ensure(self, index: int) -> None:
        while self.current < index:
            self.current = next(self._walk).index
        assert self.current == index, f"unit {index} requested after unit {self.current}"

    def close(self) -> None:
        for _ in self._walk:
            pass


def per_element_keys(optimizer: torch.optim.Optimizer) -> set[str]:
    cached = getattr(optimizer, "_zeroq_per_element_keys", None)
    if cached is None:
        cached = set(per_element_state_keys(optimizer))
        optimizer._zeroq_per_element_keys = cached  # type: ignore[attr-defined]
    return cached


def sharded_model_state(engine: ShardedParts) -> dict[str, Any]:
    """Every ``state_dict()`` entry: this rank's chunks of the fp32 masters (``LocalChunks``, read
    later), frozen parameters and buffers as they are (replicated: DCP writes them once)."""
    names = unit_parameter_names(engine)
    chunks: dict[str, Any] = {}
    for unit in engine.units:
        for seg in unit.segments:
            p = unit.params[seg.param]
            value = LocalChunks(p.shape, torch.float32, seg.param_start, seg.numel, order=unit.index,
                                read=lambda u=unit, s=seg: u.master[s.shard_span])
            for name in names.get(id(p), []):
                chunks[name] = value
        for i, p in enumerate(unit.params):
            if p.numel() == 0 and engine.rank == 0:  # no rank owns an element: rank 0 writes the empty tensor
                for name in names.get(id(p), []):
                    chunks[name] = torch.empty(p.shape)
    out: dict[str, Any] = {}
    managed = {n for u in engine.units for p in u.params for n in names.get(id(p), [])}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if key in chunks:
            out[key] = chunks[key]
        elif key not in managed:  # managed but owned by other ranks: they write it
            out[key] = value.detach() if isinstance(value, Tensor) else value
    return out


def sharded_optimizer_state(engine: ShardedParts) -> dict[str, Any]:
    """Collective on the engine's group (training's, on the calling thread, so it never meets an
    asynchronous save's collectives): ``{"state": {name: {key: value}}, "param_groups": [...]}`` as
    ``get_optimizer_state_dict`` has it: per-element state as ``LocalChunks`` of the parameter's
    shape, scalar state (Adam's ``step``) from the rank that owns the parameter's first element,
    ``param_groups`` with every parameter's canonical name (gathered from all ranks)."""
    optimizer = engine.optimizer
    assert optimizer is not None
    names = unit_parameter_names(engine)
    per_element = per_element_keys(optimizer)
    where = {id(view): (unit, seg) for unit in engine.units for seg, view in zip(unit.segments, unit.segment_masters)}
    state: dict[str, dict[str, Any]] = {}
    local_groups: list[list[str]] = []
    for group_ in optimizer.param_groups:
        local_groups.append([])
        for view in group_["params"]:
            unit, seg = where[id(view)]
            p = unit.params[seg.param]
            name = names[id(p)][0]
            local_groups[-1].append(name)
            entry: dict[str, Any] = {}
            for key, value in optimizer.state.get(view, {}).items():
                if key in per_element:
                    entry[key] = LocalChunks(p.shape, value.dtype, seg.param_start, seg.numel, order=unit.index,
                                             read=lambda v=view, k=key: optimizer.state[v][k])
                elif seg.param_start == 0:
                    entry[key] = value.detach().clone() if isinstance(value, Tensor) else value
            if entry:
                state[name] = entry
    everyone = [local_groups]
    if comm.is_distributed() and engine.world_size > 1:
        everyone = [None] * engine.world_size
        dist.all_gather_object(everyone, local_groups, group=engine.group)
    order = {n: i for i, n in enumerate(names_in_order(engine.module))}
    groups = []
    for g, group_ in enumerate(optimizer.param_groups):
        members = sorted({n for ranks in everyone for n in ranks[g]}, key=lambda n: order.get(n, len(order)))
        groups.append({**{k: v for k, v in group_.items() if k != "params"}, "params": members})
    return {"state": state, "param_groups": groups}


def names_in_order(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()]


def model_entries(engine: ShardedParts) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """What a checkpoint must hold for this model: name -> (shape, dtype); fp32 for the engine's."""
    names = parameter_names(engine.module)
    managed = {n: p.shape for u in engine.units for p in u.params for n in names.get(id(p), [])}
    return {key: (managed[key], torch.float32) if key in managed else (value.shape, value.dtype)
            for key, value in engine.module.state_dict(keep_vars=True).items() if isinstance(value, Tensor)}


def _read_settled(read: Callable[[dict], None], targets: dict, settle: Optional[Callable[[list[str]], None]]) -> None:
    """``read(targets)``, then ``settle`` (every rank, whatever happened): a read that fails on one rank
    becomes the error every rank raises, before any rank enters a collective of the engine."""
    if settle is None:
        read(targets)
        return
    errors = []
    try:
        read(targets)
    except Exception as error:
        errors.append(describe(error))
    settle(errors)


def _commit(engine: ShardedParts, read: Callable[[dict], None], targets: dict, batch: list, group_of: dict,
            settle: Optional[Callable[[list[str]], None]]) -> None:
    _read_settled(read, targets, settle)
    for unit, pending in batch:
        for view, entry in pending:
            engine.optimizer.state[view] = {k: _loaded_value(v, group_of[id(view)], view) for k, v in entry.items()}
        access.publish_loaded(engine, unit)


def _step_device(group: dict, view: Tensor) -> torch.device:
    return view.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


KERNEL_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})
"""Param-group entries that choose how the step runs, not what it computes: they belong to this run
(the offload placement sets ``fused`` for the host step), so a load keeps the live ones. Copying a
checkpoint's would, e.g., turn on a fused CPU kernel that the device has not (fused Adagrad on CUDA)."""


@torch.no_grad()
def load_sharded(engine: ShardedParts, read: Callable[[dict], None], *, model_prefix: str,
                 stored: set[str], optimizer_prefix: Optional[str] = None,
                 optimizer_keys: Optional[dict[str, list[str]]] = None,
                 param_groups: Optional[list[dict]] = None,
                 scalar_target: Callable[[str], Any] = lambda key: BytesTarget(),
                 settle: Optional[Callable[[list[str]], None]] = None) -> None:
    """Read this rank's part of every entry, unit by unit (``read(targets)`` fills a dict of checkpoint
    key -> ``LocalChunks``/tensor/``BytesTarget``). ``stored``: the checkpoint's keys without the
    model prefix (a tied parameter is read under whichever of its names is there).
    ``optimizer_keys``: name -> state keys in the checkpoint, if the optimizer state is to be loaded;
    ``scalar_target(key)``: what to read a non-per-element state entry into (a 0-d tensor or a
    ``BytesTarget``, as the checkpoint stores it). ``settle(errors)``: collective, called by every rank
    after each read with what failed there (raises the agreed error on every rank, e.g. ``agree``):
    every read is settled before the units it filled are published (the engine's collectives), so a
    rank whose read fails never leaves the others in a gather."""
    names = parameter_names(engine.module)
    managed = {n for u in engine.units for p in u.params for n in names.get(id(p), [])}
    rest = {model_prefix + k: v.detach() for k, v in engine.module.state_dict(keep_vars=True).items()
            if k not in managed and isinstance(v, Tensor)}
    _read_settled(read, rest, settle)
    optimizer = engine.optimizer if optimizer_keys is not None else None
    group_of: dict[int, dict] = {}
    if optimizer is not None:
        group_of = {id(v): g for g in optimizer.param_groups for v in g["params"]}
        optimizer.state.clear()
        engine.placement.state_loaded(optimizer)  # before the walk: NVMe writes the new state as it goes
    # Placements that keep every unit resident are read in one go (fewer, larger reads); NVMe, whose
    # units come and go, unit by unit.
    at_once = type(engine.placement).resident is OptimizerPlacement.resident
    batch: list[tuple[Unit, list]] = []
    targets: dict[str, Any] = {}
    for unit in engine.placement.resident(engine.units):
        pending = []
        for seg, view in zip(unit.segments, unit.segment_masters):
            p = unit.params[seg.param]
            aliases = names.get(id(p), [])
            name = next((n for n in aliases if n in stored), aliases[0])
            targets[model_prefix + name] = LocalChunks(p.shape, torch.float32, seg.param_start, seg.numel,
                                                       target=unit.master[seg.shard_span])
            keys = optimizer_keys.get(aliases[0]) if optimizer is not None and id(view) in group_of else None
            if keys:
                entry = {}
                for key in keys:
                    ckpt_key = f"{optimizer_prefix}state.{aliases[0]}.{key}"
                    if key in per_element_keys(optimizer):
                        target = LocalChunks(p.shape, torch.float32, seg.param_start, seg.numel,
                                             target=torch.empty(seg.numel, dtype=torch.float32, device=view.device))
                    else:
                        target = scalar_target(ckpt_key)
                    entry[key] = targets[ckpt_key] = target
                pending.append((view, entry))
        batch.append((unit, pending))
        if not at_once:
            _commit(engine, read, targets, batch, group_of, settle)
            targets, batch = {}, []
    if batch:
        _commit(engine, read, targets, batch, group_of, settle)
    if optimizer is not None and param_groups is not None:
        for group_, saved in zip(optimizer.param_groups, param_groups):
            group_.update({k: v for k, v in saved.items() if k != "params" and k not in KERNEL_CHOICES})


def _loaded_value(target: Any, group: dict, view: Tensor) -> Any:
    if isinstance(target, LocalChunks):
        return target.target
    value = target.value if isinstance(target, BytesTarget) else target
    if isinstance(value, Tensor):
        return value.to(dtype=torch.float32, device=_step_device(group, view)) if value.is_floating_point() else value
    return value


def full_optimizer_state(engine: ShardedParts) -> dict[str, dict[str, Any]]:
    """Collective (tests, exports): every parameter's optimizer state at full shape on every rank."""
    optimizer = engine.optimizer
    assert optimizer is not None
    names = parameter_names(engine.module)
    per_element = per_element_keys(optimizer)
    local: dict[str, dict[str, Any]] = {}
    for unit in engine.placement.resident(engine.units):
        for seg, view in zip(unit.segments, unit.segment_masters):
            name = names[id(unit.params[seg.param])][0]
            for key, value in optimizer.state.get(view, {}).items():
                entry = local.setdefault(name, {})
                if key in per_element:
                    entry.setdefault(key, []).append((seg.param_start, value.detach().cpu().clone()))
                else:
                    entry[key] = value.detach().cpu().clone() if isinstance(value, Tensor) else value
    everyone = [local]
    if comm.is_distributed() and engine.world_size > 1:
        everyone = [None] * engine.world_size
        dist.all_gather_object(everyone, local, group=engine.group)
    shapes = {names[id(p)][0]: p.shape for u in engine.units for p in u.params}
    out: dict[str, dict[str, Any]] = {}
    for rank_state in everyone:
        for name, entry in rank_state.items():
            merged = out.setdefault(name, {})
            for key, value in entry.items():
                if key in per_element:
                    full = merged.setdefault(key, torch.zeros(shapes[name]))
                    for start, part in value:
                        full.view(-1)[start:start + part.numel()] = part
                else:
                    merged[key] = value
    return out
