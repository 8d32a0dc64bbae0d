"""The gradient window: backward passes in, one fp32 gradient shard per unit out.

A *window* is everything between two optimizer steps: any number of backward passes (managed
accumulation: the Trainer says which one is the last; unmanaged: the step says so by coming).

States of the window (``Window``):

- EMPTY: nothing accumulated since the last step.
- BACKWARD: a backward pass is running. A post-accumulate-grad hook on every parameter marks it
  used and, if this backward *reduces*, counts it towards its unit. A backward reduces always in
  stages 2/3 and, in stage 1, only when it is the last of a managed window (``boundary``). Units
  are reduce-scattered as soon as all their parameters have their gradient, in a fixed order so
  every rank issues the same collectives: until the first ``finalize``, the order the listener
  expects (stage 3: the reverse of the forward's gathers), then reverse unit order; from the first
  ``finalize`` on, the order in which rank 0's backwards so far completed the units (agreed with a
  broadcast, once), as DDP rebuilds its buckets after the first iteration. Reverse unit order alone
  would hold every reduction until the end of the backward where the unit reduced first completes
  last (stage 3's root unit, which holds the embedding), and with it every gathered unit and every
  gradient on the device.
  Units still waiting when the backward ends (unused parameters) are flushed then, with zeros for
  the missing gradients.
- ACCUMULATED: at least one backward ended. Stage 1 may still hold *local* gradients that no
  backward reduced: in ``p.grad`` for fp32 working weights, else summed in an fp32 buffer per unit
  (``accumulate.py``: the object chosen once that keeps them).
- FINALIZED: ``finalize`` reduced what was local, waited for the reduction stream, and agreed with
  every rank in one MAX all-reduce on which parameters any rank used, which units got gradients
  after their reduction (below), which ranks and units hold non-finite gradients, and which
  parameters a rank wrote into between steps where the masters cannot take it (``written``). Only
  clipping, the step or ``clear`` may follow; another backward is an error.

Late gradients. A parameter's hook can fire again after its unit was reduced in the same backward
(reentrant activation checkpointing runs a nested backward per checkpointed call, so a block applied
twice, or a parameter used inside and outside a checkpointed region, accumulates more than once).
Such a unit is marked *dirty* and its late gradients wait in ``p.grad``; ``finalize`` agrees on the
dirty units with every rank (in the same all-reduce) and reduces them again, so nothing is lost and
every rank issues the same collectives.

Reduction of one unit: copy the parameters' gradients into a flat working-dtype buffer and hand it
to the gradient wire (``grad_wire.py``: a reduce-scatter, or INT8 groups through an all-to-all), which
returns this rank's part of the average over ranks; the unit adds it to its gradient (``Unit.add_grad``:
the window's first part is kept as it is, the fp32 shard is made at a second reduction or at
finalize, and released at the end of the window). Then the placement's ``Gradients`` role hears of it (``grad_reduced``:
offload marks an earlier host copy stale) and the listener (stage 3) may free the unit.

Streams: with ``overlap_comm`` on CUDA, reductions run on a side stream that first waits for the
compute stream; gradient tensors read there are ``record_stream``-ed before they are dropped; the
compute stream waits for the side stream in ``finalize`` and ``clear``.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq import ops
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.accumulate import accumulation
from lightning_zeroq.zero.grad_wire import GradientWire
from lightning_zeroq.zero.hooks import WeakHook
from lightning_zeroq.zero.offload.roles import Gradients
from lightning_zeroq.zero.policies import Sharding
from lightning_zeroq.zero.unit import ParamGrads, Unit


class Window(enum.Enum):
    EMPTY = "empty"
    BACKWARD = "backward"
    ACCUMULATED = "accumulated"
    FINALIZED = "finalized"


class WindowVerdict(NamedTuple):
    """What every rank agreed on in ``finalize``."""

    used: Tensor
    """Per parameter id: did any rank give it a gradient in this window (bool, on the host)."""
    nonfinite_ranks: list[int]
    """Ranks that contributed inf or NaN to a reduction (where the values came from)."""
    nonfinite_units: list[int]
    """Units whose reduced gradient shard holds inf or NaN on some rank (empty: all finite)."""
    written: list[int] = []
    """Parameter ids some rank wrote into in place since the last step where the masters cannot take it
    (``full_params.take_writes``): the step refuses them."""
    writing_ranks: list[int] = []
    """The ranks that made those writes."""

    @property
    def finite(self) -> bool:
        return not self.nonfinite_units


class ReduceListener(Protocol):
    """Told about the window's progress (stage 3 frees units on it)."""

    def expected_order(self) -> list[int]:
        """Unit indices in the order a backward is expected to complete them, the same on every rank
        (stage 3: the reverse of the forward's gathers); the others follow in reverse unit order."""
        ...

    def unit_reduced(self, unit: Unit) -> None: ...

    def backward_ended(self) -> None: ...

    def close(self) -> None: ...


