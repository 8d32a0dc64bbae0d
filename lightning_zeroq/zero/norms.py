"""Gradient norms from the shards: the global norm clipping needs, and every parameter's norm for
logging (``on_before_optimizer_step``, where ``.grad`` is empty because gradients live in shards).

Both read the fp32 gradient shards on the device (a gradient already copied to the host was
measured as it left, ``Unit.land``, or comes back for the per-parameter norms) and cost one all-reduce: one number for the global norm, one per parameter for the per-parameter norms.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.unit import Unit


@torch.no_grad()
def global_norm(units: Sequence[Unit], group: Optional[dist.ProcessGroup], device: torch.device) -> Tensor:
    """The 2-norm of all gradient shards of all ranks together."""
    local = torch.zeros((), device=device)
    for unit in units:
        local += unit.grad_squares()
    if rank_and_size(group)[1] > 1:
        comm.all_reduce(local, dist.ReduceOp.SUM, group)
    return local.sqrt()


@torch.no_grad()
def grad_norms(
    units: Sequence[Unit],
    names: dict[int, str],
    norm_type: float,
    scale: float,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> dict[str, Tensor]:
    """``{"grad_<p>_norm/<name>": ..., "grad_<p>_norm_total": ...}`` as Lightning's ``grad_norm``
    utility returns them, with the shards multiplied by ``scale`` (fp16 unscaling). A parameter's
    segments on all ranks add up to its norm (``inf``: their maximum)."""
    infinite = norm_type == float("inf")
    per_param = torch.zeros(sum(len(u.params) for u in units), device=device)
    for unit in units:
        grad = unit.fp32_grad()
        for seg in unit.segments:
            values = grad[seg.shard_span].abs()
            index = unit.param_id(seg.param)
            if infinite:
                per_param[index] = torch.maximum(per_param[index], values.max())
            else:
                per_param[index] += values.pow(norm_type).sum()
    if rank_and_size(group)[1] > 1:
        comm.all_reduce(per_param, dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group)
    if infinite:
        norms, total = per_param * scale, per_param.max() * scale
    else:
        norms, total = per_param.pow(1.0 / norm_type) * scale, per_param.sum().pow(1.0 / norm_type) * scale
    out = {
        f"grad_{norm_type}_norm/{names.get(id(p), '?')}": norms[unit.param_id(i)]
        for unit in units
        for i, p in enumerate(unit.params)
    }
    out[f"grad_{norm_type}_norm_total"] = total
    return out
