"""The optimizer side of a step: whether to step (non-finite gradients, fp16 overflow), the pending
gradient multiplier (unscaling and clipping), and the step loop over resident units.

Each optimizer is a ``Binding`` (``optimizers.py``). With one optimizer it covers every segment and
its multiplier is applied to whole gradient shards; with several (disjoint parameters) each applies
its own to its own segments, and stepping one leaves the others' gradients in place, as
``optimizer.step()`` does with DDP.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.loss_scaler import DynamicLossScaler
from lightning_zeroq.zero.offload import OptimizerPlacement
from lightning_zeroq.zero.optimizers import Binding, OneStep
from lightning_zeroq.zero.reducer import Agreement
from lightning_zeroq.zero.unit import Unit

log = logging.getLogger("lightning_zeroq")


def decide_nonfinite(agreement: Agreement, bad_units: list[int], *, scaler: Optional[DynamicLossScaler],
                     action: str, step: int, names: str, rank: int) -> bool:
    """True: skip this step (fp16 overflow, or ``action == "skip"``); raises for ``"error"``."""
    where = f"on rank(s) {agreement.nonfinite_ranks}, in the gradients of {names}"
    if scaler is not None and (not scaler.dynamic or scaler.scale > scaler.min_scale):
        if rank == 0:
            log.info(f"fp16 overflow in step {step} {where}: step skipped, loss scale {scaler.scale:g} -> "
                     f"{scaler.next_scale(overflow=True):g}")
        return True
    if action == "skip":
        if rank == 0:
            log.warning(f"non-finite gradients in step {step} {where}: step skipped (nonfinite_gradients='skip')")
        return True
    raise RuntimeError(
        f"ZeroQ: non-finite gradients (inf or NaN) in optimizer step {step} {where}"
        + (f", at the minimum loss scale {scaler.scale:g}" if scaler is not None else "")
        + ". Stepping would write them into the model. Find their source with "
        "torch.autograd.set_detect_anomaly(True) (Trainer(detect_anomaly=True)), lower the learning rate or "
        "clip gradients; or pass nonfinite_gradients='skip' to skip such steps."
    )


@torch.no_grad()
def apply_multiplier(binding: Binding, units: Sequence[Unit], placement: OptimizerPlacement, whole: bool) -> None:
    """Scale this optimizer's gradients (where the optimizer reads them) by its pending multiplier."""
    if binding.multiplier == 1.0:
        return
    for unit in units:
        grad = placement.step_grad(unit)
        if whole:
            grad.mul_(binding.multiplier)
        else:
            for _, seg in binding.optimized.get(unit.index, ()):
                grad[seg.shard_span].mul_(binding.multiplier)
    binding.multiplier = 1.0


@torch.no_grad()
def segments_norm_squared(binding: Binding, units: Sequence[Unit], device: torch.device) -> Tensor:
    """This rank's part of the squared 2-norm of one optimizer's gradients."""
    local = torch.zeros((), device=device)
    for unit in units:
        for _, seg in binding.optimized.get(unit.index, ()):
            local += unit.grad[seg.shard_span].pow(2).sum()
    return local


def run(binding: Binding, units: Sequence[Unit], placement: OptimizerPlacement, gatherer: Gatherer,
        used: Tensor) -> None:
    """Give the optimizer the gradient of every used segment (unused segments get ``None``, so the
    optimizer leaves value and state alone, as ``torch.optim`` does with DDP), step it once per batch
    of resident units, and publish each batch's new masters."""
    used_ids = used.tolist()
    mine = [u for u in units if u.index in binding.unit_ids]
    with OneStep(binding.optimizer) as one_step:
        for batch in placement.step_batches(mine):
            for unit in batch:
                grad = placement.step_grad(unit)
                for view, seg in binding.optimized[unit.index]:
                    if used_ids[unit.param_id(seg.param)]:
                        view.grad = grad[seg.shard_span]
            with torch.profiler.record_function("zeroq.optimizer_step"):
                one_step.step()
            for unit in batch:
                for view, _ in binding.optimized[unit.index]:
                    view.grad = None
                with torch.profiler.record_function("zeroq.publish"):
                    gatherer.publish(unit)
