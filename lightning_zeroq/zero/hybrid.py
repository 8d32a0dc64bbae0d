"""Hybrid sharding (``shard_group_size``): shard inside groups of ranks, replicate across them.

The world's ranks are cut into consecutive *shard groups* of ``shard_group_size`` ranks (FSDP's
HSDP, DeepSpeed's MiCS); each holds one full copy of the sharded state (stages 1-3). A rank's
*replica group* is the ranks at its position in every shard group: they hold the same shard.

- Sharding, stage 3 gathers, the optimizer step, norms: inside the shard group (``Topology.group``),
  exactly as plain ZeRO over a world of ``shard_group_size`` ranks.
- Gradients: reduce-scattered inside the shard group, then summed across groups on the replica group
  (``grad_wire.AcrossGroups``), so every group steps on the whole world's average.
- The first broadcast (every rank starts from rank 0's values) and the step's agreement on used
  parameters and non-finite gradients span the whole world (``Topology.world_group``).

Link-aware quantization: the traffic between groups (the slow link between nodes, when a group is a
node) is only the gradients' sum across groups; weights never cross groups, as every group steps its
own copy. ``quantize_cross_group_only`` puts INT8 on that hop alone and keeps everything inside a
group at full width; without it, ``quantized_gradients`` / ``quantized_weights`` quantize every hop
they travel on.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from lightning_zeroq.config import check_shard_group_size
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero.grad_wire import AcrossGroups, FullWidthReduce, GradientWire, Int8Reduce
from lightning_zeroq.zero.layout import ALIGN
from lightning_zeroq.zero.policies import Quantization


@dataclass(frozen=True)
class Topology:
    world_group: Optional[dist.ProcessGroup]
    """All data-parallel ranks (``None``: the default group)."""
    group: Optional[dist.ProcessGroup]
    """This rank's shard group (``world_group`` itself without hybrid groups)."""
    replica_group: Optional[dist.ProcessGroup]
    """The ranks holding this rank's shard in the other groups (``None`` without hybrid groups)."""
    rank: int
    world_size: int
    """Rank and size in the shard group."""
    replica_rank: int
    num_groups: int
    """Which shard group this rank is in, and how many there are."""
    int8_weights: bool
    int8_gradients_in_group: bool
    int8_gradients_across: bool

    @property
    def hybrid(self) -> bool:
        return self.replica_group is not None

    def align(self, quantization: Quantization) -> int:
        """What every shard's length is a multiple of: ``ALIGN``, whole INT8 groups where anything is
        quantized, and whole INT8 groups per shard group for the INT8 sum across groups."""
        align = math.lcm(ALIGN, quantization.group_size) if quantization.any else ALIGN
        return align * self.num_groups if self.int8_gradients_across else align

    def gradient_wire(self, device: torch.device, group_size: int) -> GradientWire:
        divisor = self.world_size * self.num_groups  # the whole world's average, in the first hop
        inner = (
            Int8Reduce(self.group, device, group_size, divisor)
            if self.int8_gradients_in_group
            else FullWidthReduce(self.group, divisor)
        )
        if not self.hybrid:
            return inner
        return AcrossGroups(inner, self.replica_group, device, self.int8_gradients_across, group_size)


def topology(shard_size: int, quantization: Quantization, group: Optional[dist.ProcessGroup]) -> Topology:
    """The groups of ``shard_size`` ranks (``shard_group_size``'s answer) on ``group`` (collective the
    first time, see ``groups``), and where INT8 travels on them."""
    q = quantization
    world_rank, world_size = rank_and_size(group)
    shard, replica = groups(group, shard_size)
    rank, size = rank_and_size(shard)
    replica_rank, num_groups = rank_and_size(replica) if replica is not None else (0, 1)
    cross_only = replica is not None and q.cross_group_only
    if world_rank == 0 and q.cross_group_only and q.gradients and replica is None:
        warnings.warn(
            f"ZeroConfig: quantize_cross_group_only=True has no effect: one group holds all {world_size} "
            "ranks and nothing crosses groups; set shard_group_size to a divisor of the world size.",
            stacklevel=3,
        )
    return Topology(
        group,
        shard,
        replica,
        rank,
        size,
        replica_rank,
        num_groups,
        int8_weights=q.weights and not cross_only,
        int8_gradients_in_group=q.gradients and not cross_only,
        int8_gradients_across=q.gradients,
    )


def given(size: Union[None, int, str], ranks_per_node: Optional[int]) -> str:
    """``shard_group_size`` as the user gave it, with what ``"node"`` resolves to on this node."""
    if size == "node" and ranks_per_node is not None:
        return f"'node' ({ranks_per_node} ranks on this node)"
    return repr(size)


def shard_group_size(size: Union[None, int, str], world_size: int, ranks_per_node: Optional[int] = None) -> int:
    """The ranks per shard group: ``ZeroConfig.shard_group_size`` checked against the world size (None:
    all ranks). ``"node"``: ``ranks_per_node`` (the strategies know it from the cluster environment)."""
    if size is None:
        return world_size
    if size == "node":
        if ranks_per_node is None:
            raise ValueError(
                "ZeroConfig.shard_group_size='node' needs the ranks per node, which the ZeroQ strategies know; with "
                "ZeroEngine directly pass the number instead (e.g. int(os.environ['LOCAL_WORLD_SIZE'])) or "
                "ranks_per_node=."
            )
        return check_shard_group_size(ranks_per_node, world_size, given(size, ranks_per_node))
    return check_shard_group_size(size, world_size)


_MADE: dict[tuple, tuple] = {}


def groups(
    group: Optional[dist.ProcessGroup], shard_size: int
) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """``(shard group, replica group)`` of this rank when ``group``'s ranks (default: all) are cut into
    consecutive blocks of ``shard_size``; ``(group, None)`` for one block. The first call for a
    (ranks, size) is collective on the whole world, as ``dist.new_group`` is: every rank creates every
    group in the same order (the blocks, then each position's replica group). Later calls reuse them,
    until the default group is replaced."""
    rank, size = rank_and_size(group)
    if shard_size == size:
        return group, None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    key = (tuple(ranks), shard_size)
    made = _MADE.get(key)
    if made is None or made[0] is not dist.group.WORLD:
        blocks = [ranks[i : i + shard_size] for i in range(0, size, shard_size)]
        me = ranks[rank]
        shard = replica = None
        for block in blocks:
            new = dist.new_group(block)
            shard = new if me in block else shard
        for position in range(shard_size):
            members = [block[position] for block in blocks]
            new = dist.new_group(members)
            replica = new if me in members else replica
        made = _MADE[key] = (dist.group.WORLD, shard, replica)
    return made[1], made[2]
