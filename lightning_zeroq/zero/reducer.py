"""The gradient window: backward passes in, one fp32 gradient shard per unit out.

A *window* is everything between two optimizer steps: any number of backward passes (managed
accumulation: the Trainer says which one is the last; unmanaged: the step says so by coming).

States of the window (``Window``):

- EMPTY: nothing accumulated since the last step.
- BACKWARD: a backward pass is running. A post-accumulate-grad hook on every parameter marks it
  used and, if this backward *reduces*, counts it towards its unit. A backward reduces always in
  stages 2/3 and, in stage 1, only when it is the last of a managed window (``boundary``). Units
  are reduce-scattered as soon as all their parameters have their gradient, in a fixed order
  (reverse unit order) so every rank issues the same collectives; units still waiting when the
  backward ends (unused parameters) are flushed then, with zeros for the missing gradients.
- ACCUMULATED: at least one backward ended. Stage 1 may still hold *local* gradients (in ``p.grad``)
  that no backward reduced.
- FINALIZED: ``finalize`` reduced what was local, waited for the reduction stream, and agreed with
  every rank in one MAX all-reduce on which parameters any rank used and on fp16 overflow. Only
  clipping, the step or ``clear`` may follow; another backward is an error.

Reduction of one unit: copy the parameters' gradients into a flat working-dtype buffer, divide by
the world size (before summing, so fp16/bf16 sums cannot overflow; SUM because AVG is NCCL-only),
reduce-scatter, add this rank's part to the unit's fp32 gradient shard. Then the placement may copy
the shard off the device (``grad_reduced``) and the listener (stage 3) may free the unit.

Streams: with ``overlap_comm`` on CUDA, reductions run on a side stream that first waits for the
compute stream; gradient tensors read there are ``record_stream``-ed before they are dropped; the
compute stream waits for the side stream in ``finalize`` and ``clear``.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq.zero import comm
from lightning_zeroq.zero.hooks import WeakHook
from lightning_zeroq.zero.offload import OptimizerPlacement
from lightning_zeroq.zero.unit import Unit


class Window(enum.Enum):
    EMPTY = "empty"
    BACKWARD = "backward"
    ACCUMULATED = "accumulated"
    FINALIZED = "finalized"


class Agreement(NamedTuple):
    """What every rank agreed on in ``finalize``."""

    used: Tensor
    """Per parameter id: did any rank give it a gradient in this window (bool, on the device)."""
    overflow: bool
    """fp16 only: some rank's gradients hold inf/NaN; the step is skipped everywhere."""


class ReduceListener(Protocol):
    """Told about the window's progress (stage 3 frees units on it)."""

    def unit_reduced(self, unit: Unit) -> None: ...

    def backward_ended(self) -> None: ...

    def close(self) -> None: ...


class _NoListener:
    def unit_reduced(self, unit: Unit) -> None:
        pass

    def backward_ended(self) -> None:
        pass

    def close(self) -> None:
        pass


