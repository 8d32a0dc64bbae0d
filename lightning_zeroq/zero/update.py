"""The optimizer side of a step: whether to step (non-finite gradients, fp16 overflow), the pending
gradient multiplier (unscaling and clipping), and the step loop over resident units.

Each optimizer is a ``Binding`` (``optimizers.py``). How many are attached is an object, chosen again
whenever one is attached: ``OneOptimizer`` (none or one: it covers every segment, its multiplier is
applied to whole gradient shards, its norm is the global norm) or ``SeveralOptimizers`` (disjoint
parameters: each applies its own multiplier to its own segments, and stepping or zeroing one leaves
the others' gradients in place, as ``optimizer.step()`` does with DDP).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq.zero import comm, norms
from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.loss_scaler import DynamicLossScaler
from lightning_zeroq.zero.matrix import is_matrix_optimizer, step_matrices
from lightning_zeroq.zero.offload import OptimizerPlacement
from lightning_zeroq.zero.optimizers import Binding, OneStep
from lightning_zeroq.zero.reducer import Agreement, Reducer
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


class OneOptimizer:
    """None or one optimizer attached (``everything``: the binding of all units, used without one)."""

    def __init__(self, bindings: list[Binding], everything: Binding) -> None:
        self.bindings = bindings
        self.default = bindings[0] if bindings else everything
        """The binding a call without an optimizer means."""

    def binding(self, optimizer: Optional[torch.optim.Optimizer]) -> Binding:
        if optimizer is None:
            return self.default
        for binding in self.bindings:
            if binding.optimizer is optimizer:
                return binding
        raise ValueError(f"{type(optimizer).__name__} is not attached to this engine; attach_optimizer() it first.")

    def spans(self, binding: Binding, unit: Unit) -> list[slice]:
        """The parts of ``unit``'s gradient shard that ``binding``'s optimizer reads."""
        return [slice(None)]

    def norm(self, binding: Binding, units: Sequence[Unit], group: Optional[dist.ProcessGroup],
             device: torch.device) -> Tensor:
        """Collective: the 2-norm of ``binding``'s gradients over all ranks."""
        return norms.global_norm(units, group, device)

    def clear(self, reducer: Reducer, binding: Optional[Binding]) -> None:
        """Drop ``binding``'s gradients (None: all of them)."""
        reducer.clear()


class SeveralOptimizers(OneOptimizer):
    """Several optimizers with disjoint parameters; a call without one means all units."""

    def __init__(self, bindings: list[Binding], everything: Binding) -> None:
        super().__init__(bindings, everything)
        self.default = everything

    def spans(self, binding: Binding, unit: Unit) -> list[slice]:
        return [seg.shard_span for _, seg in binding.optimized.get(unit.index, ())]

    @torch.no_grad()
    def norm(self, binding: Binding, units: Sequence[Unit], group: Optional[dist.ProcessGroup],
             device: torch.device) -> Tensor:
        squared = torch.zeros((), device=device)
        for unit in units:
            spans = self.spans(binding, unit)
            if spans:
                grad = unit.fp32_grad()
                for span in spans:
                    squared += grad[span].pow(2).sum()
        if comm.world(group)[1] > 1:
            comm.all_reduce(squared, dist.ReduceOp.SUM, group)
        return squared.sqrt()

    def clear(self, reducer: Reducer, binding: Optional[Binding]) -> None:
        if binding is None:
            reducer.clear()
        else:
            reducer.clear_params(binding.param_ids, binding.optimized)


def attached(bindings: list[Binding], everything: Binding) -> OneOptimizer:
    """The object for these attached optimizers."""
    return SeveralOptimizers(bindings, everything) if len(bindings) > 1 else OneOptimizer(bindings, everything)


@torch.no_grad()
def apply_multiplier(binding: Binding, units: Sequence[Unit], placement: OptimizerPlacement,
                     optimizers: OneOptimizer) -> None:
    """Scale this optimizer's gradients (where the optimizer reads them) by its pending multiplier."""
    if binding.multiplier == 1.0:
        return
    for unit in units:
        placement.scale_grads(unit, optimizers.spans(binding, unit), binding.multiplier)
    binding.multiplier = 1.0


def run(binding: Binding, units: Sequence[Unit], placement: OptimizerPlacement, gatherer: Gatherer,
        used: Tensor) -> None:
    """Give the optimizer the gradient of every used segment (unused segments get ``None``, so the
    optimizer leaves value and state alone, as ``torch.optim`` does with DDP), step it once per batch
    of resident units (or let the placement step the batch, ``step_batch``: the host kernel), and
    publish each batch's new masters. The optimizer's own ``step()`` runs at least once (with no
    gradients, if the placement stepped every batch), so what watches it (an LR scheduler's order
    check, the profiler) sees the step."""
    with OneStep(binding.optimizer) as one_step:
        if not step_in(one_step, binding, units, placement, gatherer, used.tolist()):
            one_step.step()


def step_in(one_step: OneStep, binding: Binding, units: Sequence[Unit], placement: OptimizerPlacement,
            gatherer: Gatherer, used_ids: Sequence[Any]) -> bool:
    """``run``'s batches of ``units`` within a step the caller holds (an asynchronous step steps its
    device units here before handing the host units to its worker); whether the optimizer's own
    ``step()`` ran."""
    mine = [u for u in units if u.index in binding.unit_ids]
    optimizer_ran = False
    for batch in placement.step_batches(mine):
        with torch.profiler.record_function("zeroq.optimizer_step"):
            stepped_here = placement.step_batch(batch, binding, used_ids)
        if stepped_here:
            with torch.profiler.record_function("zeroq.publish"):
                for unit in batch:
                    gatherer.publish(unit)
            continue
        optimizer_ran = True
        for unit in batch:
            grad = placement.step_grad(unit)
            for view, seg in binding.optimized[unit.index]:
                if used_ids[unit.param_id(seg.param)]:
                    view.grad = grad[seg.shard_span]
        with torch.profiler.record_function("zeroq.optimizer_step"):
            if is_matrix_optimizer(binding.optimizer):  # Muon: each matrix whole (``matrix.py``)
                step_matrices(binding, batch, used_ids, gatherer.wire.group, gatherer.device)
            one_step.step()
        for unit in batch:
            for view, _ in binding.optimized[unit.index]:
                view.grad = None
            with torch.profiler.record_function("zeroq.publish"):
                gatherer.publish(unit)
    return optimizer_ran
