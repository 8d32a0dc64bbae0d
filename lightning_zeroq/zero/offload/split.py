"""Partial CPU optimizer offload (``offload_optimizer_ratio`` between 0 and 1, DeepSpeed's ``ratio``).

Some units keep their fp32 master and optimizer state on the host (``host.HostOptimizer``), the
others on the device (``device.OptimizerHome``), decided once from the unit layouts by
``host_units``. ``SplitOptimizer`` hands every call for one unit to the placement that owns it; the
engine sees one placement, as with any other offload mode.

One step: the device units in one batch (one optimizer call; on a GPU its kernels are queued and
run while the CPU goes on), then the host units one at a time, as with full offload. The step
hooks and per-group counters still see one step (``binding.OneStep``), however many batches.

The user's param groups hold segments of both kinds, so the kernel chosen for the host step (torch's
fused CPU kernel where there is one) also steps the device units when torch has it there too
(``prefer_fast_host_step``'s ``also_on``); the update is the same, only the kernel differs.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.ops.host_adam import HostAdam
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.offload.device import OptimizerHome
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.offload.stores import ShardStore
from lightning_zeroq.zero.optim.binding import Binding
from lightning_zeroq.zero.unit import Unit


def host_units(layouts: Sequence[UnitLayout], ratio: float, last_first: bool = False) -> frozenset[int]:
    """The units whose master and optimizer state go to the host for ``offload_optimizer_ratio``.

    The rule: take units largest first (by parameter elements, ``UnitLayout.numel``; ties: the lower
    index first) until the offloaded elements reach ``ratio`` of all of them, i.e. the smallest such
    prefix of that order. Largest first keeps the host's work in few, long unit steps, and the device's
    share in many small units that step at once. With ``last_first`` (host steps that overlap the
    backward or the next forward: ``policies.Host.last_first``) the order is the units' last first
    instead: their gradients land on the host first and the next forward needs them last, so their
    host steps hide best, while the first units (needed first, landed last) step on the device. Ratio 0
    gives no unit, ratio 1 every unit. The layouts are the same on every rank, so is the choice; the
    unpadded sizes make it the same at every world size too.
    """
    total = sum(layout.numel for layout in layouts)
    order = (
        list(reversed(range(len(layouts))))
        if last_first
        else sorted(range(len(layouts)), key=lambda i: (-layouts[i].numel, i))
    )
    chosen: list[int] = []
    offloaded = 0
    for index in order:
        if offloaded >= ratio * total:
            break
        chosen.append(index)
        offloaded += layouts[index].numel
    return frozenset(chosen)


class SplitOptimizer(OptimizerHome):
    """Masters and optimizer state of ``host`` units on the host, of the others on the device."""

    def __init__(self, device: torch.device, host: HostOptimizer, on_host: frozenset[int]) -> None:
        super().__init__(device)
        self.host, self.on_device, self.host_units = host, OptimizerHome(device), on_host
        host.also_on = device  # the groups hold device segments too

    def _of(self, unit: Unit) -> OptimizerHome:
        return self.host if unit.index in self.host_units else self.on_device

    def _split(self, units: Sequence[Unit]) -> tuple[list[Unit], list[Unit]]:
        return ([u for u in units if u.index not in self.host_units], [u for u in units if u.index in self.host_units])

    def adopt_master(self, index: int, shard: Tensor) -> Tensor:
        return (self.host if index in self.host_units else self.on_device).adopt_master(index, shard)

    def master_on_device(self, index: int) -> bool:
        return index not in self.host_units

    def attach(self, units: Sequence[Unit], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        on_device, on_host = self._split(units)
        self.on_device.attach(on_device, optimizers)
        self.host.attach(on_host, optimizers)

    def state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self.on_device.state_loaded(optimizer)
        self.host.state_loaded(optimizer)

    def optimizer_replaced(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        self.host.optimizer_replaced(old, new)

    def resident(self, units: Sequence[Unit]) -> Iterator[Unit]:
        """Every unit stays resident in both parts; the host's units as the host's own walk hands them out
        (after an asynchronous step, before any speculative one, once the device read each master)."""
        hosted = self.host.resident([u for u in units if u.index in self.host_units])
        for unit in units:
            yield next(hosted) if unit.index in self.host_units else unit

    def step_batches(self, units: Sequence[Unit]) -> Iterator[list[Unit]]:
        on_device, on_host = self._split(units)
        if on_device:
            yield from self.on_device.step_batches(on_device)
        if on_host:
            yield from self.host.step_batches(on_host)

    def begin_backward(self, last: bool) -> None:
        self.on_device.begin_backward(last)
        self.host.begin_backward(last)

    def grad_reduced(self, unit: Unit) -> None:
        self._of(unit).grad_reduced(unit)

    def gradients_done(self, units: Sequence[Unit]) -> None:
        on_device, on_host = self._split(units)
        self.on_device.gradients_done(on_device)
        self.host.gradients_done(on_host)

    def gradients_ready(self, units: Sequence[Unit]) -> None:
        on_device, on_host = self._split(units)
        self.on_device.gradients_ready(on_device)
        self.host.gradients_ready(on_host)

    def step_grad(self, unit: Unit) -> Tensor:
        return self._of(unit).step_grad(unit)

    def clear_spans(self, unit: Unit, spans: Sequence[slice]) -> None:
        self._of(unit).clear_spans(unit, spans)

    def matrix_grad(self, unit: Unit) -> tuple[Tensor, float]:
        return self._of(unit).matrix_grad(unit)

    def host_kernel(self, unit: Unit) -> Optional[HostAdam]:
        return self._of(unit).host_kernel(unit)

    def kernel_copy(self, unit: Unit) -> Optional[Tensor]:
        return self._of(unit).kernel_copy(unit)

    def copied(self, unit: Unit, spans: Sequence[slice]) -> None:
        self._of(unit).copied(unit, spans)

    def write_working(self, unit: Unit, out: Tensor, spans: Sequence[slice]) -> None:
        self._of(unit).write_working(unit, out, spans)

    def scale_grads(self, unit: Unit, spans: Sequence[slice], multiplier: float) -> None:
        self._of(unit).scale_grads(unit, spans, multiplier)

    def step_batch(self, batch: Sequence[Unit], binding: Binding, used: Sequence[Any]) -> bool:
        # step_batches yields device units and host units in batches of their own
        return (
            bool(batch)
            and all(u.index in self.host_units for u in batch)
            and self.host.step_batch(batch, binding, used)
        )

    def host_working(self, unit: Unit, dtype: torch.dtype) -> Optional[Tensor]:
        return self._of(unit).host_working(unit, dtype)

    def store_built(self, store: ShardStore) -> None:
        self.host.store_built(store)

    def device_master(self, unit: Unit) -> Tensor:
        return self._of(unit).device_master(unit)

    def device_working(self, unit: Unit, dtype: torch.dtype) -> Tensor:
        return self._of(unit).device_working(unit, dtype)

    def published(self, unit: Unit) -> None:
        self._of(unit).published(unit)

    def end_window(self) -> None:
        self.on_device.end_window()
        self.host.end_window()

    def close(self) -> None:
        self.on_device.close()
        self.host.close()
