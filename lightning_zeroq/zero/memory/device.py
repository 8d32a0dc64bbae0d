"""Device memory before launch: the bytes per rank that the unit layouts and the offload settings
decide, by the kinds of ``ZeroEngine.memory_report`` (fp32 masters and optimizer state of the units
stepped on the device, their fp32 gradient shards at the step, the working weights of the persistent
units, the stored shards of stage 3's transient units, two of the largest transient unit). The plan
(``planning/estimate.py``) adds the activations; the engine checks the state alone against the GPU's memory
when it is built and when the optimizer is attached (``memory.host.HostBudget``), before allocating it,
so a model whose state cannot fit stops with one line instead of running out of memory in its first
step."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from lightning_zeroq.zero.frozen import FrozenNeed
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.offload.split import host_units
from lightning_zeroq.zero.policies import Host, Offload, OnDevice

GIB = 2**30
NO_FROZEN = FrozenNeed(0, {})


class DeviceMemoryError(RuntimeError):
    """The model's state cannot fit on the device (raised before it is allocated)."""


def units_off_device(policy: Any, layouts: Sequence[UnitLayout]) -> frozenset[int]:
    """The units whose master and optimizer state an optimizer offload policy keeps off the device."""
    if isinstance(policy, OnDevice):
        return frozenset()
    if isinstance(policy, Host):
        return host_units(layouts, policy.ratio, policy.last_first)
    return frozenset(range(len(layouts)))  # Nvme, and Auto as it starts


def device_kinds(
    layouts: Sequence[UnitLayout],
    persistent: Sequence[bool],
    offload: Offload,
    param_dtype: torch.dtype,
    state_bytes: int,
    rank: int = 0,
    payload: Optional[dict[int, tuple[int, torch.dtype]]] = None,
    frozen: FrozenNeed = NO_FROZEN,
) -> dict[str, int]:
    """Device bytes by ``memory_report``'s kinds for ``rank`` (``largest_transient_unit`` counted twice
    as ``gathered_units``; ``state_bytes``: optimizer state per parameter element, none for padding;
    ``payload``: a transient unit's stored payload (elements, dtype), default its shard in ``param_dtype``;
    one of another dtype is INT8, stored beside every master, on the device or not; ``frozen``: stage 3's frozen
    parts, ``zero/frozen.py``: stored on the device unless parameters are offloaded, gathered with their unit)."""
    n = len(layouts)
    off = units_off_device(offload.optimizer, layouts)
    itemsize = param_dtype.itemsize
    device_units = [i for i in range(n) if i not in off]
    transient = [i for i in range(n) if not persistent[i]]
    stored = 0
    if transient and isinstance(offload.parameters, OnDevice):
        # a master on the device is cast at each gather (bf16) or is the working shard (fp32); else stored
        rested = {i: numel * dtype.itemsize for i, (numel, dtype) in (payload or {}).items()}
        encoded = any(dtype != param_dtype for _, dtype in (payload or {}).values())
        stored = sum(rested.get(i, layouts[i].shard_numel * itemsize) for i in transient if i in off or encoded)
    return {
        "masters": 4 * sum(layouts[i].shard_numel for i in device_units),
        "gradient_shards": 4 * sum(layouts[i].shard_numel for i in device_units),
        "optimizer_state": state_bytes * sum(seg.numel for i in device_units for seg in layouts[i].segments(rank)),
        "persistent_units": sum(layouts[i].padded_numel * itemsize for i in range(n) if persistent[i]),
        "stored_shards": stored,
        "gathered_units": 2
        * max(
            [
                frozen.own_gathered,
                *(layouts[i].padded_numel * itemsize + frozen.gathered_bytes.get(i, 0) for i in transient),
            ]
        ),
        "frozen_shards": frozen.stored_bytes if isinstance(offload.parameters, OnDevice) else 0,
    }


def capacity(device: torch.device) -> Optional[int]:
    """The device's memory (None off CUDA: nothing to check)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


RATIO_STEP = 0.05
"""The steps of ``offload_optimizer_ratio`` the nearest fitting configuration is looked for in."""


def nearest_fit(
    layouts: Sequence[UnitLayout],
    persistent: Sequence[bool],
    offload: Offload,
    param_dtype: torch.dtype,
    state_bytes: int,
    rank: int,
    payload: Optional[dict[int, tuple[int, torch.dtype]]],
    room: int,
    frozen: FrozenNeed = NO_FROZEN,
) -> Optional[tuple[str, int]]:
    """The least offload beyond ``offload`` whose state fits ``room`` (the options to set, and its bytes):
    a larger share of the optimizer on the host (``offload_optimizer_ratio`` in steps of ``RATIO_STEP``),
    then, with stage 3's transient units, the parameters too; None if none does."""

    def state(option: Offload) -> int:
        return sum(device_kinds(layouts, persistent, option, param_dtype, state_bytes, rank, payload, frozen).values())

    start = offload.optimizer.ratio if isinstance(offload.optimizer, Host) else 0.0
    if isinstance(offload.optimizer, (OnDevice, Host)):
        steps = round(1 / RATIO_STEP)
        for k in range(1, steps + 1):
            ratio = round(k * RATIO_STEP, 2)
            if ratio <= start:
                continue
            need = state(dataclasses.replace(offload, optimizer=Host(ratio)))
            if need <= room:
                return ("offload_optimizer=True" + (f", offload_optimizer_ratio={ratio}" if ratio < 1 else ""), need)
    if (not all(persistent) or frozen.stored_bytes) and isinstance(offload.parameters, OnDevice):
        need = state(dataclasses.replace(offload, optimizer=Host(1.0), parameters=Host()))
        if need <= room:
            return "offload_optimizer=True, offload_parameters=True", need
    return None


def check(
    kinds: dict[str, int],
    room: Optional[int],
    what: str,
    nearest: Optional[tuple[str, int]] = None,
    with_adam: bool = False,
) -> None:
    """Raise ``DeviceMemoryError`` (one line) if ``kinds`` exceed ``room``; ``nearest``: the least offload
    that fits (``nearest_fit``), named as the fix (``with_adam``: found for Adam's state, the optimizer
    not being attached yet)."""
    total = sum(kinds.values())
    if room is None or total <= room:
        return
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f} GiB" for k, v in kinds.items() if v)
    if nearest is not None:
        fix = (
            f"the nearest that fits{' with Adam' if with_adam else ''} is {nearest[0]} ({nearest[1] / GIB:.2f} "
            "GiB of state; the activations come on top: zeroq-plan shows what fits with them)"
        )
    else:
        fix = (
            "no offload setting makes the state fit: shard it over more GPUs (zeroq-plan shows what fits, "
            "activations included)"
        )
    raise DeviceMemoryError(
        f"ZeroConfig: {what} needs {total / GIB:.2f} GiB of device memory per rank before any activation "
        f"({parts}) and the device has {room / GIB:.2f} GiB; {fix}."
    )
