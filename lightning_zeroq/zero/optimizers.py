"""Which optimizers ZeroQ can shard, how one is bound to the master shards, and how an offloaded
optimizer steps on the host.

Sharding cuts every parameter at arbitrary element boundaries, so only elementwise updates give the
same result as on whole tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from lightning_zeroq.zero.layout import Segment
from lightning_zeroq.zero.unit import Unit


ELEMENTWISE_OPTIMIZERS: list[type] = [
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
]


def register_elementwise_optimizer(cls: type) -> type:
    """Declare an optimizer class elementwise, so ZeroQ accepts it. Usable as a class decorator."""
    if cls not in ELEMENTWISE_OPTIMIZERS:
        ELEMENTWISE_OPTIMIZERS.append(cls)
    return cls


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, tuple(ELEMENTWISE_OPTIMIZERS)):
        name = type(optimizer).__name__
        raise ValueError(
            f"ZeroQ cannot shard optimizer {name}: it shards every parameter across ranks, so the update "
            f"must be elementwise, and {name} is not known to be (known: "
            f"{', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}). If {name} is elementwise, declare "
            f"it with lightning_zeroq.register_elementwise_optimizer({name}); otherwise use DDP or FSDP."
        )


FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def prefer_fast_host_step(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Optimizer offload steps on the CPU: use torch's fused CPU kernel where torch has one (Adam,
    AdamW, SGD, Adagrad; 3.3x plain AdamW on 100M parameters, benchmarks/results/cpu_optimizer_cpu.txt),
    foreach for the other optimizers that have it. The update is the same; only the kernel differs."""
    if isinstance(optimizer, FUSED_ON_CPU):
        group["fused"], group["foreach"] = True, False
    elif "foreach" in optimizer.defaults:
        group["foreach"] = True


def bind_to_shards(
    optimizer: torch.optim.Optimizer, module: nn.Module, units: Sequence[Unit], *, first_time: bool
) -> dict[int, list[tuple[Tensor, Segment]]]:
    """Rebind ``optimizer``'s param groups to this rank's fp32 master segments, in place.

    The optimizer object itself is kept, so LR schedulers and ``LearningRateMonitor`` that hold it keep
    working; its state starts empty. Returns, per unit index, the (master segment, segment) pairs the
    optimizer steps.
    """
    check_elementwise(optimizer)
    group_of: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in group_of:
                raise ValueError("A parameter appears in two optimizer param groups; list each once.")
            group_of[id(p)] = gi
    module_params = {id(p) for p in module.parameters()}
    foreign = [k for k in group_of if k not in module_params]
    if foreign and first_time:
        raise ValueError(
            f"The optimizer holds {len(foreign)} tensor(s) that are not parameters of the module; "
            "build the optimizer from self.parameters() in configure_optimizers."
        )
    new_params: list[list[Tensor]] = [[] for _ in optimizer.param_groups]
    optimized: dict[int, list[tuple[Tensor, Segment]]] = {u.index: [] for u in units}
    for unit in units:
        for seg, view in zip(unit.segments, unit.segment_masters):
            gi = group_of.get(id(unit.params[seg.param]))
            if gi is not None:
                new_params[gi].append(view)
                optimized[unit.index].append((view, seg))
    for group, views in zip(optimizer.param_groups, new_params):
        group["params"] = views
    optimizer.state.clear()
    return optimized
