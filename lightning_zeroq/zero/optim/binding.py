"""Which optimizers ZeroQ can shard, how one is bound to the master shards, and how an offloaded
optimizer steps on the host.

Sharding cuts every parameter at arbitrary element boundaries, so only elementwise updates give the
same result as on whole tensors.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections import OrderedDict, defaultdict
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from lightning_zeroq.zero.layout import Segment
from lightning_zeroq.zero.unit import Unit

ELEMENTWISE_OPTIMIZERS: list[type] = [
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
]


def register_elementwise_optimizer(cls: type) -> type:
    """Declare an optimizer class elementwise, so ZeroQ accepts it. Usable as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"an object of type {type(cls).__name__}"
        raise TypeError(
            f"register_elementwise_optimizer() takes an optimizer class (a subclass of torch.optim.Optimizer, "
            f"e.g. register_elementwise_optimizer(MyAdam)); got {what}."
        )
    if cls not in ELEMENTWISE_OPTIMIZERS:
        ELEMENTWISE_OPTIMIZERS.append(cls)
    return cls


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    from lightning_zeroq.zero.optim.matrix import matrix_optimizers  # Muon: elementwise but for whole matrices

    adafactor = getattr(torch.optim, "Adafactor", None)
    if adafactor is not None and isinstance(optimizer, adafactor):
        raise ValueError(
            "ZeroQ cannot shard torch.optim.Adafactor: its second moment of each matrix is factored into a row "
            "and a column vector, each reduced over the whole matrix at every step, and a shard cuts matrices "
            "at arbitrary elements. Use AdamW (and torch.optim.Muon for the hidden matrices) with ZeroQ, or "
            "Adafactor with DDP or FSDP."
        )
    if not isinstance(optimizer, (*ELEMENTWISE_OPTIMIZERS, *matrix_optimizers())):
        name = type(optimizer).__name__
        raise ValueError(
            f"ZeroQ cannot shard optimizer {name}: it shards every parameter across ranks, so the update "
            f"must be elementwise, and {name} is not known to be (known: "
            f"{', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}). If {name} is elementwise, declare "
            f"it with lightning_zeroq.register_elementwise_optimizer({name}); if it needs each matrix whole "
            f"(as Muon does), with lightning_zeroq.register_matrix_optimizer({name}, rule); otherwise use DDP "
            "or FSDP."
        )


FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
FUSED_ON_CUDA = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def prefer_fast_host_step(
    optimizer: torch.optim.Optimizer, group: dict, also_on: Optional[torch.device] = None
) -> None:
    """Optimizer offload steps on the CPU: use torch's fused CPU kernel where torch has one (Adam,
    AdamW, SGD, Adagrad; 3.3x plain AdamW on 100M parameters, benchmarks/results/cpu_optimizer_cpu_2026-11-30.txt),
    foreach for the other optimizers that have it. The update is the same; only the kernel differs.
    ``also_on``: the group also holds segments on this device (partial offload), so the fused kernel
    is taken only if torch has it there as well."""
    fused_there = (
        also_on is None or also_on.type == "cpu" or (also_on.type == "cuda" and isinstance(optimizer, FUSED_ON_CUDA))
    )
    if isinstance(optimizer, FUSED_ON_CPU) and fused_there:
        group["fused"], group["foreach"] = True, False
    elif "foreach" in optimizer.defaults:
        group["foreach"] = True


def _unwrapped(fn: object) -> object:
    while hasattr(fn, "__wrapped__"):  # torch's own step hooks wrap it with functools.wraps
        fn = fn.__wrapped__
    return fn


_ADAM_STEPS = {_unwrapped(torch.optim.Adam.step), _unwrapped(torch.optim.AdamW.step)}


def adam_kind(optimizer: torch.optim.Optimizer) -> Optional[bool]:
    """For torch's own Adam or AdamW step (also in a subclass that keeps it): whether weight decay is
    decoupled unless a group says otherwise (AdamW); None for any other step, which the host kernel
    must not replace."""
    if _unwrapped(type(optimizer).step) not in _ADAM_STEPS:
        return None
    return isinstance(optimizer, torch.optim.AdamW)


def kernel_group(group: dict, decoupled: bool) -> Optional[dict]:
    """The host kernel's arguments for an Adam/AdamW param group, or None where the group asks for what
    it does not do (AMSGrad, capturable or differentiable steps, tensor hyperparameters)."""
    if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
        return None
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if any(isinstance(x, Tensor) for x in (lr, beta1, beta2, eps, weight_decay)):
        return None
    return {
        "lr": float(lr),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(eps),
        "weight_decay": float(weight_decay),
        "decoupled": bool(group.get("decoupled_weight_decay", decoupled)),
        "maximize": bool(group.get("maximize", False)),
    }


