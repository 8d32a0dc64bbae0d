"""The optimizer side of a step, in one place: ``Stepper`` holds the optimizers attached, the window's
decision (skip or step: non-finite gradients, fp16 overflow), the pending gradient multiplier
(unscaling and clipping, applied once to the gradients the optimizer reads), the step loop over
resident units and the step counters. ``ZeroEngine``'s ``attach_optimizer``, ``finalize_gradients``,
``clip_grad_norm_``, ``clip_grad_value_``, ``step`` and ``zero_grad`` each call one of its methods.

Each optimizer is a ``Binding`` (``optim/binding.py``). How many are attached is an object, chosen again
whenever one is attached: ``OneOptimizer`` (none or one: it covers every segment, its multiplier is
applied to whole gradient shards, its norm is the global norm) or ``SeveralOptimizers`` (disjoint
parameters: each applies its own multiplier to its own segments, and stepping or zeroing one leaves
the others' gradients in place, as ``optimizer.step()`` does with DDP).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm, full_params, norms
from lightning_zeroq.zero.build import Parts
from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.loss_scaler import DynamicLossScaler
from lightning_zeroq.zero.offload.roles import Updater
from lightning_zeroq.zero.optim.binding import (
    Binding,
    OneStep,
    bind_to_shards,
    hand_back,
    route_zero_grad,
    segment_spans,
    stepped_spans,
)
from lightning_zeroq.zero.optim.matrix import is_matrix_optimizer, start_matrices
from lightning_zeroq.zero.reducer import Reducer, Window, WindowVerdict
from lightning_zeroq.zero.unit import Unit

log = logging.getLogger("lightning_zeroq")


def decide_nonfinite(
    agreement: WindowVerdict,
    bad_units: list[int],
    *,
    scaler: Optional[DynamicLossScaler],
    action: str,
    step: int,
    names: str,
    rank: int,
) -> bool:
    """True: skip this step (fp16 overflow, or ``action == "skip"``); raises for ``"error"``."""
    where = f"on rank(s) {agreement.nonfinite_ranks}, in the gradients of {names}"
    if scaler is not None and (not scaler.dynamic or scaler.scale > scaler.min_scale):
        if rank == 0:
            log.info(
                f"fp16 overflow in step {step} {where}: step skipped, loss scale {scaler.scale:g} -> "
                f"{scaler.next_scale(overflow=True):g}"
            )
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

    def norm(
        self, binding: Binding, units: Sequence[Unit], group: Optional[dist.ProcessGroup], device: torch.device
    ) -> Tensor:
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
        return segment_spans(unit, binding)

    @torch.no_grad()
    def norm(
        self, binding: Binding, units: Sequence[Unit], group: Optional[dist.ProcessGroup], device: torch.device
    ) -> Tensor:
        squared = torch.zeros((), device=device)
        for unit in units:
            spans = self.spans(binding, unit)
            if spans:
                grad = unit.fp32_grad()
                for span in spans:
                    squared += grad[span].pow(2).sum()
        if rank_and_size(group)[1] > 1:
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
def apply_multiplier(binding: Binding, units: Sequence[Unit], placement: Updater, optimizers: OneOptimizer) -> None:
    """Scale this optimizer's gradients (where the optimizer reads them) by its pending multiplier."""
    if binding.multiplier == 1.0:
        return
    for unit in units:
        placement.scale_grads(unit, optimizers.spans(binding, unit), binding.multiplier)
    binding.multiplier = 1.0


def run(binding: Binding, units: Sequence[Unit], placement: Updater, gatherer: Gatherer, used: Tensor) -> None:
    """Give the optimizer the gradient of every used segment (unused segments get ``None``, so the
    optimizer leaves value and state alone, as ``torch.optim`` does with DDP), step it once per batch
    of resident units (or let the placement step the batch, ``step_batch``: the host kernel), and
    publish each batch's new masters. The optimizer's own ``step()`` runs at least once (with no
    gradients, if the placement stepped every batch), so what watches it (an LR scheduler's order
    check, the profiler) sees the step."""
    with OneStep(binding.optimizer) as one_step:
        if not step_in(one_step, binding, units, placement, gatherer, used.tolist()):
            one_step.step()