class NoListener:
    """The listener without stage 3: told everything, does nothing, expects no order."""

    def expected_order(self) -> list[int]:
        return []

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
        gradients: Gradients,
        sharding: Sharding,
        param_dtype: torch.dtype,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        wire: GradientWire,
        listener: ReduceListener,
    ) -> None:
        self.units, self.gradients, self.wire = units, gradients, wire
        self.listener = listener
        if device.type == "cuda":
            ops.load_cuda_backend()  # the gradients' checked widening: compile or load once now, never in a step
        self.param_dtype, self.group, self.device = param_dtype, group, device
        self.accumulation = accumulation(sharding, units, param_dtype, device)
        self._managed = sharding.managed_accumulation
        """Where the gradients of a backward that does not reduce wait (stage 1), see ``accumulate.py``."""
        self.rank, self.world_size = rank_and_size(group)
        self.num_params = sum(len(u.params) for u in units)
        self.window = Window.EMPTY
        self._where = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
        self._order = list(reversed(units))
        self._completed: list[int] = []
        """Unit indices in the order the backwards so far gave them all their gradients (the first time each)."""
        self._order_agreed = False
        self._stream = comm.SideStream(device, enabled=sharding.overlap_comm)
        self._hooks = [
            p.register_post_accumulate_grad_hook(WeakHook(self._on_grad_ready)) for u in units for p in u.params
        ]
        self._used: set[int] = set()
        self._dirty: set[int] = set()
        """Units that got gradients after their reduction in the same backward (see the docstring)."""
        self.written: set[int] = set()
        """Parameter ids this rank wrote into between steps that the masters cannot take: agreed on with the
        rest in ``finalize`` (so a write on one rank is refused on every rank)."""
        self._flags = comm.HostFlags(device)
        self._origin = torch.zeros((), dtype=torch.bool, device=device)
        """This rank contributed a non-finite gradient to some reduction of this window."""
        # The backward in progress:
        self._reducing = False
        self._fired: list[set[int]] = [set() for _ in units]
        self._reduced: list[bool] = [False] * len(units)
        self._next = 0

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
        if not self._order_agreed:
            expected = self.listener.expected_order()
            known = set(expected)
            self._order = [self.units[i] for i in expected] + [u for u in reversed(self.units) if u.index not in known]
        self._reducing = self.accumulation.begin(boundary is True)
        self.gradients.begin_backward(boundary is True and self._managed)
        self._next = 0
        for fired in self._fired:
            fired.clear()
        self._reduced = [False] * len(self.units)

    def _on_grad_ready(self, param: Tensor) -> None:
        if self.window is not Window.BACKWARD:
            # A backward no ``begin_backward`` opened (a plain ``loss.backward()``): the end of the graph task this
            # gradient arrives in closes it. One the caller opened is closed by the caller (``end_backward``), never
            # here: under reentrant activation checkpointing the first gradient may arrive in a checkpoint's nested
            # backward, whose end is not the backward's (every unit would be flushed at each checkpoint's end).
            self.begin_backward(None)
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        unit, i = self._where[id(param)]
        self._used.add(unit.param_id(i))
        if not self._reducing:
            self.accumulation.add(unit, i, param)
        elif self._reduced[unit.index]:
            self._dirty.add(unit.index)  # a late gradient: it waits in p.grad for finalize
        else:
            fired = self._fired[unit.index]
            fired.add(i)
            if not self._order_agreed and len(fired) == len(unit.params) and unit.index not in self._completed:
                self._completed.append(unit.index)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._order):
            unit = self._order[self._next]
            if len(self._fired[unit.index]) < len(unit.params):
                return
            self._reduce(unit)
            self._next += 1

    def end_backward(self) -> None:
        """Close the backward pass: flush the units still waiting (idempotent)."""
        if self.window is not Window.BACKWARD:
            return
        if self._reducing:
            for unit in self._order[self._next :]:
                self._reduce(unit)
            self._next = len(self._order)
            self.accumulation.reduced()
        self.listener.backward_ended()
        self.window = Window.ACCUMULATED

    @torch.no_grad()
    def _reduce(self, unit: Unit) -> None:
        """Reduce-scatter the unit's local gradients into its fp32 gradient shard."""
        if self.wire.identity and self.gradients.master_on_device(unit.index) and not self.accumulation.local(unit):
            # Nothing to reduce: the gradients stay as autograd left them until the shard is made
            # (``ParamGrads``), on the compute stream, after anything the side stream made for this unit.
            if unit.pending is not None or unit.has_grad_storage:
                self.wait()
            grads = [None if p.grad is None else p.grad.reshape(-1) for p in unit.params]
            unit.add_grad(ParamGrads(grads, unit.layout))
            for p in unit.params:
                p.grad = None
            self.gradients.grad_reduced(unit)
        else:
            self._reduce_flat(unit)
        self._reduced[unit.index] = True
        self.listener.unit_reduced(unit)

    def _reduce_flat(self, unit: Unit) -> None:
        """The unit's gradients into one flat buffer, reduced by the wire on the reduction stream."""
        layout = unit.layout
        with self._stream.context():
            local = self.accumulation.start(unit)  # stage 1's fp32 local sum, or None: nothing local
            divisor = self.wire.divides_first if local is None else 1  # divided as it is copied
            flat_grad = _flat_grads(unit, self.param_dtype, self.device, divisor) if local is None else local
            for p, slot in zip(unit.params, layout.slots):
                if p.grad is not None:
                    if local is not None:
                        flat_grad[slot.span].add_(p.grad.reshape(-1))
                    self._stream.keep_alive(p.grad)
                    p.grad = None
            if self.world_size > 1:  # where a non-finite value came from is only visible before the sum spreads it
                self._origin.logical_or_(~torch.isfinite(flat_grad.sum()))
            unit.add_grad(self.wire.reduce(flat_grad, divided=divisor != 1))
            self.gradients.grad_reduced(unit)

    # ------------------------------------------------------------------ the window

    def wait(self) -> None:
        """The compute stream waits for the reductions issued so far."""
        self._stream.join()

    def finalize(self) -> WindowVerdict:
        """Complete this window's gradient shards and agree on them with every rank: once a window, whose
        verdict the caller keeps (``step.Stepper``)."""
        assert self.window is not Window.FINALIZED, "a window is finalized once"
        self.end_backward()
        if self.accumulation.pending:
            for unit in self._order:
                self._reduce(unit)
            self.accumulation.reduced()
        used, dirty, nonfinite, written = self._agree(with_dirty=True)
        if dirty:  # rare: reduce the late gradients everywhere, then look at finiteness again
            for unit in self._order:
                if unit.index in dirty:
                    self._reduce(unit)
            _, _, nonfinite, _ = self._agree(with_dirty=False)
        self._dirty.clear()
        ranks = [r for r in range(self.world_size) if nonfinite[len(self.units) + r]]
        units = [i for i in range(len(self.units)) if nonfinite[i]]
        writers = [r for r in range(self.world_size) if written[r]]
        verdict = WindowVerdict(used, ranks, units, self._written_everywhere() if writers else [], writers)
        self.window = Window.FINALIZED
        if not self._order_agreed:
            self._agree_order()
        return verdict

    def _agree_order(self) -> None:
        """From now on reduce in the order rank 0's backwards completed the units (every rank alike)."""
        seen = set(self._completed)
        order = self._completed + [u.index for u in self._order if u.index not in seen]
        if self.world_size > 1:
            agreed = torch.tensor(order, dtype=torch.int64, device=self.device)
            comm.broadcast(agreed, 0, self.group)
            order = agreed.tolist()
        self._order = [self.units[i] for i in order]
        self._order_agreed, self._completed = True, []

    def _materialize(self, all_units: bool = False, flags: Optional[Tensor] = None) -> set[int]:
        """The fp32 gradient shard of every unit the optimizer steps on the device (``all_units``: of
        every unit) exists and holds the window's gradient. A unit stepped on the host has its gradient
        copied there instead (``offload/host_grads.py``), never widened here.

        Made on the compute stream, once the reductions are done: its blocks then come from the compute
        stream's pool, where the backward has just freed the activations, and the reduced parts waiting in
        the working dtype leave theirs in the reduction stream's pool for the next backward's parts. Made on
        the reduction stream, beside those parts, neither set of blocks could serve the other, and the
        reduction stream kept both cached (stage 3 compiled, 953M GPT, one H200: 5.72 GiB there and 22.33
        GiB reserved in all; made here, 1.78 GiB there and 20.44 in all, against FSDP2's 21.12;
        ``docs/compile.md``).

        ``flags`` (one fp32 element per unit): where a shard is made now, its slot is set to 1 if the
        shard holds a NaN or an inf, in the same pass. Returns the indices of the units so checked."""
        self.wait()
        current = torch.cuda.current_stream(self.device) if self._stream.stream is not None else None
        checked = set()
        for unit in self.units:
            if all_units or self.gradients.master_on_device(unit.index):
                if current is not None and isinstance(unit.pending, Tensor) and unit.pending.is_cuda:
                    unit.pending.record_stream(current)  # made on the reduction stream, read here
                flag = None if flags is None else flags[unit.index : unit.index + 1]
                if unit.materialize_grad(flag):
                    checked.add(unit.index)
        return checked

    def _written_everywhere(self) -> list[int]:
        """The parameters any rank wrote (the step refuses them; every rank is here alike, the writers agreed)."""
        if self.world_size == 1:
            return sorted(self.written)
        found: list[Any] = [None] * self.world_size
        dist.all_gather_object(found, sorted(self.written), group=self.group)
        return sorted({i for ids in found for i in ids})

    def _agree(self, with_dirty: bool) -> tuple[Tensor, set[int], list[bool], list[bool]]:
        """One MAX all-reduce: [used per parameter | dirty per unit | non-finite per unit | per rank], a rank's
        own slot also saying (2) that it wrote where the masters cannot take it (``self.written``); returned
        as used, dirty, non-finite per unit and rank, wrote per rank."""
        self.wait()
        self.gradients.gradients_ready(self.units)  # offload with a mapped read-back: the last copies now
        n_params, n_units, world = self.num_params, len(self.units), self.world_size
        stats = torch.zeros(n_params + 2 * n_units + world, device=self.device)
        bad = stats[n_params + n_units : n_params + 2 * n_units]  # per unit: 1 where its shard is not finite
        checked = self._materialize(flags=bad)  # the shards made now are checked as they are made
        if self._used:
            stats[list(self._used)] = 1.0
        if with_dirty and self._dirty:
            stats[[n_params + i for i in self._dirty]] = 1.0
        wrote = 2.0 if with_dirty and self.written else 0.0  # a rank's own slot: 1 non-finite + 2 wrote
        others = [u for u in self.units if u.index not in checked]
        if others:  # a NaN or inf anywhere in a shard makes its sum non-finite
            sums = torch.stack([u.grad_sum() for u in others])
            bad[[u.index for u in others]] = (~torch.isfinite(sums)).float()
        if self.units and self.world_size == 1:  # one rank: any non-finite shard came from it
            stats[n_params + 2 * n_units] = bad.max()
        if self.world_size > 1:
            stats[n_params + 2 * n_units + self.rank] = self._origin.float()
        stats[n_params + 2 * n_units + self.rank] += wrote
        if self.world_size > 1:
            comm.all_reduce(stats, dist.ReduceOp.MAX, self.group)
        ranks = stats[n_params + 2 * n_units :]
        stats = torch.cat([stats[: n_params + 2 * n_units], torch.remainder(ranks, 2.0), (ranks >= 2.0).float()])
        # One read-back of everything the step needs to know on the host (``used`` too). Through the copy
        # engine it would wait behind every copy to the host already queued, whatever its stream or
        # priority (benchmarks/kernels.py readback); mapped host memory (a kernel's stores) waits for none.
        read = self._flags.positive(stats)
        flags = read[n_params:].tolist()
        self.gradients.gradients_done(self.units)  # after the read-back: ahead of it, the copies would delay it
        dirty = {i for i in range(n_units) if flags[i]}
        return read[:n_params], dirty, flags[n_units : 2 * n_units + world], flags[2 * n_units + world :]

    def clear(self) -> None:
        """End the window: drop every gradient (after a step, or to discard the window)."""
        self.end_backward()
        self.wait()
        self.gradients.end_window()  # copies still reading the gradient shards finish first
        # An empty window's buffers are zero already (every gradient opens a window; the last clear
        # zeroed them): a step's own clear followed by the user's zero_grad() zeroes them once.
        written = self.window is not Window.EMPTY
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for unit in self.units:
            unit.drop_grad(compute)  # the next window allocates it again
            for p in unit.params:
                p.grad = None
        self.accumulation.clear(written)
        self._used.clear()
        self._dirty.clear()
        self.written.clear()
        self._origin.zero_()
        self.window = Window.EMPTY

    def clear_params(self, param_ids: frozenset[int], optimized: dict[int, list]) -> None:
        """Drop the gradients of some parameters only (one of several optimizers stepped or zeroed its
        own); the others' stay, and the window accepts more backward passes."""
        self.end_backward()
        self._materialize(all_units=True)
        for unit in self.units:
            spans = [seg.shard_span for _, seg in optimized.get(unit.index, ())]
            for span in spans:
                unit.grad[span].zero_()
            self.gradients.clear_spans(unit, spans)
            for i, (p, slot) in enumerate(zip(unit.params, unit.layout.slots)):
                if unit.param_id(i) in param_ids:
                    p.grad = None
                    self.accumulation.drop(unit, slot.span)
        self._used -= param_ids
        if self.window is Window.FINALIZED:
            self.window = Window.ACCUMULATED

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.listener.close()


