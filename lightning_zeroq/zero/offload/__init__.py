"""Placements: where the optimizer's state and stage 3's resting parameter shards live.

Chosen once, when the engine is built, from the ``ZeroConfig``; the engine then calls the chosen
objects at fixed points and never branches on the offload mode itself.

| config | optimizer placement | stage-3 shard store |
|---|---|---|
| no offload | ``device.OptimizerPlacement`` | full width: ``device.MasterAlias`` (fp32) or ``device.CastMaster`` (bf16/fp16); INT8: ``device.DeviceStore`` |
| ``offload_optimizer`` (cpu) | ``host.HostOptimizer`` | ``device.DeviceStore`` |
| ``offload_optimizer`` (cpu), ``0 < offload_optimizer_ratio < 1`` | ``split.SplitOptimizer`` | ``device.DeviceStore`` |
| ``offload_optimizer`` (cpu), ``offload_optimizer_ratio=0`` | ``device.OptimizerPlacement`` | as no offload |
| ``offload_optimizer_device="nvme"`` | ``nvme.NvmeOptimizer`` | ``device.DeviceStore`` |
| ``offload_parameters`` (cpu) | | ``host.HostStore`` |
| ``offload_params_device="nvme"`` | | ``nvme.NvmeStore`` |

At full width with every master on the device, nothing rests between gathers: a gather reads the
master (``MasterAlias``) or casts it (``CastMaster``, as FSDP2 casts its sharded parameter at each
all-gather). A ``DeviceStore`` keeps the working-dtype shard (2 bytes per parameter / world size in
bf16) where masters are off the device (any optimizer offload, partial included, or NVMe), and the
INT8 payload (about 1.06 bytes) whenever weights are quantized and the parameters stay on the device.

``SplitOptimizer`` (partial offload) holds a ``host.HostOptimizer`` for the units ``split.host_units``
picks (largest first, until their parameter elements reach the ratio) and a ``device.OptimizerPlacement``
for the rest, and hands each call for a unit to its owner.

The generic swap space the NVMe placements build on is ``lightning_zeroq.swap``.
"""

from __future__ import annotations

import torch

from typing import Sequence

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.offload.device import CastMaster, DeviceStore, MasterAlias, OptimizerPlacement, ShardStore
from lightning_zeroq.zero.offload.host import HostOptimizer, HostStore
from lightning_zeroq.zero.offload.nvme import NvmeOptimizer, NvmeStore
from lightning_zeroq.zero.offload.split import SplitOptimizer, host_units

__all__ = ["OptimizerPlacement", "ShardStore", "SplitOptimizer", "host_units", "optimizer_placement", "shard_store"]


def optimizer_placement(
    config: ZeroConfig, device: torch.device, param_dtype: torch.dtype, rank: int, world_size: int,
    layouts: Sequence[UnitLayout],
) -> OptimizerPlacement:
    if not _offloads_optimizer(config):
        return OptimizerPlacement(device)
    if config.offload_optimizer_device == "nvme":
        assert config.nvme_path is not None  # ZeroConfig checks it
        return NvmeOptimizer(device, param_dtype, world_size, nvme_path=config.nvme_path, rank=rank)
    host = HostOptimizer(device, param_dtype, world_size)
    if config.offload_optimizer_ratio == 1.0:
        return host
    return SplitOptimizer(device, host, host_units(layouts, config.offload_optimizer_ratio))


def _offloads_optimizer(config: ZeroConfig) -> bool:
    """Some master and optimizer state is off the device (ratio 0 offloads nothing)."""
    return config.offload_optimizer and config.offload_optimizer_ratio > 0.0


def shard_store(
    config: ZeroConfig,
    device: torch.device,
    *,
    payload_dtype: torch.dtype,
    payload_numels: dict[int, int],
    param_dtype: torch.dtype,
    rank: int,
) -> ShardStore:
    """The store of stage 3's transient units (``payload_numels``: unit index -> payload elements)."""
    if config.offload_parameters and config.offload_params_device == "nvme":
        assert config.nvme_path is not None
        return NvmeStore(device, payload_dtype, payload_numels, nvme_path=config.nvme_path, rank=rank)
    if config.offload_parameters:
        return HostStore(device, payload_dtype, payload_numels)
    if not config.quantized_weights and not _offloads_optimizer(config):
        if param_dtype == torch.float32:
            return MasterAlias()  # the fp32 master on the device is already the working shard
        return CastMaster(param_dtype)  # cast at each gather: the bytes a DeviceStore would keep, bitwise
    return DeviceStore(device, payload_dtype, payload_numels)