def step_in(
    one_step: OneStep,
    binding: Binding,
    units: Sequence[Unit],
    placement: Updater,
    gatherer: Gatherer,
    used_ids: Sequence[Any],
) -> bool:
    """``run``'s batches of ``units`` within a step the caller holds (an asynchronous step steps its
    device units here before handing the host units to its worker); whether the optimizer's own
    ``step()`` ran."""
    mine = [u for u in units if u.index in binding.unit_ids]
    if is_matrix_optimizer(binding.optimizer):  # Muon: each matrix whole (``optim/matrix.py``)
        return step_matrix_batches(one_step, binding, mine, placement, gatherer, used_ids)
    optimizer_ran = False
    for batch in placement.step_batches(mine):
        with torch.profiler.record_function("zeroq.optimizer_step"):
            stepped_here = placement.step_batch(batch, binding, used_ids)
        if stepped_here:
            with torch.profiler.record_function("zeroq.publish"):
                for unit in batch:
                    gatherer.publish(unit, stepped_spans(unit, binding))
            continue
        optimizer_ran = True
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
        with torch.profiler.record_function("zeroq.publish"):  # one range per batch: a range costs microseconds
            for unit in batch:
                gatherer.publish(unit, stepped_spans(unit, binding))
    return optimizer_ran


def step_matrix_batches(
    one_step: OneStep,
    binding: Binding,
    units: Sequence[Unit],
    placement: Updater,
    gatherer: Gatherer,
    used_ids: Sequence[Any],
) -> bool:
    """``step_in`` for a matrix optimizer (whether the optimizer's own ``step()`` ran): each batch's step is started (``start_matrices``) before the
    previous batch's is finished and published, so with host units (one a batch) the host blends the
    next unit while the device transforms this one. A batch that fails to start finishes the one before
    it first: no unit is left half stepped."""
    pending: Optional[tuple[list[Unit], Callable[[], None]]] = None
    ran = False

    def finish(batch: list[Unit], apply: Callable[[], None]) -> None:
        with torch.profiler.record_function("zeroq.optimizer_step"):
            apply()
            one_step.step()
        with torch.profiler.record_function("zeroq.publish"):
            for unit in batch:  # the spans it stepped (on the host, Muon's kernel wrote their bf16 copies)
                gatherer.publish(unit, segment_spans(unit, binding))

    for batch in placement.step_batches(units):
        try:
            with torch.profiler.record_function("zeroq.optimizer_step"):
                started = start_matrices(binding, batch, used_ids, placement, gatherer.wire.group, gatherer.device)
        finally:
            if pending is not None:
                finish(*pending)
                pending = None
        pending = (batch, started)
        ran = True
    if pending is not None:
        finish(*pending)
    return ran


