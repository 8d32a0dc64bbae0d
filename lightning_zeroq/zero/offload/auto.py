"""``offload_optimizer_ratio="auto"``: as many units on the device as the memory budget holds, decided
from the memory measured in the first step.

Every unit starts as with full offload (master and optimizer state on the host). After the first step
that ran, ``AutoSplit.step_done`` reads the device's peak (``torch.cuda.max_memory_allocated``: the
forward, backward and step with everything offloaded) and what moving each unit costs there: its fp32
master and the optimizer state the step created for it. Every rank contributes, in one MAX all-reduce,
its own shortfall (peak minus budget) and its own costs, so all ranks decide alike from the worst of
them. Two choices of the units that move their master and state to the device and step there from
then on (``split.SplitOptimizer``) are made (``choose``), and the one that keeps more parameter
elements on the device is taken (a tie: the second):
- largest cost first (ties: lower index), each unit whose cost still fits under the budget;
- a ratio's choice: units go to the host in the order ``offload_optimizer_ratio`` takes them
  (``split.host_units``: largest first, ties lower index) until the rest fits, which is the set of the
  smallest ratio that fits the budget.
So "auto" never keeps fewer elements on the device than the best hand-picked ratio under the same
budget would, and where it keeps as many, it is that ratio's choice. The others stay on the host. The new peak is the measured one plus what moved, at most the budget. In
stage 3 at full width a unit brought back gathers from its master from then on, as a hand-picked
ratio's device units do (cast at each gather), and the working-dtype payload it rested on the device
while its master was on the host (2 bytes per element, counted in the measured peak) is released, so
it costs that much less (``split.SplitStore.master_moved``); with INT8 weights the payload stays.

On a CPU device there is no device memory to fill: ``"auto"`` warns once and keeps every unit on the
host (as ratio 1). Tests replace ``measure`` to run the decision on the CPU.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_zeroq.config import memory_budget
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.offload.split import SplitOptimizer
from lightning_zeroq.zero.offload.stores import ShardStore, freed_by_moving, master_moved
from lightning_zeroq.zero.unit import Unit

log = logging.getLogger("lightning_zeroq")

MARGIN = 0.10
"""Default budget: the device's free memory after the first step, less this share of its memory."""

Measure = Callable[[], Optional[tuple[int, int, int]]]
"""Returns (peak allocated, free incl. the allocator's unused reserve, total) bytes, or None (no device memory)."""


def cuda_memory(device: torch.device) -> Measure:
    def measure() -> Optional[tuple[int, int, int]]:
        if device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.max_memory_allocated(device), free + unused, total

    return measure


def choose(costs: Sequence[int], sizes: Sequence[int], headroom: int) -> list[int]:
    """The units to keep on the device (sorted), given each one's device cost in bytes, its parameter
    elements, and the bytes free under the budget: of the two choices in the module's docstring, the
    one with more elements on the device (a tie: the ratio's)."""
    greedy: list[int] = []
    left = headroom
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        if costs[index] <= left:
            greedy.append(index)
            left -= costs[index]
    ratio = set(range(len(costs)))
    needed = sum(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-sizes[i], i)):  # split.host_units' order
        if needed <= headroom:
            break
        ratio.discard(index)
        needed -= costs[index]
    if sum(sizes[i] for i in greedy) > sum(sizes[i] for i in ratio):
        return sorted(greedy)
    return sorted(ratio)


