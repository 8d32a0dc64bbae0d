"""The offload factories: the placement of masters and optimizer state, and the store of stage 3's resting
shards, each chosen once from the ``Offload`` policy when the engine is built (the table in ``__init__.py``)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.offload.auto import AutoSplit
from lightning_zeroq.zero.offload.device import OptimizerHome
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.offload.host_worker import HostWorker
from lightning_zeroq.zero.offload.nvme import NvmeOptimizer, NvmeStore
from lightning_zeroq.zero.offload.split import SplitOptimizer, host_units
from lightning_zeroq.zero.offload.stores import CastMaster, DeviceStore, HostStore, MasterAlias, ShardStore, SplitStore
from lightning_zeroq.zero.policies import Auto, Host, Nvme, OnDevice


def optimizer_home(
    policy: Union[OnDevice, Host, Nvme, Auto],
    device: torch.device,
    param_dtype: torch.dtype,
    rank: int,
    world_size: int,
    layouts: Sequence[UnitLayout],
    worker: HostWorker,
    speculative: bool = False,
) -> OptimizerHome:
    """Where masters and optimizer state live (``Offload.optimizer``; ``worker``: the host's worker, which the
    host placements take; ``speculative``: ``Offload.speculative``)."""
    if isinstance(policy, OnDevice):
        return OptimizerHome(device)
    if isinstance(policy, Nvme):
        on_disk = None if policy.ratio == 1.0 else host_units(layouts, policy.ratio)
        return NvmeOptimizer(device, param_dtype, world_size, worker, nvme_path=policy.path, rank=rank, on_disk=on_disk)
    host = HostOptimizer(device, param_dtype, world_size, worker, speculative=speculative)
    if isinstance(policy, Auto):
        return AutoSplit(device, host, len(layouts), policy.budget, rank)
    if policy.ratio == 1.0:
        return host
    return SplitOptimizer(device, host, host_units(layouts, policy.ratio, policy.last_first))


def host_part(placement: OptimizerHome) -> Optional[HostOptimizer]:
    """The part of ``placement`` that steps units on the host, if any: the whole of a ``HostOptimizer``
    (NVMe's too), the host half of a fixed ``SplitOptimizer``; None for ``"auto"`` (its units move after
    the first step) and without offload."""
    if isinstance(placement, HostOptimizer):
        return placement
    if isinstance(placement, SplitOptimizer) and not isinstance(placement, AutoSplit):
        return placement.host
    return None


def shard_store(
    policy: Union[OnDevice, Host, Nvme],
    device: torch.device,
    *,
    payload_dtype: torch.dtype,
    payload_numels: dict[int, int],
    param_dtype: torch.dtype,
    rank: int,
    quantized: bool,
    master_on_device: Callable[[int], bool] = lambda index: True,
    masters_may_move: bool = False,
    alone: bool = False,
) -> ShardStore:
    """The store of stage 3's transient units (``policy``: ``Offload.parameters``; ``payload_numels``: unit
    index -> payload elements; ``quantized``: the payload is INT8; ``master_on_device``: the optimizer
    placement's answer, per unit; ``masters_may_move``: the placement brings masters to the device later, ``auto.AutoSplit``;
    ``alone``: one rank in the shard group)."""
    if isinstance(policy, Nvme):
        return NvmeStore(device, payload_dtype, payload_numels, nvme_path=policy.path, rank=rank)
    if isinstance(policy, Host):
        return HostStore(device, payload_dtype, payload_numels)
    if quantized:
        return DeviceStore(device, payload_dtype, payload_numels)
    # Full width: a master on the device is the working shard (fp32) or is cast at each gather (the
    # bytes a DeviceStore would keep, bitwise); a master off the device leaves its payload on the device.
    # ``alone`` (one rank in the shard group): a gather is a copy into the working buffer, which casts as
    # it copies, so the master is handed over as it is (no cast into a temporary first; bitwise the same).
    reads_master = MasterAlias() if param_dtype == torch.float32 or alone else CastMaster(param_dtype)
    on_device = frozenset(i for i in payload_numels if master_on_device(i))
    if len(on_device) == len(payload_numels):
        return reads_master
    kept = DeviceStore(device, payload_dtype, {i: n for i, n in payload_numels.items() if i not in on_device})
    # Masters that may come to the device later ("auto") need the split even while none is there.
    return SplitStore(reads_master, kept, on_device) if on_device or masters_may_move else kept
