"""ZeRO stage 3: when a transient unit's parameters are gathered and freed.

Which modules become units is decided in ``unit_plan.py``; how a unit is gathered and freed in
``gather.py``. This file installs the module hooks and decides *when*:

- forward: a pre-hook on the unit's module gathers it (waiting for a prefetch if one was issued)
  and prefetches the next ``stage3_prefetch_depth`` units of the recorded order; a post-hook frees
  it (unless ``reshard_after_forward=False``: then it stays gathered until its gradients are
  reduced, trading memory for the backward's gathers) and hooks the outputs, so the first gradient
  to reach them gathers it again for backward.
- backward: the reducer reduce-scatters the unit's gradients once all of them are accumulated and
  tells this coordinator (``unit_reduced``), which frees the unit; units left gathered are freed when
  the backward ends (``backward_ended``). Until the reducer has agreed on the order units complete
  in (after the first step), it reduces them in the reverse of their first use in the forward
  (``expected_order``), so that even the first backward frees each unit as it goes.

Order. The first forward records the order in which units are gathered; later forwards prefetch
the next unit from that order (backward: the reverse). A unit that arrives out of order is gathered
on demand, the order is re-recorded, and a warning is given once: control flow may change freely.
Each backward's end forgets the forward's last unit: the next step's first unit is gathered when it
is used, not prefetched and held through the loss and the backward.

Every rank must run the same units (gathers are collectives; as with FSDP and DeepSpeed). Until the
first backward ends, each gather is checked against the other ranks' (``Gatherer.checking``), so a
module only some ranks run stops every rank at once with the gather, the units and the ranks named;
later, the watchdog names it from the ranks' published gathers (``gather.py``).

Frozen parts (``frozen.py``). A unit's frozen weights may be needed in the backward after its trainable
parameters all have their gradients: the gradient with respect to the module's input flows through the frozen
base (a LoRA block: ``x W^T`` is an autograd node apart from the factors'), and can run after the factors'
gradients are complete. So the reducer's ``unit_reduced`` frees the unit's frozen part only once every input of
the module's forward that requires a gradient, positional or keyword (Hugging Face's layers may take
``hidden_states=...``), has received it (a hook on each, counted per unit); where that comes later, the last
input's hook frees it. Inputs that need no gradient (the first block after a frozen embedding) leave nothing to
wait for: every node that reads the frozen weights then leads to a trainable parameter of the unit, whose
gradient completes after it.

A frozen part of its own (a block with nothing to train, a frozen embedding or head: ``unit_plan.frozen_only_specs``)
has no unit and no reducer: its module's pre-hook gathers it, its post-hook frees it (unless an output needs a
gradient and ``reshard_after_forward=False``) and hooks the outputs that need one, which gather it again for the
backward; the last of its inputs' gradients frees it, or the end of the backward does.

Activation checkpointing recomputes a forward inside the backward: there the pre-hook only gathers
the unit (orders and prefetch untouched) and the post-hook keeps it gathered for its gradients. A reentrant
checkpoint (Hugging Face's layers with ``use_reentrant=True``) ran the forward without gradients, so no input of
it was counted, and backpropagates through the recomputation in a nested backward, a graph task of its own: a
unit reduced in another graph task than the one that recomputed it keeps its frozen part until that nested
backward ends (a callback queued on it). A non-reentrant recomputation needs nothing more: the forward's input
hooks count its inputs.

``torch.compile``: the hooks are ``EagerHook``s, which dynamo never traces (FSDP2 does the same with
its hooks): it breaks the graph where a unit's forward begins and where it ends and compiles the
forward in between, with the unit gathered; what the hooks do to parameters (storage, class) and the
collectives stay outside every graph.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.hooks import EagerHook, check_guards_in_full
from lightning_zeroq.zero.unit import Unit, UnitState


class Stage3Coordinator:
    """Installs the module hooks of the transient units and runs gather/free/prefetch for them.

    Prefetch follows a successor map: for each unit, the unit that came next last time (one map for
    forward, one for backward). At most ``depth`` prefetched, not yet used units are held at a time.
    """

    def __init__(
        self,
        gatherer: Gatherer,
        units: Sequence[Unit],
        *,
        prefetch_depth: int,
        reshard_after_forward: bool,
        names: Optional[dict[int, str]] = None,
        frozen_only: Sequence[Unit] = (),
    ) -> None:
        self.gatherer = gatherer
        gatherer.names = dict(names or {})
        # The first step's gathers (forward and backward, a block used twice) are checked across ranks; the
        # bound keeps a run that never reaches a backward (evaluation) from checking every gather.
        gatherer.checking = 4 * sum(1 for unit in units if not unit.persistent)
        self.units = units
        self.prefetch = prefetch_depth > 0
        self.depth = prefetch_depth
        self.reshard_after_forward = reshard_after_forward
        self._next: dict[bool, dict[int, int]] = {False: {}, True: {}}  # backward? -> unit -> successor
        self._last: dict[bool, Optional[int]] = {False: None, True: None}
        self._prefetched: list[Unit] = []
        """Units gathered ahead and not used yet (at most ``depth``)."""
        self._forward: dict[int, None] = {}
        """The transient units the forwards since the last backward used, in the order of their first use."""
        self._warned = False
        self._inputs: dict[int, int] = {}
        """Units with a frozen part: the gradients for their modules' inputs still to come in this backward."""
        self._recomputed: dict[int, int] = {}
        """Units with a frozen part recomputed in this backward: the graph task that recomputed them."""
        self._handles = []
        self.frozen_only = list(frozen_only)
        self._frozen_inputs: dict[int, int] = {}
        """Frozen parts of their own: the gradients for their modules' inputs still to come in this backward."""
        check_guards_in_full(
            m for unit in [*units, *frozen_only] if unit.module is not None for m in unit.module.modules()
        )
        for unit in units:
            if unit.persistent:
                continue
            assert unit.module is not None
            self._handles.append(
                unit.module.register_forward_pre_hook(EagerHook(self._pre_forward, unit), with_kwargs=True)
            )
            self._handles.append(unit.module.register_forward_hook(EagerHook(self._post_forward, unit)))
        for part in self.frozen_only:
            assert part.module is not None
            self._handles.append(
                part.module.register_forward_pre_hook(EagerHook(self._frozen_pre_forward, part), with_kwargs=True)
            )
            self._handles.append(part.module.register_forward_hook(EagerHook(self._frozen_post_forward, part)))

    def _use(self, unit: Unit, backward: bool) -> None:
        """Gather ``unit`` for use now; learn the order; prefetch the unit expected next."""
        last = self._last[backward]
        successors = self._next[backward]
        if last is not None and last != unit.index:
            expected = successors.get(last)
            if self.prefetch and expected is not None and expected != unit.index and not self._warned:
                warnings.warn(
                    "ZeroQ stage 3: the model took a different path than on the recorded step; its "
                    "units are gathered on demand and the new order is learned (not an error).",
                    stacklevel=3,
                )
                self._warned = True
            successors[last] = unit.index
        self._last[backward] = unit.index
        if not backward:
            self._forward.setdefault(unit.index)
        if unit in self._prefetched:
            self._prefetched.remove(unit)
        self.gatherer.gather(unit)
        if self.prefetch:
            self._prefetch(self._ahead(unit.index, successors))

    def _ahead(self, index: int, successors: dict[int, int]) -> list[Unit]:
        """The next ``depth`` units of the recorded order after ``index``."""
        ahead: list[int] = []
        nxt = successors.get(index)
        while nxt is not None and nxt != index and nxt not in ahead and len(ahead) < self.depth:
            ahead.append(nxt)
            nxt = successors.get(nxt)
        return [self.units[i] for i in ahead]

    def _prefetch(self, expected: list[Unit]) -> None:
        for stale in [u for u in self._prefetched if u not in expected]:
            self.gatherer.free(stale)  # a misprediction: hold only the units expected next
        # A unit freed behind the coordinator's back (a step's publish after a no-grad forward that
        # prefetched it) is held no more: gathered again below, once.
        self._prefetched = [u for u in self._prefetched if u in expected and u.state is not UnitState.SHARDED]
        for unit in expected:
            if unit.state is UnitState.SHARDED:
                self.gatherer.gather(unit, prefetch=True)
                self._prefetched.append(unit)

    # The reducer's listener interface.

    def expected_order(self) -> list[int]:
        """The transient units in the order a backward after the forward just run completes their
        gradients: the reverse of their first use in it. The same on every rank, as the gathers are
        collectives: every rank runs the same modules in a forward."""
        return list(reversed(self._forward))

    def unit_reduced(self, unit: Unit) -> None:
        keep = self._inputs.get(unit.index, 0) > 0
        if not keep and self._recomputed.get(unit.index, _current_task()) != _current_task():
            # A reentrant checkpoint's nested backward (the recomputation ran in the backward that started it): its
            # nodes may still read the frozen part, and its inputs were not seen; they have all run when it ends.
            torch.autograd.Variable._execution_engine.queue_callback(EagerHook(self._nested_ended, unit))
            keep = True
        self.gatherer.free(unit, frozen=not keep)

    def _nested_ended(self, unit: Unit) -> None:
        if unit.state is UnitState.SHARDED:
            self.gatherer.free(unit)  # its frozen part (the unit was freed when reduced)

    def _input_grad(self, unit: Unit, grad: torch.Tensor) -> None:
        """A gradient for an input of ``unit``'s module arrived: once the last has, and the unit is reduced, no
        node of the backward reads its frozen part any more."""
        left = self._inputs[unit.index] = self._inputs.get(unit.index, 0) - 1
        if left <= 0 and unit.state is UnitState.SHARDED:
            self.gatherer.free(unit)

    def backward_ended(self) -> None:
        """The backward pass is over: every transient unit is freed."""
        self.gatherer.checking = 0  # the first step's gathers agreed on every rank
        for unit in self.units:
            self.gatherer.free(unit)
        # The next forward starts a new order: its first unit is not learned as the successor of this
        # forward's last (that prefetch was held through the loss and the backward, then freed unused).
        self._last[False] = self._last[True] = None
        self._prefetched = []
        self._forward = {}
        self._inputs = {}
        self._frozen_inputs = {}
        for part in self.frozen_only:
            self._frozen().free(part)
        self._recomputed = {}

    # Hooks (installed as ``EagerHook``s).

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> None:
        if _in_backward():
            # Activation checkpointing recomputes the forward inside the backward: the unit is gathered
            # (its gradients come right after) but the recorded orders and the prefetch are left as they are.
            self.gatherer.gather(unit)
            if unit.frozen is not None:
                self._recomputed[unit.index] = _current_task()
            return
        self._use(unit, backward=False)
        if unit.frozen is not None and torch.is_grad_enabled():
            for t in tree_flatten((args, kwargs))[0]:  # by keyword too: Hugging Face's hidden_states=...
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self._inputs[unit.index] = self._inputs.get(unit.index, 0) + 1
                    t.register_hook(EagerHook(self._input_grad, unit))

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if _in_backward():
            return  # a recomputation: the unit stays gathered until its gradients are reduced
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.gatherer.free(unit)  # else it stays gathered until its gradients are reduced
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(EagerHook(self._pre_backward, unit))

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._use(unit, backward=True)

    # Frozen parts of their own (a frozen block, embedding or head): gathered around their module's forward,
    # again for its backward when an output needs a gradient, and freed once its inputs have theirs (or when
    # the backward ends); not in the learned order, so not prefetched.

    def _frozen(self) -> Gatherer:
        assert self.gatherer.frozen is not None
        return self.gatherer.frozen

    def _frozen_pre_forward(self, part: Unit, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._frozen().gather(part)
        if torch.is_grad_enabled() and not _in_backward():
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self._frozen_inputs[part.index] = self._frozen_inputs.get(part.index, 0) + 1
                    t.register_hook(EagerHook(self._frozen_input_grad, part))

    def _frozen_post_forward(self, part: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if _in_backward():
            return  # a recomputation: kept until its inputs have their gradients
        needs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.reshard_after_forward or not needs or not torch.is_grad_enabled():
            self._frozen().free(part)
        for t in needs if torch.is_grad_enabled() else ():
            t.register_hook(EagerHook(self._frozen_pre_backward, part))

    def _frozen_pre_backward(self, part: Unit, grad: torch.Tensor) -> None:
        self._frozen().gather(part)

    def _frozen_input_grad(self, part: Unit, grad: torch.Tensor) -> None:
        left = self._frozen_inputs[part.index] = self._frozen_inputs.get(part.index, 0) - 1
        if left <= 0:
            self._frozen().free(part)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _current_task() -> int:
    """The autograd graph task running on this thread (-1: none); a nested backward has its own."""
    return torch._C._current_graph_task_id()


def _in_backward() -> bool:
    """Is the autograd engine running a backward pass on this thread (a checkpoint's recomputation)?"""
    return _current_task() != -1
