"""Which parameters form which unit, decided once when the engine is built.

Stages 1/2: consecutive trainable parameters in registration order, up to ``reduce_bucket_size``
elements per unit (``layout.plan_units``); every unit is persistent (always gathered).

Stage 3: by default one unit per repeated block (the instances of the class that holds the most
parameters among the children of ``nn.ModuleList``/``nn.Sequential`` containers: the transformer
layers), found automatically; or the instances of ``stage3_wrap_classes``; or, with
``stage3_unit_size``, any module whose not-yet-wrapped parameters reach that many elements. Those
units are *transient* (gathered before use, freed after). The remaining parameters form the *root*
unit, and parameters of at most ``stage3_param_persistence_threshold`` elements form a *persistent*
unit; both stay gathered, like stage 1/2 units (the root holds embeddings and the head, used at both
ends of every step).

Frozen parameters (``frozen``: those ``frozen.shardable`` picked) join the unit of the module that holds them,
as its frozen part (``frozen.py``), when that unit holds trainable parameters too. Such a unit keeps its small
trainable parameters (a LoRA block's factors sit below the persistence threshold): the block, base and
adapters, is one unit, gathered and freed together. Frozen parameters left over form parts of their own
(``frozen_only_specs``): a repeated block with nothing to train, a large frozen module such as an embedding
or a head; they are gathered around their module's forward (and backward) by ``stage3.py``, without prefetch.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, NamedTuple, Optional, Sequence, Union

from torch import nn

from lightning_zeroq.zero.layout import plan_units
from lightning_zeroq.zero.policies import Buckets, ModuleUnits


class UnitSpec(NamedTuple):
    params: list[nn.Parameter]
    module: Optional[nn.Module]
    """The module whose forward uses the unit (``None``: root or persistent, always gathered)."""
    persistent: bool
    frozen: Sequence[nn.Parameter] = ()
    """Stage 3: the module's frozen parameters, sharded as the unit's frozen part (``frozen.py``)."""


def _containers_children(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
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


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The instances of ``auto_wrap_classes(module)``, in module order (stage 3's default units)."""
    classes = auto_wrap_classes(module)
    return [m for m in module.modules() if type(m) in classes]


def plan_module_units(
    module: nn.Module,
    trainable: Sequence[nn.Parameter],
    *,
    wrap_classes: Optional[Sequence[str]],
    unit_size: Optional[int],
    persistence_threshold: int,
    frozen: Sequence[nn.Parameter] = (),
) -> list[UnitSpec]:
    """Units for stage 3, in module registration order (transient units first, then root, persistent)."""
    is_trainable = {id(p) for p in trainable}
    is_frozen = {id(p) for p in frozen}
    classes = _wrap_classes(module, wrap_classes, unit_size)
    taken: set[int] = set()
    is_small = {id(p) for p in trainable if p.numel() <= persistence_threshold}
    specs: list[UnitSpec] = []
    inside = _held_inside(module)

    def take(m: nn.Module) -> Optional[UnitSpec]:
        # A parameter shared with a module outside ``m`` (tied weights) must be gathered whenever
        # either runs: it stays with the root unit instead.
        own = [p for p in inside(m, True) if id(p) not in taken]
        held = [p for p in own if id(p) in is_frozen]
        params = [p for p in own if id(p) in is_trainable and (held or id(p) not in is_small)]
        if not params:
            return None  # nothing to train here: a frozen part needs a unit to ride with
        taken.update(id(p) for p in [*params, *held])
        return UnitSpec(params, m, False, held)

    if classes:
        for m in module.modules():
            if type(m) in classes and m is not module:
                spec = take(m)
                if spec is not None:
                    specs.append(spec)
    else:
        for m in _post_order(module):
            if m is module:
                continue
            pending = [
                p for p in m.parameters() if id(p) in is_trainable and id(p) not in taken and id(p) not in is_small
            ]
            if unit_size and pending and sum(p.numel() for p in pending) >= unit_size:
                spec = take(m)
                if spec is not None:
                    specs.append(spec)
    small = [p for p in trainable if id(p) in is_small and id(p) not in taken]
    root = [p for p in trainable if id(p) not in taken and id(p) not in is_small]
    if root:
        specs.append(UnitSpec(root, None, True))
    if small:
        specs.append(UnitSpec(small, None, True))
    return specs