class Binding:
    """One optimizer bound to the master segments of its parameters (several optimizers may share an
    engine if their parameters are disjoint, e.g. a GAN's generator and discriminator)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        optimized: dict[int, list[tuple[Tensor, Segment]]],
        param_ids: frozenset[int],
        unit_ids: frozenset[int],
        given: list[list[Tensor]],
    ) -> None:
        self.optimizer = optimizer
        self.given = given
        """Per param group: the module's parameters it held before binding (``hand_back`` restores them)."""
        self.optimized = optimized
        """Per unit index: the (master segment view, segment) pairs this optimizer steps on this rank."""
        self.param_ids = param_ids
        """The engine's ids (``Unit.param_id``) of this optimizer's parameters, whichever rank owns them."""
        self.unit_ids = unit_ids
        """Units holding any of them."""
        self.multiplier = 1.0
        """Unscaling and clipping still to apply to this optimizer's gradients (see ``ZeroEngine``)."""
        self.skip: Optional[bool] = None
        """This window's decision for this optimizer's step (None: not decided yet)."""


def whole(unit: Any, binding: Any) -> bool:
    """``binding``'s optimizer steps every segment of ``unit`` on this rank (no other optimizer shares it
    here). ``binding``: a ``Binding``, or anything with its ``optimized``."""
    return len(binding.optimized[unit.index]) == len(unit.segments)


def segment_spans(unit: Any, binding: Any) -> list[slice]:
    """The spans of ``unit``'s shard on this rank that ``binding``'s optimizer steps."""
    return [seg.shard_span for _, seg in binding.optimized.get(unit.index, ())]


def stepped_spans(unit: Any, binding: Any) -> Optional[list[slice]]:
    """What a step of ``binding`` changed of ``unit``'s shard on this rank: None where it is all of it,
    else its segments' spans (the rest is another optimizer's, unchanged)."""
    return None if whole(unit, binding) else segment_spans(unit, binding)


def bind_to_shards(optimizer: torch.optim.Optimizer, module: nn.Module, units: Sequence[Unit]) -> Binding:
    """Rebind ``optimizer``'s param groups to this rank's fp32 master segments, in place.

    The optimizer object itself is kept, so LR schedulers and ``LearningRateMonitor`` that hold it keep
    working. State it holds for a parameter (Adagrad's, made by its constructor) is cut to that
    parameter's segments, as DDP would keep it. An optimizer bound before (its groups hold segment
    views) binds again to the same parameters, its state dropped.
    """
    check_elementwise(optimizer)
    # A group that was bound before holds master segment views: read them as their parameters.
    owner_of_view = {id(v): u.params[seg.param] for u in units for seg, v in zip(u.segments, u.segment_masters)}
    group_of: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            p = owner_of_view.get(id(p), p)
            if id(p) in group_of and group_of[id(p)] != gi:
                raise ValueError("A parameter appears in two optimizer param groups; list each once.")
            group_of[id(p)] = gi
    module_params = {id(p) for p in module.parameters()}
    foreign = [k for k in group_of if k not in module_params]
    if foreign:
        raise ValueError(
            f"The optimizer holds {len(foreign)} tensor(s) that are not parameters of the module; "
            "build the optimizer from self.parameters() in configure_optimizers."
        )
    given: list[list[Tensor]] = [
        list({id(q): q for q in (owner_of_view.get(id(p), p) for p in group["params"])}.values())
        for group in optimizer.param_groups
    ]
    new_params: list[list[Tensor]] = [[] for _ in optimizer.param_groups]
    optimized: dict[int, list[tuple[Tensor, Segment]]] = {u.index: [] for u in units}
    param_ids: set[int] = set()
    unit_ids: set[int] = set()
    for unit in units:
        for i, p in enumerate(unit.params):
            if id(p) in group_of:
                param_ids.add(unit.param_id(i))
                unit_ids.add(unit.index)
        for seg, view in zip(unit.segments, unit.segment_masters):
            group_index = group_of.get(id(unit.params[seg.param]))
            if group_index is not None:
                new_params[group_index].append(view)
                optimized[unit.index].append((view, seg))
    made = {id(p): state for p, state in optimizer.state.items() if isinstance(p, Tensor)}
    optimizer.state.clear()
    for unit in units:  # state the constructor made (Adagrad's sum and step) goes to the segments
        for seg, view in zip(unit.segments, unit.segment_masters):
            param = unit.params[seg.param]
            if id(param) in made and id(param) in group_of:
                optimizer.state[view] = {k: _segment_of(v, param, seg, view) for k, v in made[id(param)].items()}
    for group, views in zip(optimizer.param_groups, new_params):
        group["params"] = views
    return Binding(optimizer, optimized, frozenset(param_ids), frozenset(unit_ids), given)


