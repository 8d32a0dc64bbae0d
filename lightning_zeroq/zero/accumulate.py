"""Where a backward's gradients wait when it does not reduce them: chosen once per engine.

A backward *reduces* (reduce-scatters every unit into its fp32 gradient shard as it goes) always in
stages 2/3, and in stage 1 only when it is the last of a managed window (``boundary``). A stage-1
backward that does not reduce leaves its gradients *local*, and the window's first reduction (the
boundary backward, or ``finalize``) starts from them:

- ``EveryBackward`` (stages 2/3): nothing is ever local.
- ``InGrad`` (stage 1, fp32 working weights): local gradients accumulate in ``p.grad`` without loss.
- ``Fp32Sum`` (stage 1, bf16/fp16 working weights): summed in one fp32 buffer per unit, as a bf16
  ``p.grad`` would lose precision over many micro-batches (4 bytes per parameter, DDP's cost). The
  buffers are made by the first backward that accumulates locally, for every unit at once on every
  rank alike; from then on every reduction of a unit starts from its sum, in fp32, as all ranks
  must reduce a unit in the same dtype.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.zero.policies import Sharding
from lightning_zeroq.zero.unit import Unit


class EveryBackward:
    """Stages 2/3: every backward reduces; nothing waits."""

    def __init__(self, param_dtype: torch.dtype, device: torch.device) -> None:
        self.param_dtype, self.device = param_dtype, device
        self.pending = False
        """Some backward left gradients local that no reduction took yet."""

    def begin(self, boundary: bool) -> bool:
        """A backward opens (``boundary``: a managed window ends with it). Returns whether it reduces."""
        return True

    def add(self, unit: Unit, i: int, param: Tensor) -> None:
        """``param`` (the ``i``-th of ``unit``) got its gradient in a backward that does not reduce."""

    def local(self, unit: Unit) -> bool:
        """``start(unit)`` would return a buffer (a reduction of ``unit`` must start from it)."""
        return False

    def start(self, unit: Unit) -> Optional[Tensor]:
        """The flat buffer a reduction of ``unit`` starts from (the gradients in ``p.grad`` are added to it),
        or None where nothing is local: the reduction then starts from the gradients themselves."""
        return None

    def reduced(self) -> None:
        """Every unit was reduced: nothing is local any more."""
        self.pending = False

    def clear(self, written: bool) -> None:
        """The window ends (``written``: some backward ran in it)."""
        self.pending = False

    def drop(self, unit: Unit, span: slice) -> None:
        """Drop the local gradient of one parameter of ``unit`` (its ``span`` in the unit)."""


class InGrad(EveryBackward):
    """Stage 1, fp32 working weights: only a managed window's last backward reduces (``managed``);
    the others leave their gradients in ``p.grad``."""

    def __init__(self, managed: bool, param_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(param_dtype, device)
        self.managed = managed

    def begin(self, boundary: bool) -> bool:
        reduces = boundary and self.managed
        if not reduces:
            self.pending = True
        return reduces


class Fp32Sum(InGrad):
    """Stage 1, bf16/fp16 working weights: local gradients are summed per unit in fp32."""

    def __init__(self, managed: bool, param_dtype: torch.dtype, device: torch.device, units: Sequence[Unit]) -> None:
        super().__init__(managed, param_dtype, device)
        self.units = units
        self.sums: dict[int, Tensor] = {}
        """Per unit index: the fp32 sum of the local gradients (made by the first local backward)."""

    def begin(self, boundary: bool) -> bool:
        reduces = super().begin(boundary)
        if not reduces and not self.sums:
            self.sums = {u.index: torch.zeros(u.layout.padded_numel, device=self.device) for u in self.units}
        return reduces

    @torch.no_grad()
    def add(self, unit: Unit, i: int, param: Tensor) -> None:
        if param.grad is None:
            return
        self.sums[unit.index][unit.layout.slots[i].span].add_(param.grad.reshape(-1))
        param.grad = None

    def local(self, unit: Unit) -> bool:
        return unit.index in self.sums

    def start(self, unit: Unit) -> Optional[Tensor]:
        # An fp32 local sum is reduced in fp32 (once per window, so twice the bytes of one bf16
        # reduction buys the exact sum).
        local = self.sums.get(unit.index)
        if local is None:
            return super().start(unit)
        flat = local.clone()
        local.zero_()
        return flat

    def clear(self, written: bool) -> None:
        super().clear(written)
        # An empty window's sums are zero already (every gradient opens a window; the last clear zeroed them).
        for local in self.sums.values() if written else ():
            local.zero_()

    def drop(self, unit: Unit, span: slice) -> None:
        local = self.sums.get(unit.index)
        if local is not None:
            local[span].zero_()


def accumulation(
    sharding: Sharding, units: Sequence[Unit], param_dtype: torch.dtype, device: torch.device
) -> EveryBackward:
    """The accumulation ``sharding`` and the working dtype call for."""
    if sharding.stage >= 2:
        return EveryBackward(param_dtype, device)
    if param_dtype == torch.float32:
        return InGrad(sharding.managed_accumulation, param_dtype, device)
    return Fp32Sum(sharding.managed_accumulation, param_dtype, device, units)
