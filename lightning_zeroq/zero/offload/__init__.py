"""Placements: where the optimizer's state and stage 3's resting parameter shards live.

Chosen once, when the engine is built, from the ``Offload`` policy (``policies.py``, made from the
``ZeroConfig`` options below); the engine then calls the chosen objects at fixed points and never
branches on the offload mode itself.

| config | optimizer placement | stage-3 shard store |
|---|---|---|
| no offload | ``device.OptimizerHome`` | full width: ``stores.MasterAlias`` (fp32) or ``stores.CastMaster`` (bf16/fp16); INT8: ``stores.DeviceStore`` |
| ``offload_optimizer`` (cpu) | ``host.HostOptimizer`` | ``stores.DeviceStore`` |
| ``offload_optimizer`` (cpu), ``0 < offload_optimizer_ratio < 1`` | ``split.SplitOptimizer`` | full width: ``stores.SplitStore`` (as no offload for the units whose master stays on the device, ``stores.DeviceStore`` for the others); INT8: ``stores.DeviceStore`` |
| ``offload_optimizer`` (cpu), ``offload_optimizer_ratio="auto"`` | ``auto.AutoSplit`` (a ``SplitOptimizer`` that starts with every unit on the host and brings back what fits after the first step) | full width: ``stores.SplitStore`` with every unit off the device at first; a unit brought back gathers from its master from then on, as with a ratio, its payload dropped; INT8: ``stores.DeviceStore`` |
| ``offload_optimizer`` (cpu), ``offload_optimizer_ratio=0`` | ``device.OptimizerHome`` | as no offload |
| ``offload_optimizer_device="nvme"`` | ``nvme.NvmeOptimizer`` | ``stores.DeviceStore`` |
| ``offload_parameters`` (cpu) | | ``stores.HostStore`` |
| ``offload_params_device="nvme"`` | | ``nvme.NvmeStore`` |

At full width with every master on the device, nothing rests between gathers: a gather reads the
master (``MasterAlias``) or casts it (``CastMaster``, as FSDP2 casts its sharded parameter at each
all-gather); with partial offload so do the units whose master stays on the device. A
``DeviceStore`` keeps the working-dtype shard (2 bytes per parameter / world size in bf16) of the units
whose master is off the device (optimizer offload to the host or NVMe), so a gather does not wait for
the host, and the INT8 payload (about 1.06 bytes) whenever weights are quantized and the parameters
stay on the device.

``SplitOptimizer`` (partial offload) holds a ``host.HostOptimizer`` for the units ``split.host_units``
picks (largest first, or last first with speculative or asynchronous steps, until their parameter
elements reach the ratio) and a ``device.OptimizerHome``
for the rest, and hands each call for a unit to its owner.

The generic swap space the NVMe placements build on is ``lightning_zeroq.swap``.
"""

from lightning_zeroq.zero.offload.auto import AutoSplit
from lightning_zeroq.zero.offload.device import OptimizerHome
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.offload.nvme import NvmeOptimizer, NvmeStore
from lightning_zeroq.zero.offload.select import host_part, optimizer_home, shard_store
from lightning_zeroq.zero.offload.split import SplitOptimizer, host_units
from lightning_zeroq.zero.offload.stores import CastMaster, DeviceStore, HostStore, MasterAlias, ShardStore, SplitStore

__all__ = [
    "AutoSplit",
    "CastMaster",
    "DeviceStore",
    "HostOptimizer",
    "HostStore",
    "MasterAlias",
    "NvmeOptimizer",
    "NvmeStore",
    "OptimizerHome",
    "ShardStore",
    "SplitOptimizer",
    "SplitStore",
    "host_part",
    "host_units",
    "optimizer_home",
    "shard_store",
]
