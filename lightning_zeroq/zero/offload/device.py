"""No offload: master shards and optimizer state on the compute device, and the base of every placement.

``OptimizerHome`` plays the three roles of ``roles.py`` (``Masters``, ``Gradients``, ``Updater``)
for the device, where most of them are nothing to do, and adds the lifecycle the build and the stepper
call: ``adopt_master`` (build: take this rank's fp32 shard, return the master to keep),
``store_built`` (stage 3's store, ``stores.py``), ``attach`` (an optimizer bound to the master
segments), ``state_loaded`` (its state just loaded), ``optimizer_replaced`` (a twin holds it after
``release_module``), ``step_done`` (after a step: ``auto.AutoSplit`` decides there) and ``close``.
The host placements override what offload changes (``host.py``, ``nvme.py``); ``split.py`` hands each
unit's calls to the placement that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.zero.unit import Unit

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_zeroq.ops.host_adam import HostAdam
    from lightning_zeroq.zero.offload.stores import ShardStore
    from lightning_zeroq.zero.optim.binding import Binding


class OptimizerHome:
    """Masters and optimizer state on the compute device; the optimizer steps all units at once. Its empty
    methods are the device's own answers (nothing to copy, wait for or move), not a null placement
    (``docs/DESIGN.md``, "No feature, one way"): each placement derives from it and overrides what it changes."""

    masters_may_move = False
    """Masters come to the device after the engine is built (``auto.AutoSplit``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def adopt_master(self, index: int, shard: Tensor) -> Tensor:
        return shard.clone()

    def master_on_device(self, index: int) -> bool:
        """Unit ``index``'s master stays on the compute device (so stage 3 can gather from it)."""
        return True

    def attach(self, units: Sequence[Unit], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass

    def state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def optimizer_replaced(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        """``new`` holds ``old``'s state from now on (``release_module`` handed ``old`` back to the user)."""

    def step_done(
        self,
        units: Sequence[Unit],
        optimizers: Sequence[torch.optim.Optimizer],
        stepped: bool,
        group: Optional["dist.ProcessGroup"],
    ) -> None:
        """After a step and the window's end (``stepped``: the optimizer ran). ``auto.AutoSplit`` decides here."""

    def resident(self, units: Sequence[Unit]) -> Iterator[Unit]:
        yield from units

    def step_batches(self, units: Sequence[Unit]) -> Iterator[list[Unit]]:
        yield list(units)

    def begin_backward(self, last: bool) -> None:
        pass

    def grad_reduced(self, unit: Unit) -> None:
        pass

    def gradients_ready(self, units: Sequence[Unit]) -> None:
        pass

    def gradients_done(self, units: Sequence[Unit]) -> None:
        pass

    def step_grad(self, unit: Unit) -> Tensor:
        return unit.grad

    def clear_spans(self, unit: Unit, spans: Sequence[slice]) -> None:
        pass  # the device's shard is the one the optimizer reads

    def matrix_grad(self, unit: Unit) -> tuple[Tensor, float]:
        return self.step_grad(unit), 1.0

    def host_kernel(self, unit: Unit) -> Optional["HostAdam"]:
        return None

    def kernel_copy(self, unit: Unit) -> Optional[Tensor]:
        return None

    def copied(self, unit: Unit, spans: Sequence[slice]) -> None:
        pass

    def write_working(self, unit: Unit, out: Tensor, spans: Sequence[slice]) -> None:
        for span in spans:
            out[span].copy_(unit.master[span])  # one copy that casts

    def scale_grads(self, unit: Unit, spans: Sequence[slice], multiplier: float) -> None:
        grad = self.step_grad(unit)
        for span in spans:
            grad[span].mul_(multiplier)

    def step_batch(self, batch: Sequence[Unit], binding: "Binding", used: Sequence[Any]) -> bool:
        """Step ``batch`` here (True), or leave it to the optimizer's own ``step()`` (False)."""
        return False

    def host_working(self, unit: Unit, dtype: torch.dtype) -> Optional[Tensor]:
        return None

    def store_built(self, store: "ShardStore") -> None:
        """Stage 3's shard store, once built (a host store's buffers take the host step's bf16 copies;
        ``auto.AutoSplit`` moves units within a split store)."""

    def device_master(self, unit: Unit) -> Tensor:
        return unit.master

    def device_working(self, unit: Unit, dtype: torch.dtype) -> Tensor:
        return unit.master.to(dtype)

    def published(self, unit: Unit) -> None:
        pass

    def end_window(self) -> None:
        pass

    def close(self) -> None:
        pass
