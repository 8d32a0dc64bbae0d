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
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_zeroq.zero import comm
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.unit import Unit


@functools.cache
def matrix_optimizers() -> tuple[type, ...]:
    """The optimizer classes stepped here (``torch.optim.Muon`` where this torch has it)."""
    muon = getattr(torch.optim, "Muon", None)
    return (muon,) if muon is not None and _muon_parts() is not None else ()


def _muon_parts() -> Optional[tuple[Any, Any]]:
    """torch's own Newton-Schulz iteration and learning-rate adjustment (None where this torch lacks them)."""
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
    except ImportError:
        return None
    return _zeropower_via_newtonschulz, _adjust_lr


def is_matrix_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, matrix_optimizers())


def step_matrices(binding: Any, units: Sequence[Unit], used: Sequence[Any], group: Optional[dist.ProcessGroup],
                  device: torch.device) -> None:
    """Muon's step of ``units`` (the same units, in the same order, on every rank of ``group``), from the
    gradients the caller set on the segment views (``view.grad``) of ``binding`` (``optimizers.Binding``);
    the views' gradients are cleared."""
    parts = _muon_parts()
    assert parts is not None  # matrix_optimizers() offers Muon only with them
    orthogonalize, adjust_lr = parts
    optimizer = binding.optimizer
    groups = {id(p): optimizer.param_groups[gi] for gi, given in enumerate(binding.given) for p in given}
    for unit in sorted(units, key=lambda u: u.index):
        mine: dict[int, tuple[Any, Any]] = {seg.param: (view, seg) for view, seg in binding.optimized[unit.index]}
        counts = _segment_numels(unit.layout)
        for i, param in enumerate(unit.params):
            if unit.param_id(i) not in binding.param_ids or not used[unit.param_id(i)]:
                continue  # another optimizer's, or no rank used it: left as torch.optim leaves it
            if param.dim() != 2:
                raise ValueError(f"Muon steps 2-D parameters only; {getattr(param, '_zeroq_name', 'a parameter')} "
                                 f"has shape {tuple(param.shape)}: give it to another optimizer (e.g. AdamW)")
            view, seg = mine.get(i, (None, None))  # None: this rank holds no segment of it
            hyper = groups[id(param)]
            momentum, nesterov = hyper["momentum"], hyper["nesterov"]
            if view is not None and view.grad is not None:
                state = optimizer.state[view]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.zeros_like(view)
                grad = view.grad
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if nesterov else buf.clone()
            else:
                update = torch.empty(0, dtype=torch.float32)
            whole = torch.empty(param.numel(), dtype=torch.float32, device=device)
            comm.all_gather_uneven(whole, update.to(device), counts[i], group)
            ortho = orthogonalize(whole.view(param.shape), hyper["ns_coefficients"], hyper["ns_steps"], hyper["eps"])
            if view is None or view.grad is None:
                continue
            lr = float(hyper["lr"])
            view.mul_(1 - lr * hyper["weight_decay"])
            view.add_(ortho.reshape(-1)[seg.param_span].to(view.device), alpha=-adjust_lr(lr, hyper["adjust_lr_fn"],
                                                                                          param.shape))
            view.grad = None


@functools.lru_cache(maxsize=None)
def _segment_numels(layout: UnitLayout) -> list[list[int]]:
    """Per parameter of the unit, the elements of it each rank's shard holds (0 where none)."""
    counts = [[0] * layout.world_size for _ in layout.slots]
    for rank in range(layout.world_size):
        for seg in layout.segments(rank):
            counts[seg.param][rank] = seg.numel
    return counts
