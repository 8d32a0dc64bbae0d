"""Full and sharded state of an engine: what checkpoints, exports and tests read and write.

- ``full_state_dict``: collective; the full fp32 parameters by name (CPU tensors), gathered unit by
  unit from the master shards, on every rank or (``rank0_only``) on rank 0 only, whose host then
  holds one copy of the model and no rank ever holds two; frozen parameters are included as they are.
- ``load_full_state_dict``: every rank sets its own slice of each master from full parameters by
  name, then republishes the working weights. No collective but the publish.
- ``sharded_state_dict`` / ``load_sharded_state_dict``: the former per-rank format (same world size
  and units only); kept for the engine's API, unused by the strategy.

The checkpoint format's view of the same state (full-shape chunks, any world size) is
``lightning_zeroq/checkpoint/engine_state.py``.

With NVMe offload the masters are walked through the placement's ``resident`` iterator, so one unit
at a time is in memory.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq.zero import access, comm
from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.loss_scaler import DynamicLossScaler
from lightning_zeroq.zero.offload import OptimizerPlacement
from lightning_zeroq.zero.unit import Unit


class ShardedParts(Protocol):
    """What these functions need of an engine (``ZeroEngine`` provides it)."""

    module: nn.Module
    units: list[Unit]
    placement: OptimizerPlacement
    gatherer: Gatherer
    optimizer: Optional[torch.optim.Optimizer]
    loss_scaler: Optional[DynamicLossScaler]
    rank: int
    world_size: int
    group: Optional[dist.ProcessGroup]
    device: torch.device


def _named_managed(engine: ShardedParts) -> Iterator[tuple[list[str], Unit, int]]:
    """(every name of the parameter, its unit, its index in the unit), for the engine's parameters."""
    names = parameter_names(engine.module)
    for unit in engine.units:
        for i, p in enumerate(unit.params):
            yield names.get(id(p), []), unit, i


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name of it (tied parameters have several; the first is canonical, as
    ``named_parameters()`` and ``get_optimizer_state_dict`` use it)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def unit_parameter_names(engine: ShardedParts) -> dict[int, list[str]]:
    """``parameter_names`` for checkpoints: every parameter of every unit must have a name (units and
    the module share their ``nn.Parameter`` objects; replacing them would lose the link)."""
    names = parameter_names(engine.module)
    lost = [(u.index, i) for u in engine.units for i, p in enumerate(u.params) if id(p) not in names]
    if lost:
        raise RuntimeError(f"{len(lost)} parameter(s) of the engine's units (unit, index: {lost[:4]}) are no longer "
                           "parameters of the module (were they replaced?); their checkpoint names are unknown.")
    return names