def hand_back(binding: Binding) -> torch.optim.Optimizer:
    """Give the user's optimizer back bound to the module's parameters (its param groups as given; its
    state empty, as a new optimizer's), so another fit or strategy (DDP too) can take it. The binding
    keeps a twin of it bound to the segments, with the state, for checkpoints saved after the fit;
    returns the twin."""
    user = binding.optimizer
    unroute_zero_grad(user)
    if "_zeroq_handed_back" in user.__dict__:
        return user  # handed back already
    twin = type(user).__new__(type(user))
    twin.__dict__.update(user.__dict__)
    twin.param_groups = [dict(group) for group in user.param_groups]
    twin.__dict__["_zeroq_handed_back"] = user
    user.state = defaultdict(dict)
    for group, params in zip(user.param_groups, binding.given):
        group["params"] = list(params)
    binding.optimizer = twin
    return twin


def _segment_of(value: object, param: Tensor, seg: Segment, view: Tensor) -> object:
    """One entry of a parameter's optimizer state, for one of its master segments: a tensor of the
    parameter's size is cut to the segment, as the master's dtype and device; others are copied."""
    if not isinstance(value, Tensor):
        return copy.deepcopy(value)
    if value.dim() > 0 and value.numel() == param.numel():
        return value.detach().reshape(-1)[seg.param_span].to(device=view.device, dtype=view.dtype, copy=True)
    return value.detach().to(device=view.device if value.device == param.device else value.device, copy=True)


class OneStep:
    """Steps an optimizer over several batches of its parameters (one unit at a time, with offload) as
    one step, as its hooks and per-group state see it: step hooks (the optimizer's and the global
    ones) run once, and every batch starts from the param groups' values of before the step, so a
    per-group counter (bias correction, schedules kept in the group) advances once per step.
    Per-parameter state is per segment, so each segment is stepped exactly once anyway."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._before: Optional[list[dict]] = None

    def __enter__(self) -> "OneStep":
        opt = self.optimizer
        for hook in [*_global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()]:
            hook(opt, (), {})
        self._saved = (opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks)
        opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        self._global = (dict(_global_optimizer_pre_hooks), dict(_global_optimizer_post_hooks))
        _global_optimizer_pre_hooks.clear()
        _global_optimizer_post_hooks.clear()
        self._before = None
        return self

    def step(self) -> None:
        groups = self.optimizer.param_groups
        if self._before is None:
            self._before = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in groups]
        else:
            for group, before in zip(groups, self._before):
                group.update(copy.deepcopy(before))
        self.optimizer.step()

    def __exit__(self, *exc: object) -> None:
        opt = self.optimizer
        opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = self._saved
        _global_optimizer_pre_hooks.update(self._global[0])
        _global_optimizer_post_hooks.update(self._global[1])
        if exc[0] is None:
            for hook in [*opt._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()]:
                hook(opt, (), {})


def route_zero_grad(optimizer: torch.optim.Optimizer, engine: object) -> None:
    """Make ``optimizer.zero_grad()`` drop the engine's gradients too (``engine``: what owns them and has
    ``zero_grad(optimizer)``, the engine's ``step.Stepper``) (they live in its shards, and a
    user's ``zero_grad()`` between backward passes must drop them as it drops ``p.grad`` with DDP),
    however it is called: on the optimizer, or on a Lightning or Fabric wrapper, which subclasses the
    optimizer's class and so finds this ``zero_grad`` first. The optimizer's class becomes a subclass of
    its own that only adds this; ``unroute_zero_grad`` restores it, and it pickles as the plain class.
    The engine is held weakly."""
    if not getattr(type(optimizer), "_zeroq_routed", False):
        # A class is hashable; mypy checks it against the instances' __hash__ (torch's stubs type it so).
        optimizer.__class__ = _routed_class(type(optimizer))  # type: ignore[arg-type]
    optimizer.__dict__["_zeroq_engine"] = weakref.ref(engine)  # as unroute_zero_grad pops it


def unroute_zero_grad(optimizer: torch.optim.Optimizer) -> None:
    base = getattr(type(optimizer), "_zeroq_base", None)
    if base is not None:
        optimizer.__class__ = base
    optimizer.__dict__.pop("_zeroq_engine", None)


@functools.lru_cache(maxsize=None)
def _routed_class(cls: type[torch.optim.Optimizer]) -> type:
    def zero_grad(self, set_to_none: bool = True) -> None:
        ref = getattr(self, "_zeroq_engine", None)
        engine = ref() if ref is not None else None
        if engine is not None:
            engine.zero_grad(getattr(self, "optimizer", self))  # a wrapper's optimizer, or this one
        cls.zero_grad(self, set_to_none)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_plain_optimizer, (cls, self.__getstate__()))

    return type(
        cls.__name__,
        (cls,),
        {
            "zero_grad": zero_grad,
            "__reduce_ex__": __reduce_ex__,
            "_zeroq_routed": True,
            "_zeroq_base": cls,
            "__module__": cls.__module__,
        },
    )


def _plain_optimizer(cls: type[torch.optim.Optimizer], state: dict) -> torch.optim.Optimizer:
    optimizer = cls.__new__(cls)
    state.pop("_zeroq_engine", None)
    optimizer.__setstate__(state)
    return optimizer
