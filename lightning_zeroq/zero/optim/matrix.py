"""Optimizers that need each matrix whole: Muon (``torch.optim.Muon``).

A shard holds each parameter cut at arbitrary element boundaries, which is all an elementwise update
needs. Muon's update is elementwise but for one step: the momentum-blended gradient of each 2-D
parameter is orthogonalized by Newton-Schulz iterations over the whole matrix. So each rank steps its
segments' elementwise parts itself (the momentum buffer is sharded like Adam's moments), and for each
matrix the blended update is gathered whole across the shard group (an uneven all-gather: each rank
sends the elements of its segment, a rank without one sends none), orthogonalized on every rank with
torch's own function (the same input gives the same bits everywhere: the result is bitwise the
unsharded optimizer's), and each rank applies its own segment of it. With the optimizer on the host
the momentum stays there and the matrix is orthogonalized on the device (it crosses PCIe once each way).

Communication per step and rank: the fp32 update of every matrix once (4 bytes per element received),
on top of the weights' gather; AdamW's step adds none. The orthogonalization runs on every rank of
the group (its cost times the group's size, against once per matrix with an owner per matrix).

Other optimizers of this kind: ``register_matrix_optimizer(cls, rule)`` with a ``MatrixRule`` (its
elementwise blend, its whole-matrix transform, its elementwise apply); Muon is one such rule.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_zeroq.zero import comm
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.unit import Unit


class MatrixRule:
    """How ZeroQ steps an optimizer whose update needs each matrix whole, in three parts, so that its
    state stays sharded like Adam's moments (``register_matrix_optimizer``):

    - ``blend(view, grad, state, group)``: elementwise, on this rank's segment of one matrix (``view``:
      the fp32 master segment, ``grad``: its gradient, ``state``: the optimizer's state of that segment,
      ``group``: its param group): update the per-element state and return the segment of the matrix
      to make whole (fp32, ``view``'s shape);
    - ``whole(matrix, group)``: on the whole matrix (2-D, fp32, on the device), the same on every rank
      (the same input must give the same bits: the ranks then agree without another collective); it
      returns a tensor of ``matrix``'s shape (checked on every rank: see ``step_matrices``);
    - ``apply(view, update, group, shape)``: elementwise, in place, on this rank's segment of the
      parameter, from its segment of ``whole``'s result (``shape``: the parameter's).

    The optimizer's own ``step()`` is still called (with no gradients: it must skip parameters whose
    ``grad`` is None, as torch's optimizers do), so what watches it sees the step."""

    def blend(self, view: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        raise NotImplementedError

    def whole(self, matrix: torch.Tensor, group: dict) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, view: torch.Tensor, update: torch.Tensor, group: dict, shape: torch.Size) -> None:
        raise NotImplementedError