def frozen_only_specs(
    module: nn.Module, specs: Sequence[UnitSpec], frozen: Sequence[nn.Parameter], units: ModuleUnits
) -> list[UnitSpec]:
    """Stage 3: the frozen parameters no unit took, in parts of their own (``frozen.py``): each repeated block
    (or instance of ``stage3_wrap_classes``) with nothing to train, whole; then each other module whose own
    frozen parameters hold more than ``stage3_param_persistence_threshold`` elements (a frozen embedding or
    head). A parameter shared with a module outside stays whole, as do the small ones."""
    taken = {id(p) for spec in specs for p in [*spec.params, *spec.frozen]}
    left = [p for p in frozen if id(p) not in taken]
    if not left:
        return []
    is_left = {id(p) for p in left}
    classes = _wrap_classes(module, units.wrap_classes, units.unit_size)
    inside = _held_inside(module)
    out: list[UnitSpec] = []

    def own(m: nn.Module, recurse: bool) -> list[nn.Parameter]:
        held = [p for p in inside(m, recurse) if id(p) in is_left and id(p) not in taken]
        taken.update(id(p) for p in held)
        return held

    for m in module.modules():
        if type(m) in classes and m is not module and not any(p.requires_grad for p in m.parameters()):
            held = own(m, recurse=True)
            if held:
                out.append(UnitSpec([], m, False, held))
    for m in module.modules():
        if m is module:
            continue
        mine = [p for p in m.parameters(recurse=False) if id(p) in is_left and id(p) not in taken]
        if sum(p.numel() for p in mine) > units.persistence_threshold:
            held = own(m, recurse=False)
            if held:
                out.append(UnitSpec([], m, False, held))
    return out


def _wrap_classes(module: nn.Module, wrap_classes: Optional[Sequence[str]], unit_size: Optional[int]) -> set[type]:
    """The classes whose instances become units: ``stage3_wrap_classes`` (each must be in the model), none with
    ``stage3_unit_size``, else the repeated blocks."""
    if not wrap_classes:
        return set() if unit_size else auto_wrap_classes(module)
    by_name = {type(m).__name__: type(m) for m in module.modules()}
    unknown = [name for name in wrap_classes if name not in by_name]
    if unknown:
        raise ValueError(
            f"stage3_wrap_classes={list(wrap_classes)}: no module of class {unknown} in the model; "
            f"classes present: {sorted(by_name)[:20]}."
        )
    return {by_name[name] for name in wrap_classes}


def _held_inside(module: nn.Module) -> Callable[[nn.Module, bool], list[nn.Parameter]]:
    """``inside(m, recurse)``: the parameters of ``m`` (with ``recurse``, of its submodules too) that no module
    outside it also holds: a tied parameter must be gathered whenever either holder runs."""
    owners: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)

    def inside(m: nn.Module, recurse: bool) -> list[nn.Parameter]:
        within = {id(x) for x in m.modules()} if recurse else {id(m)}
        return [p for p in m.parameters(recurse=recurse) if all(id(o) in within for o in owners[id(p)])]

    return inside


def _post_order(module: nn.Module) -> list[nn.Module]:
    out = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


def unit_plan(
    module: nn.Module,
    trainable: Sequence[nn.Parameter],
    units: Union[Buckets, ModuleUnits],
    frozen: Sequence[nn.Parameter] = (),
) -> list[UnitSpec]:
    """The units of ``module``: stage 3's module units (with ``frozen`` parameters in their frozen parts), or
    stage 1/2's buckets (frozen parameters stay whole there)."""
    if isinstance(units, ModuleUnits):
        return plan_module_units(
            module,
            trainable,
            wrap_classes=units.wrap_classes,
            unit_size=units.unit_size,
            persistence_threshold=units.persistence_threshold,
            frozen=frozen,
        )
    buckets = plan_units([p.numel() for p in trainable], units.numel)
    return [UnitSpec([trainable[i] for i in members], None, True) for members in buckets]