def _flat_grads(unit: Unit, dtype: torch.dtype, device: torch.device, divisor: int = 1) -> Tensor:
    """The unit's gradients (``p.grad``) copied into one flat buffer of ``dtype``, zero where a parameter
    has none and in the padding (the slots lie back to back from 0, ``make_layout``): one write of each
    element, where zeros and then a sum into them write the buffer twice and read it once. A gradient's -0
    stays -0 here, where 0 + (-0) made +0; the fp32 gradient shard is made by adding 0
    (``Unit.materialize_grad``), and torch.equal and every optimizer step treat the two alike.
    ``divisor`` other than 1: each gradient divided by it as it is copied, the division the wire would
    make in place afterwards (``GradientWire.divides_first``), in the same dtype, without a second pass."""
    flat = torch.empty(unit.layout.padded_numel, dtype=dtype, device=device)
    for p, slot in zip(unit.params, unit.layout.slots):
        if p.grad is None:
            flat[slot.span].zero_()
        elif divisor == 1:
            flat[slot.span].copy_(p.grad.reshape(-1))
        elif p.grad.dtype == dtype:
            torch.div(p.grad.reshape(-1), divisor, out=flat[slot.span])
        else:  # the copy rounds to ``dtype`` first, as the division in place would read it
            flat[slot.span].copy_(p.grad.reshape(-1)).div_(divisor)
    flat[unit.layout.numel :].zero_()
    return flat
