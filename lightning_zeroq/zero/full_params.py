"""The full parameters outside forward and backward: for a while (``gathered_parameters``) or for good
(``release_module``, the strategy's teardown).

``gathered_parameters(module, writeback=False)``: a collective context manager (every rank enters
it). Inside, every parameter of ``module`` (the whole model by default) is a plain tensor holding its
full fp32 master values (stage 3's frozen parameters: their own values, in their own dtype), gathered unit by unit; with ``writeback=True`` what the caller changed is
written into the master shards on exit (each rank its own shard, as FSDP's ``summon_full_params``
does) and the working weights are republished. Outside, stage-3 parameters are ``FreedParameter``s
again, and stage 1/2 parameters views of their working buffers. Costs 4 bytes per gathered
parameter on every rank while inside: pass a submodule to gather less.

``release_module(dtype, device)``: hands the module back as a plain module: hooks removed, every
parameter an ordinary tensor (stage 3's frozen ones whole again, in their own dtype), every
trainable one with the trained values (in the dtype it had when the engine
took it, unless ``dtype`` says otherwise), so a second ``fit``, another strategy or plain PyTorch can
use it. What a callback or hook wrote into the parameters after the last step (a weight average copied
in at the end of training) is kept, and the master shards take it too: only where the module still
holds what the engine last published do the masters' full values replace it (with bf16 working weights,
an element written there is handed back as written, widened). The engine keeps its master shards and optimizer state (state dicts and checkpoints still
read them) and frees everything else; it cannot train any more.

``take_writes(parts)``: before anything reads the masters (each backward's start, the step, a save,
``gathered_parameters``), what a callback or hook wrote in place into the working parameters since the
engine last published them (their version counters moved past ``Unit.marks``) becomes the masters where
they can hold it exactly (fp32 working weights at full width); elsewhere the step refuses it on every rank
(``refused_writes``), since the working weights are rounded copies of the masters.

``publish_loaded(parts, unit)``: after a load changed ``unit``'s master shards, bring what uses them
up to date: the working weights of a training engine, or (collective) the plain parameters of a
module already handed back, which evaluation after fit (``trainer.test(ckpt_path=...)``) runs;
``publish_frozen_loaded`` does the same for a stage-3 frozen part's stored shards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.build import Parts
from lightning_zeroq.zero.unit import Unit, UnitState
from lightning_zeroq.zero.wire import FullWidth


def _full_masters(parts: Parts, unit: Unit) -> Tensor:
    full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=parts.device)
    comm.all_gather(full, parts.placement.device_master(unit), parts.group)
    return full


@torch.no_grad()
def publish_loaded(parts: Parts, unit: Unit) -> None:
    if not parts.retired:
        parts.gatherer.publish(unit)
        return
    full = _full_masters(parts, unit)
    for p, slot in zip(unit.params, unit.layout.slots):
        p.data = full[slot.span].view(p.shape).to(device=p.device, dtype=p.dtype, copy=True)


def check_module(call: str, module: Any, optional: bool = False) -> None:
    """``TypeError`` naming ``call`` unless ``module`` is an ``nn.Module`` (or, ``optional``, None)."""
    if not isinstance(module, nn.Module) and not (optional and module is None):
        raise TypeError(
            f"{call}(module) takes the nn.Module whose parameters to gather (e.g. the model or one of "
            f"its submodules), got {type(module).__name__} {module!r}."
        )


@contextlib.contextmanager
@torch.no_grad()
def gathered_parameters(parts: Parts, module: Optional[nn.Module] = None, writeback: bool = False) -> Iterator[None]:
    ids = {id(p) for p in (module or parts.module).parameters()}
    chosen = [u for u in parts.units if any(id(p) in ids for p in u.params)]
    held = [part for part in frozen_parts(parts) if any(id(p) in ids for p in part.params)]
    parts.reducer.wait()
    take_writes(parts, chosen)  # a write made before the block reaches the masters it gathers (fp32)
    # What the block writes goes into the gathered masters, not the working weights: marked on the way out.
    # A write from before it that the masters could not take stays owed (the next step refuses it).
    owed = {u.index: [now - then for now, then in zip(u.versions(), u.marks)] for u in chosen if u.persistent}
    fulls: dict[int, Tensor] = {}
    for unit in parts.placement.resident(chosen):
        fulls[unit.index] = full = _full_masters(parts, unit)
        for p, slot, cls in zip(unit.params, unit.layout.slots, unit.param_classes):
            p.__class__ = cls
            p.data = full[slot.span].view(p.shape)
    was = [frozen_gather(parts, part) for part in held]  # their own values, gathered as a forward gathers them
    ok = False
    try:
        yield
        ok = True
    finally:
        if ok and writeback:
            rank = rank_and_size(parts.group)[0]
            for part in held:
                frozen_store(parts, part)
            for unit in parts.placement.resident(chosen):
                unit.master.copy_(fulls[unit.index][unit.layout.shard_span(rank)])
                parts.gatherer.publish(unit)
        for part, sharded in zip(held, was):
            frozen_release(parts, part, sharded)
        for unit in chosen:
            if unit.state is UnitState.SHARDED:
                unit.release_storage()
            else:
                for p, slot in zip(unit.params, unit.layout.slots):
                    p.data = unit.flat[slot.span].view(p.shape)
            if unit.index in owed:
                unit.marks = tuple(now - back for now, back in zip(unit.versions(), owed[unit.index]))


def frozen_parts(parts: Parts) -> list[Unit]:
    """Stage 3's frozen parts (``frozen.py``): those of units and those of modules with nothing to train; none
    once the module is handed back (``release_module`` made their parameters whole again)."""
    return parts.frozen.units if parts.frozen is not None and not parts.retired else []


def frozen_gather(parts: Parts, part: Unit) -> bool:
    """Collective: a frozen part gathered (its parameters hold their values) until ``frozen_release``; returns
    whether it was sharded before."""
    assert parts.frozen is not None
    was = part.state is UnitState.SHARDED
    parts.frozen.gatherer.gather(part)
    return was


def frozen_store(parts: Parts, part: Unit) -> None:
    """What the gathered frozen part holds now becomes its stored shard (each rank its own)."""
    assert parts.frozen is not None
    parts.frozen.codec.store(part, part.flat[part.layout.shard_span(rank_and_size(parts.group)[0])])
    if not parts.frozen.codec.exact:
        parts.frozen.gatherer.free(part)  # what a gather makes of what rests


def frozen_release(parts: Parts, part: Unit, was_sharded: bool) -> None:
    """Free a frozen part again, unless what uses it holds it gathered: its unit (in use), or, for a part of
    its own, whoever had gathered it before ``frozen_gather``."""
    assert parts.frozen is not None
    owner = parts.frozen.owner.get(part.index)
    keep = owner.state is not UnitState.SHARDED if owner is not None else not was_sharded
    if not keep:
        parts.frozen.gatherer.free(part)
    elif part.state is UnitState.SHARDED:
        parts.frozen.gatherer.gather(part)


def takes_writes(parts: Parts) -> bool:
    """Whether a write into the working parameters between steps can become the masters exactly: fp32
    working weights at full width, where each rank's slice of its working buffer is its master shard, bit
    for bit. (bf16/fp16 working weights, or INT8 on the wire, hold less than the masters.)"""
    return isinstance(parts.gatherer.wire, FullWidth) and parts.param_dtype == torch.float32


@torch.no_grad()
def take_writes(parts: Parts, units: Optional[Sequence[Unit]] = None) -> list[int]:
    """What was written in place into the working parameters of ``units`` (default: all) since the engine
    last published them (``Unit.written``: a callback's or hook's ``p.mul_`` between steps, a clamp, a
    mask), before anything reads the masters. Where the engine ``takes_writes``, each rank's slice of its
    working buffer becomes its master shard (every rank holds the whole written unit; a write made on some
    ranks only lands in the shards those ranks own, as with ``gathered_parameters(writeback=True)``), so
    the next step starts from the write as DDP's would. Otherwise nothing changes here, and the ids of the
    written parameters come back: the step refuses them, on every rank (``Reducer.finalize`` agrees on
    them). Costs a look at each parameter's version counter; a walk over the written units' masters only."""
    if parts.retired:
        return []
    written = [
        (unit, found)
        for unit in (parts.units if units is None else units)
        if unit.persistent and (found := unit.written())
    ]
    if not written:
        return []
    if not takes_writes(parts):
        return [unit.param_id(i) for unit, found in written for i in found]
    rank = rank_and_size(parts.group)[0]
    for unit in parts.placement.resident([unit for unit, _ in written]):
        unit.master.copy_(unit.flat[unit.layout.shard_span(rank)])
        unit.mark()
    return []


def refused_writes(parts: Parts, param_ids: Sequence[int], ranks: Sequence[int]) -> str:
    """The one-line error for writes ``take_writes`` could not take (``ranks``: where they were made)."""
    ids = set(param_ids)
    names = [
        parts.param_names.get(id(p), "?") for u in parts.units for i, p in enumerate(u.params) if u.param_id(i) in ids
    ]
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    held = "INT8-gathered" if not isinstance(parts.gatherer.wire, FullWidth) else str(parts.param_dtype).split(".")[-1]
    return (
        f"ZeroQ: {listed} {'was' if len(names) == 1 else 'were'} written in place between optimizer steps "
        f"(on rank(s) {list(ranks)}: a callback or hook?), but the working weights are {held} copies of the "
        "fp32 masters the step reads: the step would undo the write, and taking it would drop the masters' low "
        "bits. Write them inside `with lightning_zeroq.gathered_parameters(module, writeback=True):` (every "
        "rank enters it), which writes the fp32 masters."
    )


def module_holds_masters(parts: Parts) -> bool:
    """Whether, between steps, every parameter the engine shards is a plain tensor with its master's full
    fp32 values in the module: fp32 working weights, travelling at full width, in units that are never
    freed (stages 1 and 2; stage 3 where every unit is persistent). Otherwise code that reads or writes
    the weights outside forward and backward needs ``gathered_parameters``."""
    return isinstance(parts.gatherer.wire, FullWidth) and all(
        u.persistent and u.flat.dtype == torch.float32 for u in parts.units
    )


@torch.no_grad()
def release_module(parts: Parts, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
    parts.reducer.clear()
    parts.reducer.close()  # the gradient hooks and (stage 3) the module hooks
    if parts.activations is not None:
        parts.activations.close()  # each module's own forward again
    target = device or parts.device
    rank = rank_and_size(parts.group)[0]
    for unit in parts.placement.resident(parts.units):
        full = _full_masters(parts, unit)
        if unit.state is UnitState.GATHERED:
            full = _keep_written(parts, unit, full, rank)
        for p, slot, cls, own in zip(unit.params, unit.layout.slots, unit.param_classes, unit.param_dtypes):
            p.__class__ = cls
            p.data = full[slot.span].view(p.shape).to(device=target, dtype=dtype or own, copy=True)
        unit.flat = unit.grad = torch.empty(0, device=parts.device)
        unit.state = UnitState.SHARDED
    for part in frozen_parts(parts):  # whole again, in their own dtype
        frozen_gather(parts, part)
        for p, slot, cls in zip(part.params, part.layout.slots, part.param_classes):
            p.__class__ = cls
            p.data = part.flat[slot.span].view(p.shape).to(device=target, copy=True)
        part.flat = torch.empty(0, device=parts.device)
        part.state = UnitState.SHARDED
    parts.gatherer.close()
    parts.gatherer.store = None


def _keep_written(parts: Parts, unit: Unit, full: Tensor, rank: int) -> Tensor:
    """The full parameters to hand back: the masters, except where the module's working buffer no longer
    holds what the engine last published there (a callback or hook wrote it after the last step, e.g. a
    weight average copied in at the end of training): there, what the module holds, which the master
    shard takes too (each rank its own, as ``gathered_parameters(writeback=True)``). What was published is
    made again from the masters (a gather is deterministic), one unit at a time."""
    held = unit.flat
    unit.flat = published = torch.empty_like(held)
    try:
        parts.gatherer.wire.sync(unit, parts.placement)
    finally:
        unit.flat = held
    written = held != published
    if not bool(written.any()):
        return full
    full = torch.where(written, held.to(full.dtype), full)
    unit.master.copy_(full[unit.layout.shard_span(rank)])
    return full