class AutoSplit(SplitOptimizer):
    """Starts with every unit on the host; ``step_done`` brings back what fits, once."""

    masters_may_move = True

    def __init__(self, device: torch.device, host: HostOptimizer, num_units: int, budget: Any, rank: int) -> None:
        super().__init__(device, host, frozenset(range(num_units)))
        self.budget, self.rank = budget, rank
        self.store: Optional[ShardStore] = None
        """Stage 3's shard store (``store_built``): a unit brought back gathers from its master there."""
        self.measure: Measure = cuda_memory(device)
        self.decided = False
        self.decision: Optional[dict] = None
        """What was decided (units and bytes each side), for logs and tests."""

    def store_built(self, store: ShardStore) -> None:
        super().store_built(store)
        self.store = store

    def step_done(
        self,
        units: Sequence[Unit],
        optimizers: Sequence[torch.optim.Optimizer],
        stepped: bool,
        group: Optional[dist.ProcessGroup],
    ) -> None:
        if self.decided or not stepped:
            return
        self.decided = True
        measured = self.measure()
        if measured is None:
            warnings.warn(
                "offload_optimizer_ratio='auto' on a CPU device: there is no device memory to fill, so "
                "every unit's optimizer state stays offloaded (as offload_optimizer_ratio=1).",
                stacklevel=3,
            )
            return
        peak, free, total = measured
        budget = memory_budget(self.budget, total)
        if budget is None:
            budget = peak + free - int(MARGIN * total)
        costs = [_device_cost(unit, optimizers) - freed_by_moving(self.store, unit.index) for unit in units]
        # One MAX all-reduce: the worst shortfall (peak - budget) and the largest cost of each unit.
        stats = torch.tensor(
            [float(peak - budget)] + [float(c) for c in costs], dtype=torch.float64, device=self.device
        )
        if rank_and_size(group)[1] > 1:
            comm.all_reduce(stats, dist.ReduceOp.MAX, group)
        headroom, costs = -int(stats[0].item()), [int(c) for c in stats[1:].tolist()]
        keep = choose(costs, [unit.layout.numel for unit in units], headroom)
        for index in keep:
            self._bring_back(units[index], optimizers)
        self.host_units = frozenset(i for i in range(len(units)) if i not in keep)
        gib = 2**30
        self.decision = {
            "device_units": sorted(keep),
            "host_units": sorted(self.host_units),
            "device_bytes": sum(costs[i] for i in keep),
            "host_bytes": sum(costs[i] for i in self.host_units),
            "peak_bytes": peak,
            "budget_bytes": budget,
        }
        if self.rank == 0:
            log.info(
                f"offload_optimizer_ratio='auto': {len(keep)} of {len(units)} units keep master and optimizer state on "
                f"the device ({self.decision['device_bytes'] / gib:.2f} GiB), {len(self.host_units)} on the host "
                f"({self.decision['host_bytes'] / gib:.2f} GiB); first step's peak {peak / gib:.2f} GiB, budget "
                f"{budget / gib:.2f} GiB" + ("" if headroom >= 0 else " (below the peak with everything offloaded)")
            )

    def _bring_back(self, unit: Unit, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Master and optimizer state of ``unit`` to the device; the host's buffers for it are dropped."""
        self.host.wait_device_reads(unit.index)
        unit.set_master(unit.master.to(self.device))
        views = {id(v) for v in unit.segment_masters}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                fused = bool(group.get("fused"))
                for view in group["params"]:
                    if id(view) not in views:
                        continue
                    state = optimizer.state.get(view, {})
                    for key, value in state.items():
                        # A fused step keeps its step count beside the parameter; the others on the CPU.
                        if isinstance(value, torch.Tensor) and (key != "step" or fused):
                            state[key] = value.to(self.device)
        self.host.landing.forget(unit.index)
        if self.host.kernel is not None:
            self.host.kernel.forget(unit.index)
        if self.host.spec is not None:
            self.host.spec.forget(unit.index)
        master_moved(self.store, unit.index)


def _device_cost(unit: Unit, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Device bytes the unit's master and optimizer state take once moved there, as the caching
    allocator counts them (each tensor rounded up to its 512-byte blocks)."""
    views = {id(v) for v in unit.segment_masters}
    state = sum(
        _allocated(value)
        for optimizer in optimizers
        for view, values in optimizer.state.items()
        if id(view) in views
        for value in values.values()
        if isinstance(value, torch.Tensor)
    )
    return _allocated(unit.master) + state


def _allocated(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // 512) * 512