class MuonRule(MatrixRule):
    """``torch.optim.Muon``: the momentum (and Nesterov's blend) elementwise, torch's own Newton-Schulz
    iteration on the whole matrix, then decoupled weight decay and the learning rate adjusted to the
    matrix's shape, as torch's ``Muon.step`` does."""

    def blend(self, view: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(view)
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf.clone()

    def whole(self, matrix: torch.Tensor, group: dict) -> torch.Tensor:
        parts = _muon_parts()  # looked up at each call: the tests replace torch's iteration
        assert parts is not None  # matrix_optimizers() offers Muon only with them
        return parts[0](matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

    def apply(self, view: torch.Tensor, update: torch.Tensor, group: dict, shape: torch.Size) -> None:
        parts = _muon_parts()
        assert parts is not None
        lr = float(group["lr"])
        view.mul_(1 - lr * group["weight_decay"])
        view.add_(update, alpha=-parts[1](lr, group["adjust_lr_fn"], shape))


_RULES: dict[type, MatrixRule] = {}
"""Optimizer classes registered with ``register_matrix_optimizer``, and their rules."""


def register_matrix_optimizer(cls: type, rule: MatrixRule) -> type:
    """Declare that optimizer class ``cls`` needs each parameter's matrix whole, stepped by ``rule`` (a
    ``MatrixRule``); ZeroQ then takes it in every stage, with and without CPU optimizer offload, for 2-D
    parameters. Returns ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"an object of type {type(cls).__name__}"
        raise TypeError(f"register_matrix_optimizer() takes an optimizer class (a subclass of torch.optim.Optimizer) "
                        f"and its MatrixRule, e.g. register_matrix_optimizer(MyMuon, MyMuonRule()); got {what}.")
    if not isinstance(rule, MatrixRule):
        raise TypeError(f"register_matrix_optimizer({cls.__name__}, ...): the rule must be a "
                        f"lightning_zeroq.MatrixRule (blend, whole, apply); got {type(rule).__name__}.")
    _RULES[cls] = rule
    return cls


def matrix_optimizers() -> tuple[type, ...]:
    """The optimizer classes stepped here: those registered, and ``torch.optim.Muon`` where this torch has it."""
    muon = getattr(torch.optim, "Muon", None)
    return (*_RULES, *((muon,) if muon is not None and _muon_parts() is not None else ()))


_MUON = MuonRule()

_SHAPES_CHECKED: dict[int, tuple[MatrixRule, set[tuple[int, ...]]]] = {}
"""Per rule (by id, the rule kept beside: a rule need not be hashable), the matrix shapes for which every
rank has called its ``whole()`` and checked the result's shape."""


def rule_of(optimizer: torch.optim.Optimizer) -> MatrixRule:
    for cls, rule in _RULES.items():
        if isinstance(optimizer, cls):
            return rule
    return _MUON


def check_whole(rule: MatrixRule, result: Any, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``result`` (``rule.whole()`` of ``param``'s matrix) is a tensor of ``param``'s shape,
    naming the rule, the parameter and both shapes."""
    expected = tuple(param.shape)
    if isinstance(result, torch.Tensor) and tuple(result.shape) == expected:
        return
    name = getattr(param, "_zeroq_name", "a parameter")
    rule_name = type(rule).__name__
    fix = (f"whole() must return the matrix it is given, transformed, at its shape (the MatrixRule "
           f"{type(optimizer).__name__} was registered with; lightning_zeroq.register_matrix_optimizer)")
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"{rule_name}.whole() returned a {type(result).__name__} for {name} of shape {expected}, "
                        f"not a tensor: {fix}")
    raise ValueError(f"{rule_name}.whole() returned shape {tuple(result.shape)} for {name} of shape {expected}: {fix}")


@functools.cache
def _muon_parts_available() -> bool:
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # noqa: F401
    except ImportError:
        return False
    return True


def _muon_parts() -> Optional[tuple[Any, Any]]:
    """torch's own Newton-Schulz iteration and learning-rate adjustment (None where this torch lacks them)."""
    if not _muon_parts_available():
        return None
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz, _adjust_lr


def is_matrix_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, matrix_optimizers())


def step_matrices(binding: Any, units: Sequence[Unit], used: Sequence[Any], group: Optional[dist.ProcessGroup],
                  device: torch.device) -> None:
    """A matrix optimizer's step of ``units`` (the same units, in the same order, on every rank of
    ``group``; ``rule_of`` the optimizer: Muon's or a registered one), from the gradients the caller set
    on the segment views (``view.grad``) of ``binding`` (``binding.Binding``); the views' gradients
    are cleared."""
    optimizer = binding.optimizer
    rule = rule_of(optimizer)
    checked = _SHAPES_CHECKED.setdefault(id(rule), (rule, set()))[1]
    groups = {id(p): optimizer.param_groups[gi] for gi, given in enumerate(binding.given) for p in given}
    for unit in sorted(units, key=lambda u: u.index):
        mine: dict[int, tuple[Any, Any]] = {seg.param: (view, seg) for view, seg in binding.optimized[unit.index]}
        counts = _segment_numels(unit.layout)
        for i, param in enumerate(unit.params):
            if unit.param_id(i) not in binding.param_ids or not used[unit.param_id(i)]:
                continue  # another optimizer's, or no rank used it: left as torch.optim leaves it
            if param.dim() != 2:
                raise ValueError(f"{type(optimizer).__name__} steps 2-D parameters only; "
                                 f"{getattr(param, '_zeroq_name', 'a parameter')} has shape {tuple(param.shape)}: "
                                 "give it to another optimizer (e.g. AdamW)")
            view, seg = mine.get(i, (None, None))  # None: this rank holds no segment of it
            hyper = groups[id(param)]
            stepped = view is not None and view.grad is not None
            update = (rule.blend(view, view.grad, optimizer.state[view], hyper) if stepped
                      else torch.empty(0, dtype=torch.float32))
            whole = torch.empty(param.numel(), dtype=torch.float32, device=device)
            comm.all_gather_uneven(whole, update.to(device), counts[i], group)
            shape = tuple(param.shape)
            if not stepped and shape in checked:  # the gather above is a collective; the rest is this rank's own
                continue
            # The first time a shape comes, every rank transforms the matrix (the same input everywhere, so
            # the same result) and checks the result's shape: a wrong one is the same error on every rank,
            # with no collective to agree on it. After that only the ranks that apply the result transform it.
            result = rule.whole(whole.view(param.shape), hyper)
            check_whole(rule, result, param, optimizer)
            checked.add(shape)
            if not stepped:
                continue
            rule.apply(view, result.reshape(-1)[seg.param_span].to(view.device), hyper, param.shape)
            view.grad = None


@functools.lru_cache(maxsize=None)
def _segment_numels(layout: UnitLayout) -> list[list[int]]:
    """Per parameter of the unit, the elements of it each rank's shard holds (0 where none)."""
    counts = [[0] * layout.world_size for _ in layout.slots]
    for rank in range(layout.world_size):
        for seg in layout.segments(rank):
            counts[seg.param][rank] = seg.numel
    return counts
