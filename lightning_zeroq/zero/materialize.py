"""Meta-device modules made real, one unit at a time, with each owning module's ``reset_parameters()``.

``Module.to_empty`` may replace a module's parameter objects, so the helpers here hand back old id ->
new parameter and re-point every module that shared an old one (tied weights), and the engine keeps
its unit lists in step with them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeroq.zero import comm


def materialize_meta_state(module: nn.Module, device: torch.device, trainable: bool) -> None:
    """Materialize the meta-device frozen parameters and buffers (``trainable=False``) with each
    owning module's ``reset_parameters()``."""
    for m in module.modules():
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if any(t.is_meta and (trainable or not getattr(t, "requires_grad", False)) for t in own):
            reset_on(module, m, device)


def materialize_meta_params(
    module: nn.Module, params: list[nn.Parameter], device: torch.device, renamed: dict[int, nn.Parameter]
) -> None:
    """Materialize the owning modules of the meta-device ``params`` (one unit at a time), replacing
    the entries of ``params`` with the new parameter objects. ``renamed`` (old id -> new parameter)
    carries replacements across units: a module's reset replaces all of its parameters at once."""
    params[:] = [renamed.get(id(p), p) for p in params]
    wanted = {id(p) for p in params if p.is_meta}
    if not wanted:
        return
    for m in list(module.modules()):
        if any(id(p) in wanted for p in m.parameters(recurse=False)):
            renamed.update(reset_on(module, m, device))
    params[:] = [renamed.get(id(p), p) for p in params]


def reset_on(root: nn.Module, m: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """``m.to_empty(device)`` + ``m.reset_parameters()``; parameter objects may be replaced, so every
    module that shared an old one (tied weights) gets the new one. Returns old id -> new parameter."""
    if not hasattr(m, "reset_parameters"):
        raise ValueError(
            f"{type(m).__name__} has parameters or buffers on the meta device but no reset_parameters() "
            "to initialize them; give it one, or build the model on a real device."
        )
    before = dict(m.named_parameters(recurse=False))
    m.to_empty(device=device, recurse=False)
    with torch.no_grad():
        m.reset_parameters()
    renamed = {id(old): m._parameters[name] for name, old in before.items() if m._parameters[name] is not old}
    if renamed:
        for other in root.modules():
            for name, p in list(other._parameters.items()):
                if p is not None and id(p) in renamed:
                    other._parameters[name] = renamed[id(p)]
    return renamed


def sync_replicated_state(module: nn.Module, device: torch.device, group: Optional[dist.ProcessGroup]) -> None:
    """Frozen parameters and buffers (the state the engine does not shard): materialized if on meta,
    moved to ``device``, and rank 0's values everywhere, as DDP does."""
    materialize_meta_state(module, device, trainable=False)
    _, world_size = comm.world(group)
    with torch.no_grad():
        for t in [*(p for p in module.parameters() if not p.requires_grad), *module.buffers()]:
            t.data = t.data.to(device)
            if world_size > 1:
                comm.broadcast(t.data, 0, group)