class Stepper:
    """The optimizers attached to one engine's parts and everything a step does with them."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.everything = Binding(
            None,  # type: ignore[arg-type]
            {},
            frozenset(range(parts.reducer.num_params)),
            frozenset(u.index for u in parts.units),
            [],
        )
        """The binding of every unit: what a call without an optimizer means when several are attached."""
        self.attached = attached([], self.everything)
        """The optimizers attached: one (or none) or several, chosen again at each ``attach``."""
        self.base = 1.0
        """The window's unscaling multiplier (fp16: 1 / loss scale)."""
        self.steps = 0
        """Optimizer steps attempted (skipped ones included)."""
        self.skipped_steps = 0
        """Steps skipped for fp16 overflow or (``nonfinite_gradients="skip"``) non-finite gradients."""
        self.verdict: Optional[WindowVerdict] = None
        """The window's verdict from its one finalize (``Reducer.finalize``); current while the window is
        finalized."""

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [b.optimizer for b in self.attached.bindings]

    def binding(self, optimizer: Optional[torch.optim.Optimizer]) -> Binding:
        """The binding of ``optimizer``; without one, the only binding or (none, several) all units."""
        return self.attached.binding(optimizer)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """See ``ZeroEngine.attach_optimizer``."""
        parts = self.parts
        parts.worker.wait()  # an asynchronous step's jobs belong to the binding replaced here
        binding = bind_to_shards(optimizer, parts.module, parts.units)
        kept = [b for b in self.attached.bindings if not b.param_ids & binding.param_ids]
        self.attached = attached(kept + [binding], self.everything)
        route_zero_grad(optimizer, self)
        with comm.agreed(parts.world_group, "attaching the optimizer (host memory, NVMe swap space)"):
            parts.host_memory.attached(self.optimizers)
            parts.placement.attach(parts.units, self.optimizers)

    def finalize(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """See ``ZeroEngine.finalize_gradients``: whether ``optimizer``'s step must be skipped."""
        return self._skip(self._finalized(), self.binding(optimizer))

    def _finalized(self) -> WindowVerdict:
        """The window's verdict: the reducer finalizes the window once, here, and the verdict is kept
        (``verdict``) for every decision and step of the window."""
        parts = self.parts
        if parts.reducer.window is Window.FINALIZED:
            assert self.verdict is not None  # finalized below, in this window
            return self.verdict
        # Before anything reads the masters: a write into the weights since the last step becomes them
        # (fp32), or is agreed on in the finalize below and refused on every rank.
        parts.reducer.written.update(full_params.take_writes(parts))
        with torch.profiler.record_function("zeroq.finalize"):
            verdict = self.verdict = parts.reducer.finalize()
        if verdict.written:
            parts.reducer.clear()  # the masters are untouched and the engine usable (a caller may go on)
            raise RuntimeError(full_params.refused_writes(parts, verdict.written, verdict.writing_ranks))
        self.base = 1.0 / parts.loss_scaler.scale if parts.loss_scaler is not None else 1.0
        for one in [*self.attached.bindings, self.everything]:
            one.multiplier, one.skip = self.base, None
        return verdict

    def _skip(self, verdict: WindowVerdict, binding: Binding) -> bool:
        """Whether ``binding``'s step must be skipped, decided once a window from ``verdict``."""
        if binding.skip is None:
            parts = self.parts
            bad = [u for u in verdict.nonfinite_units if u in binding.unit_ids]
            try:
                binding.skip = bool(bad) and decide_nonfinite(
                    verdict,
                    bad,
                    scaler=parts.loss_scaler,
                    action=parts.policies.numerics.nonfinite_gradients,
                    step=self.steps + 1,
                    names=self.names_of(bad),
                    rank=parts.rank,
                )
            except RuntimeError:
                parts.reducer.clear()  # the model is untouched and the engine usable (a caller may go on)
                raise
        return binding.skip

    def names_of(self, unit_indices: list[int], most: int = 4) -> str:
        names = [self.parts.param_names.get(id(p), "?") for i in unit_indices for p in self.parts.units[i].params]
        more = f" and {len(names) - most} more" if len(names) > most else ""
        return ", ".join(names[:most]) + more

    def clip_norm(self, max_norm: float, optimizer: Optional[torch.optim.Optimizer] = None) -> Tensor:
        """See ``ZeroEngine.clip_grad_norm_``: the norm before clipping."""
        parts, binding = self.parts, self.binding(optimizer)
        if self.finalize(optimizer):
            return torch.tensor(float("inf"), device=parts.device)
        norm = self.attached.norm(binding, parts.units, parts.group, parts.device) * binding.multiplier
        binding.multiplier *= float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def clip_value(self, clip_value: float, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        parts, binding = self.parts, self.binding(optimizer)
        if not self.finalize(optimizer):
            apply_multiplier(binding, parts.units, parts.placement, self.attached)
            for unit in parts.units:
                grad = parts.placement.step_grad(unit)
                for span in self.attached.spans(binding, unit):
                    grad[span].clamp_(-clip_value, clip_value)

    def grad_norms(self, norm_type: float) -> dict[str, Tensor]:
        parts = self.parts
        self.finalize()
        return norms.grad_norms(parts.units, parts.param_names, norm_type, abs(self.base), parts.group, parts.device)

    def step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """See ``ZeroEngine.step``: False if the step was skipped."""
        parts = self.parts
        if not self.attached.bindings:
            raise RuntimeError("ZeroEngine.step() needs an optimizer: call attach_optimizer() first.")
        binding = self.binding(optimizer)
        if binding is self.everything:
            raise ValueError("Several optimizers are attached: name the one to step, engine.step(optimizer).")
        verdict = self._finalized()
        skip = self._skip(verdict, binding)
        if not skip:
            apply_multiplier(binding, parts.units, parts.placement, self.attached)
            self._run(binding, verdict.used)
        if parts.loss_scaler is not None:
            parts.loss_scaler.update(skip)
        self.steps += 1
        self.skipped_steps += int(skip)
        self.attached.clear(parts.reducer, binding)
        parts.placement.step_done(parts.units, self.optimizers, not skip, parts.group)
        return not skip

    def _run(self, binding: Binding, used: Tensor) -> None:
        parts, placement, async_step = self.parts, self.parts.placement, self.parts.async_step
        if async_step is not None and async_step.takes(binding, len(self.attached.bindings) > 1):
            ids, on_device = used.tolist(), [u for u in parts.units if placement.master_on_device(u.index)]
            # the device's units first, in the step
            async_step.run(binding, ids, lambda one: step_in(one, binding, on_device, placement, parts.gatherer, ids))
        else:
            run(binding, parts.units, placement, parts.gatherer, used)

    def zero_grad(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Drop this window's gradients (of ``optimizer``'s parameters, when several are attached)."""
        self.attached.clear(self.parts.reducer, self.binding(optimizer) if optimizer is not None else None)

    def hand_back(self) -> None:
        """Each optimizer bound to the module's parameters again, no collective (``binding.hand_back``);
        the placement keeps stepping the twin that holds the state."""
        for binding in self.attached.bindings:
            user, twin = binding.optimizer, hand_back(binding)
            self.parts.placement.optimizer_replaced(user, twin)