@torch.no_grad()
def full_state_dict(engine: ShardedParts, rank0_only: bool = False) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    if rank0_only and getattr(engine, "replica_rank", 0) != 0:
        return {}  # hybrid groups: the first group gathers; the others hold the same values
    names = parameter_names(engine.module)
    root = dist.get_global_rank(engine.group, 0) if engine.group is not None and engine.world_size > 1 else 0
    for unit in engine.placement.resident(engine.units):
        shard = engine.placement.device_master(unit)
        if rank0_only and engine.world_size > 1:
            chunks = [torch.empty_like(shard) for _ in range(engine.world_size)] if engine.rank == 0 else None
            dist.gather(shard, chunks, dst=root, group=engine.group)
            if engine.rank != 0:
                continue
            full = torch.cat(chunks).cpu()
            del chunks
        else:
            full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=engine.device)
            comm.all_gather(full, shard, engine.group)
            full = full.cpu()
        for i, p in enumerate(unit.params):
            value = full[unit.layout.slots[i].span].view(p.shape).clone()
            for name in names.get(id(p), []):
                out[name] = value
        del full
    if rank0_only and engine.rank != 0:
        return {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if name not in out:
            out[name] = p.detach().float().cpu().clone()
    return out


@torch.no_grad()
def load_full_state_dict(engine: ShardedParts, state: dict[str, Tensor]) -> set[str]:
    """Returns the names of the engine's parameters (all aliases of tied ones). Every value found for
    one of them must have the parameter's shape (as ``nn.Module.load_state_dict`` requires, strict or
    not): a mismatch raises, naming each parameter and both shapes, before any master changes."""
    managed: set[str] = set()
    names_of: dict[int, list[list[str]]] = {u.index: [[] for _ in u.params] for u in engine.units}
    mismatched = []
    for names, owner, i in _named_managed(engine):
        names_of[owner.index][i] = names
        managed.update(names)
        shape = owner.params[i].shape
        mismatched += [f"{n}: checkpoint {tuple(state[n].shape)}, parameter {tuple(shape)}"
                       for n in names if n in state and tuple(state[n].shape) != tuple(shape)]
    if mismatched:
        raise RuntimeError("Error loading the state_dict: size mismatch for " + "; ".join(mismatched)
                           + ". The checkpoint belongs to a model of another shape; build the model it was saved from.")
    for unit in engine.placement.resident(engine.units):
        for seg in unit.segments:
            name = next((n for n in names_of[unit.index][seg.param] if n in state), None)
            if name is not None:
                unit.master[seg.shard_span].copy_(state[name].reshape(-1)[seg.param_span])
        access.publish_loaded(engine, unit)
    return managed


def load_module_state_dict(engine: ShardedParts, module: nn.Module, state: dict[str, Tensor]) -> tuple[list, list]:
    """``module.load_state_dict(state, strict=False)`` for a module whose parameters the engine
    manages: the engine's parameters go into the masters (shapes checked, see ``load_full_state_dict``),
    the rest (buffers, frozen parameters) into the module. Returns (missing, unexpected) keys as
    ``nn.Module.load_state_dict`` names them."""
    managed = load_full_state_dict(engine, state)
    missing, unexpected = module.load_state_dict({k: v for k, v in state.items() if k not in managed}, strict=False)
    return [k for k in missing if k not in managed] + sorted(k for k in managed if k not in state), list(unexpected)


def sharded_state_dict(engine: ShardedParts) -> dict[str, Any]:
    masters, state = [], {}
    optimizer = engine.optimizer
    for unit in engine.placement.resident(engine.units):  # with NVMe offload: one unit resident at a time
        masters.append(unit.master.detach().cpu().clone())
        if optimizer is not None:
            for view in unit.segment_masters:
                if view in optimizer.state:
                    state[id(view)] = {
                        k: v.clone() if isinstance(v, Tensor) else v for k, v in optimizer.state[view].items()
                    }
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = optimizer.state_dict()  # param_groups; state rebuilt from the clones
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer_state["state"] = {i: state[id(p)] for i, p in enumerate(params) if id(p) in state}
    return {
        "world_size": engine.world_size,
        "rank": engine.rank,
        "unit_numels": [u.layout.numel for u in engine.units],
        "masters": masters,
        "optimizer": optimizer_state,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
    }


@torch.no_grad()
def load_sharded_state_dict(engine: ShardedParts, state: dict[str, Any]) -> None:
    numels = [u.layout.numel for u in engine.units]
    if state["world_size"] != engine.world_size or state["unit_numels"] != numels:
        raise ValueError(
            f"This sharded checkpoint was written by {state['world_size']} ranks with units "
            f"{state['unit_numels'][:4]}...; this run has {engine.world_size} ranks and units {numels[:4]}... "
            "Resume with the same number of devices and the same reduce_bucket_size."
        )
    if engine.optimizer is not None and state["optimizer"] is not None:
        engine.optimizer.load_state_dict(state["optimizer"])
        engine.placement.state_loaded(engine.optimizer)  # it replaces the state swapped out to NVMe
    if engine.loss_scaler is not None and state["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
    for unit in engine.placement.resident(engine.units):
        unit.master.copy_(state["masters"][unit.index])
        access.publish_loaded(engine, unit)
