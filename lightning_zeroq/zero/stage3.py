"""ZeRO stage 3: which modules become units, and when their parameters are gathered and freed.

Units. By default one unit per repeated block (the instances of the class that holds the most
parameters among the children of ``nn.ModuleList``/``nn.Sequential`` containers: the transformer
layers), found automatically; or the instances of ``stage3_wrap_classes``; or, with
``stage3_unit_size``, any module whose not-yet-wrapped parameters reach that many elements. The
remaining parameters form the *root* unit, and parameters of at most
``stage3_param_persistence_threshold`` elements form a *persistent* unit; both stay gathered, like
stage 1/2 units (the root holds embeddings and the head, used at both ends of every step).

Lifetimes of a transient unit (the parameters are views into its flat buffer, whose *storage* is
freed and re-allocated, so shapes and the views saved by autograd stay valid):

- forward: a pre-hook on the unit's module gathers it (waiting for a prefetch if one was issued)
  and prefetches the next unit of the recorded order; a post-hook frees it and hooks the outputs,
  so the first gradient to reach them gathers it again for backward.
- backward: the engine reduce-scatters the unit's gradients once all of them are accumulated
  (``ZeroEngine._reduce``), then frees it; units left gathered are freed when the backward ends.

Order. The first forward records the order in which units are gathered; later forwards prefetch
the next unit from that order (backward: the reverse). A unit that arrives out of order is gathered
on demand, the order is re-recorded, and a warning is given once: control flow may change freely.
On CPU the "prefetch" is a synchronous gather done early, which keeps the logic exercised by tests.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from lightning_zeroq.zero.engine import ZeroEngine, _Unit


class UnitSpec(NamedTuple):
    params: list[nn.Parameter]
    module: Optional[nn.Module]
    """The module whose forward uses the unit (``None``: root or persistent, always gathered)."""
    persistent: bool


def _containers_children(module: nn.Module) -> list[nn.Module]:
    out = []
    for m in module.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            out.extend(m.children())
    return out


def auto_wrap_classes(module: nn.Module) -> set[type]:
    """The class of the repeated blocks: most parameters among children of module containers."""
    counts: Counter[type] = Counter()
    sizes: Counter[type] = Counter()
    for child in _containers_children(module):
        numel = sum(p.numel() for p in child.parameters())
        if numel:
            counts[type(child)] += 1
            sizes[type(child)] += numel
    repeated = [cls for cls in counts if counts[cls] >= 2]
    return {max(repeated, key=lambda c: sizes[c])} if repeated else set()


def plan_module_units(
    module: nn.Module,
    trainable: Sequence[nn.Parameter],
    *,
    wrap_classes: Optional[Sequence[str]],
    unit_size: Optional[int],
    persistence_threshold: int,
) -> list[UnitSpec]:
    """Units for stage 3, in module registration order (transient units first, then root, persistent)."""
    is_trainable = {id(p) for p in trainable}
    if wrap_classes:
        by_name = {type(m).__name__: type(m) for m in module.modules()}
        unknown = [name for name in wrap_classes if name not in by_name]
        if unknown:
            raise ValueError(
                f"stage3_wrap_classes={list(wrap_classes)}: no module of class {unknown} in the model; "
                f"classes present: {sorted(by_name)[:20]}."
            )
        classes = {by_name[name] for name in wrap_classes}
    else:
        classes = set() if unit_size else auto_wrap_classes(module)

    taken: set[int] = set()
    small = [p for p in trainable if p.numel() <= persistence_threshold]
    taken.update(id(p) for p in small)
    specs: list[UnitSpec] = []
    owners: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)

    def take(m: nn.Module) -> list[nn.Parameter]:
        # A parameter shared with a module outside ``m`` (tied weights) must be gathered whenever
        # either runs: it stays with the root unit instead.
        inside = {id(x) for x in m.modules()}
        params = [
            p
            for p in m.parameters()
            if id(p) in is_trainable and id(p) not in taken and all(id(o) in inside for o in owners[id(p)])
        ]
        taken.update(id(p) for p in params)
        return params

    if classes:
        for m in module.modules():
            if type(m) in classes and m is not module:
                params = take(m)
                if params:
                    specs.append(UnitSpec(params, m, False))
    else:
        for m in _post_order(module):
            if m is module:
                continue
            pending = [p for p in m.parameters() if id(p) in is_trainable and id(p) not in taken]
            if unit_size and pending and sum(p.numel() for p in pending) >= unit_size:
                params = take(m)
                if params:
                    specs.append(UnitSpec(params, m, False))
    root = [p for p in trainable if id(p) not in taken]
    if root:
        specs.append(UnitSpec(root, None, True))
    if small:
        specs.append(UnitSpec(small, None, True))
    return specs


def _post_order(module: nn.Module) -> list[nn.Module]:
    out = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


class Stage3Coordinator:
    """Installs the module hooks of the transient units and runs gather/free/prefetch for them.

    Prefetch follows a successor map: for each unit, the unit that came next last time (one map for
    forward, one for backward). At most one prefetched, not yet used unit is held at a time.
    """

    def __init__(self, engine: "ZeroEngine", units: Sequence["_Unit"], prefetch: bool) -> None:
        self.engine = engine
        self.prefetch = prefetch
        self._next: dict[bool, dict[int, int]] = {False: {}, True: {}}  # backward? -> unit -> successor
        self._last: dict[bool, Optional[int]] = {False: None, True: None}
        self._prefetched: Optional["_Unit"] = None
        self._warned = False
        self._handles = []
        for unit in units:
            if unit.persistent:
                continue
            assert unit.module is not None
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))

    def _use(self, unit: "_Unit", backward: bool) -> None:
        """Gather ``unit`` for use now; learn the order; prefetch the unit expected next."""
        last = self._last[backward]
        successors = self._next[backward]
        if last is not None and last != unit.index:
            expected = successors.get(last)
            if self.prefetch and expected is not None and expected != unit.index and not self._warned:
                warnings.warn(
                    "ZeroQ stage 3: the model took a different path than on the recorded step; its "
                    "units are gathered on demand and the new order is learned (not an error).",
                    stacklevel=3,
                )
                self._warned = True
            successors[last] = unit.index
        self._last[backward] = unit.index
        if self._prefetched is unit:
            self._prefetched = None
        self.engine.gather_unit(unit)
        nxt = successors.get(unit.index)
        if self.prefetch and nxt is not None and nxt != unit.index:
            self._prefetch(self.engine.units[nxt])

    def _prefetch(self, unit: "_Unit") -> None:
        if unit.gathered:
            return
        stale = self._prefetched
        if stale is not None and stale is not unit and stale.gathered:
            self.engine.free_unit(stale)  # a misprediction: hold at most one unused unit
        self.engine.gather_unit(unit, prefetch=True)
        self._prefetched = unit

    def end_backward(self) -> None:
        """The backward pass is over (all transient units are free again)."""
        self._last[True] = None
        self._prefetched = None

    def _make_pre_forward(self, unit: "_Unit"):
        def hook(module: nn.Module, args: Any) -> None:
            self._use(unit, backward=False)

        return hook

    def _make_post_forward(self, unit: "_Unit"):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            self.engine.free_unit(unit)
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(unit))
            return output

        return hook

    def _make_pre_backward(self, unit: "_Unit"):
        def hook(grad: torch.Tensor) -> None:
            if not unit.reduced:
                self._use(unit, backward=True)

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
