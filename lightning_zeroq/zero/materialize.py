"""Meta-device modules made real, one unit at a time, with each owning module's ``reset_parameters()``.

Materializing replaces a module's meta parameter objects, so the helpers here hand back old id -> new
parameter and re-point every module that shared an old one (tied weights), and the engine keeps its
unit lists in step with them. ``parameters_on_meta`` is the stage-3 construction context: parameters
on meta, everything else real.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside land on the meta device (the engine materializes them unit by
    unit); buffers and any other tensors are created as usual, so state such as a metric's is real.
    Each parameter is allocated (not initialized) on its own device first, one at a time."""
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize_meta_state(
    module: nn.Module, device: torch.device, trainable: bool, skip: frozenset[int] = frozenset()
) -> None:
    """Materialize the meta-device frozen parameters and buffers (``trainable=False``) with each
    owning module's ``reset_parameters()``; ``skip``: ids of parameters materialized later (frozen parts)."""
    for m in module.modules():
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if any(t.is_meta and id(t) not in skip and (trainable or not getattr(t, "requires_grad", False)) for t in own):
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
    """``m``'s meta tensors made empty on ``device``, then ``m.reset_parameters()``; parameter objects
    are replaced, so every
    module that shared an old one (tied weights) gets the new one. Returns old id -> new parameter."""
    reset = getattr(m, "reset_parameters", None)  # (nn.Module's stubs type unknown attributes as tensors)
    if reset is None:
        raise ValueError(
            f"{type(m).__name__} has parameters or buffers on the meta device but no reset_parameters() "
            "to initialize them; give it one, or build the model on a real device."
        )
    before = dict(m.named_parameters(recurse=False))
    for name, p in before.items():  # only what is on meta: real buffers and parameters keep their values
        if p.is_meta:
            m._parameters[name] = type(p)(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
    for name, b in list(m._buffers.items()):
        if b is not None and b.is_meta:
            m._buffers[name] = torch.empty_like(b, device=device)
    with torch.no_grad():
        reset()
    renamed = {
        id(old): new for name, old in before.items() if (new := m._parameters[name]) is not old and new is not None
    }
    if renamed:
        for other in root.modules():
            for name, shared in list(other._parameters.items()):
                if shared is not None and id(shared) in renamed:
                    other._parameters[name] = renamed[id(shared)]
    return renamed


def sync_replicated_state(
    module: nn.Module, device: torch.device, group: Optional[dist.ProcessGroup], sharded: frozenset[int] = frozenset()
) -> None:
    """Frozen parameters and buffers (the state the engine does not shard): materialized if on meta,
    moved to ``device``, and rank 0's values everywhere, as DDP does. ``sharded``: ids of the frozen
    parameters stage 3 shards instead (built unit by unit with their units, ``frozen.py``)."""
    materialize_meta_state(module, device, trainable=False, skip=sharded)
    _, world_size = rank_and_size(group)
    with torch.no_grad():
        for t in [*(p for p in module.parameters() if not p.requires_grad and id(p) not in sharded), *module.buffers()]:
            t.data = t.data.to(device)
            if world_size > 1:
                comm.broadcast(t.data, 0, group)


def target_device(module: nn.Module, device: Optional[torch.device]) -> torch.device:
    """The device the engine builds on: ``device``, else the one device of the module's tensors."""
    devices = {t.device for t in [*module.parameters(), *module.buffers()] if not t.is_meta}
    if len(devices) > 1:
        raise ValueError(
            f"ZeroQ needs all parameters and buffers on one device, found {sorted(map(str, devices))}; "
            "create the module on one device (tensors on the meta device are materialized unit by unit)."
        )
    source = devices.pop() if devices else torch.device("cpu")
    target = torch.device(device) if device is not None else source
    if target.type == "meta":
        raise ValueError("ZeroEngine needs a real target device; pass device=... for a module on meta.")
    return target