class Reducer:
    def __init__(
        self,
        units: Sequence[Unit],
        *,
        placement: OptimizerPlacement,
        reduce_every_backward: bool,
        managed: bool,
        param_dtype: torch.dtype,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        overlap_comm: bool,
        listener: Optional[ReduceListener] = None,
    ) -> None:
        self.units, self.placement = units, placement
        self.listener: ReduceListener = listener if listener is not None else _NoListener()
        self.reduce_every_backward, self.managed = reduce_every_backward, managed
        self.param_dtype, self.group, self.device = param_dtype, group, device
        self.rank, self.world_size = comm.world(group)
        self.num_params = sum(len(u.params) for u in units)
        self.window = Window.EMPTY
        self.agreement: Optional[Agreement] = None
        self._where = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
        self._order = list(reversed(units))
        self._stream = comm.SideStream(device, enabled=overlap_comm)
        self._hooks = [p.register_post_accumulate_grad_hook(WeakHook(self, "_on_grad_ready")) for u in units
                       for p in u.params]
        self._used: set[int] = set()
        self._local = False
        """Stage 1: some backward left its gradients in ``p.grad`` without reducing them."""
        # The backward in progress:
        self._reducing = False
        self._boundary = False
        self._fired: list[set[int]] = [set() for _ in units]
        self._next = 0
        self._callback_queued = False

    # ------------------------------------------------------------------ backward

    def begin_backward(self, boundary: Optional[bool] = None) -> None:
        """Open a backward pass. ``boundary=True``: the caller knows a step follows this backward (a
        managed accumulation window ends), so stage 1 reduces during it to overlap communication."""
        if self.window is Window.FINALIZED:
            raise RuntimeError(
                "backward() after the gradients were finalized for a step (clip_gradients or a step that "
                "was skipped half-way); call the optimizer step before the next backward."
            )
        self.window = Window.BACKWARD
        self._callback_queued = False
        self._boundary = boundary is True and self.managed
        self._reducing = self.reduce_every_backward or self._boundary
        self._next = 0
        for fired in self._fired:
            fired.clear()
        if not self._reducing:
            self._local = True

    def _on_grad_ready(self, param: Tensor) -> None:
        if self.window is not Window.BACKWARD:
            self.begin_backward(None)
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
            self._callback_queued = True
        unit, i = self._where[id(param)]
        self._used.add(unit.param_id(i))
        if self._reducing:
            self._fired[unit.index].add(i)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._order):
            unit = self._order[self._next]
            if len(self._fired[unit.index]) < len(unit.params):
                return
            self._reduce(unit, self._boundary)
            self._next += 1

    def end_backward(self) -> None:
        """Close the backward pass: flush the units still waiting (idempotent)."""
        if self.window is not Window.BACKWARD:
            return
        if self._reducing:
            for unit in self._order[self._next :]:
                self._reduce(unit, self._boundary)
            self._next = len(self._order)
            self._local = False
        self.listener.backward_ended()
        self.window = Window.ACCUMULATED

    @torch.no_grad()
    def _reduce(self, unit: Unit, boundary: bool) -> None:
        """Reduce-scatter the unit's local gradients into its fp32 gradient shard."""
        layout = unit.layout
        with self._stream.context():
            flat_grad = torch.zeros(layout.padded_numel, dtype=self.param_dtype, device=self.device)
            for p, slot in zip(unit.params, layout.slots):
                if p.grad is not None:
                    flat_grad[slot.span].copy_(p.grad.reshape(-1))
                    self._stream.keep_alive(p.grad)
                    p.grad = None
            if self.world_size > 1:
                flat_grad.div_(self.world_size)
                shard = torch.empty(layout.shard_numel, dtype=self.param_dtype, device=self.device)
                comm.reduce_scatter(shard, flat_grad, self.group)
            else:
                shard = flat_grad
            unit.grad.add_(shard)
            self.placement.grad_reduced(unit, boundary)
        self.listener.unit_reduced(unit)

    # ------------------------------------------------------------------ the window

    def wait(self) -> None:
        """The compute stream waits for the reductions issued so far."""
        self._stream.join()

    def finalize(self, check_overflow: bool) -> Agreement:
        """Complete this window's gradient shards and agree on them with every rank (idempotent)."""
        if self.window is Window.FINALIZED:
            assert self.agreement is not None
            return self.agreement
        self.end_backward()
        if self._local:
            for unit in self._order:
                self._reduce(unit, boundary=False)
            self._local = False
        self.wait()
        self.placement.gradients_done(self.units)
        stats = torch.zeros(self.num_params + 1, device=self.device)
        if self._used:
            stats[list(self._used)] = 1.0
        if check_overflow:
            local = torch.stack([u.grad.sum() for u in self.units]).sum() if self.units else stats[0]
            stats[-1] = (~torch.isfinite(local)).float()
        if self.world_size > 1:
            comm.all_reduce(stats, dist.ReduceOp.MAX, self.group)
        overflow = bool(stats[-1].item() > 0)  # also waits for the copies off the device
        self.agreement = Agreement(stats[:-1] > 0, overflow)
        self.window = Window.FINALIZED
        return self.agreement

    def clear(self) -> None:
        """End the window: drop every gradient (after a step, or to discard the window)."""
        self.end_backward()
        self.wait()
        for unit in self.units:
            unit.grad.zero_()
            for p in unit.params:
                p.grad = None
        self._used.clear()
        self._local = False
        self.agreement = None
        self.window = Window.EMPTY
        self.placement.end_window()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.listener.close()
