"""Asynchronous host steps (``offload_async_step``): ``step()`` queues the host's work and returns; the
next forward waits for each unit's new weights, not for the whole step.

Why. With every unit's optimizer on the host, a step is the host kernel's pass over all masters and
moments (about 0.2 s for 953M elements on 16 cores) while the device waits, and the next forward waits
for its end. Its first unit's weights are ready long before that.

How. At ``step()``, on the calling thread, each unit of the optimizer is prepared in forward order
(unit 0 first, the one the forward needs first): a speculative step of it is kept (``speculate.py``),
or its kernel jobs are built (state made, step counts advanced, the gradient multiplier taken; see
``HostOptimizer.step_later``). A worker thread then runs the jobs unit by unit: the first unit in
forward order whose gradient has landed on the host, so that the host never waits while there is
work (the gradients land in reverse order, unit 0's last). Publishing a unit (its copy to the device, the gather of
stages 1/2, the bf16 payload of a stage-3 store) stays on the calling thread, in the same unit order
on every rank, so collectives match: ``need(i)`` publishes every unit up to ``i`` once the worker has
stepped it. It runs from a forward pre-hook on the topmost modules whose parameters lie in one unit
(and on any module holding parameters of several units directly), and before a stage-3 gather.
Anything else that reads or writes masters, state or host gradients waits for all of it first
(``drain``): through the host placement's ``settle`` (its walks over the masters, which state dicts,
checkpoints, loads and ``gathered_parameters`` take; its gradient copies and the next backward; the
next step; attaching an optimizer), and the optimizer's own ``state_dict`` and ``load_state_dict``
and the model's ``state_dict`` (pre-hooks). ``zero_grad`` does not wait.

So the numbers are those of the step run in one go: the same jobs on the same inputs; only when each
is run and when each unit is published move. What it cannot see: a parameter read outside its
module's call (a callback reading ``param.data`` after the step, a tied weight used through another
module) before that module runs; such code calls ``ZeroEngine.wait_for_step()`` first.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from lightning_zeroq.zero.hooks import EagerHook
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.optimizers import Binding, OneStep
from lightning_zeroq.zero.unit import Unit


class InStep:
    """Without ``offload_async_step``: every step is done when ``step()`` returns."""

    steps = 0

    def takes(self, binding: Binding, several: bool) -> bool:
        return False

    def run(self, binding: Binding, used: Sequence[Any]) -> None:
        raise AssertionError("takes() is False")

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class StepAhead(InStep):
    """The asynchronous step of one engine whose every unit steps on the host."""

    def __init__(self, host: HostOptimizer, module: nn.Module, units: Sequence[Unit],
                 publish: Callable[[Unit], None]) -> None:
        self.host, self.units, self._publish = host, units, publish
        self._cv = threading.Condition()
        self._pending: deque[Unit] = deque()
        """Units of the step queued last, in order, not yet published."""
        self._stepped: set[int] = set()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._warned = False
        self.steps = 0
        """Steps taken asynchronously."""
        self.published_early = 0
        """Units published by a forward or a gather (not by ``drain``), over all steps."""
        self._held: list[torch.Tensor] = []
        self._watched: dict[int, list] = {}
        """Per optimizer (by id): its state_dict / load_state_dict pre-hooks, which wait for the step."""
        hooked = _hook_modules(module, units)
        self._handles = [m.register_forward_pre_hook(EagerHook(self, "_before_forward", index)) for m, index in hooked]
        # A module's state_dict() (the model's, or one of those modules') reads the weights: the step first.
        for m in {id(m): m for m in [module, *(m for m, _ in hooked)]}.values():
            self._handles.append(m.register_state_dict_pre_hook(EagerHook(self, "_before_read")))
        host.settle = self.drain

    # ------------------------------------------------------------------ the step

    def takes(self, binding: Binding, several: bool) -> bool:
        """Whether this step runs asynchronously: one optimizer, the host kernel takes every unit, no
        optimizer step hooks (they would run before the step's work is done); else a warning, once."""
        optimizer = binding.optimizer
        kernel = self.host.kernel
        why = None
        if several:
            why = "several optimizers are attached"
        elif kernel is None or kernel.plan([u for u in self.units if u.index in binding.unit_ids], binding) is None:
            why = "the host kernel does not take this optimizer (it needs torch's Adam or AdamW, see the log)"
        elif (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
              or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
            why = "the optimizer has step hooks, which would run before the step's work is done"
        if why is not None and not self._warned:
            self._warned = True
            warnings.warn(f"offload_async_step=True: this step runs synchronously: {why}.", stacklevel=3)
        return why is None

    def run(self, binding: Binding, used: Sequence[Any]) -> None:
        """Prepare every unit of ``binding`` here, in forward order, and hand their jobs to the worker."""
        self.drain()  # the step before (a step with no backward since is possible)
        kernel = self.host.kernel
        assert kernel is not None  # takes() said so
        self._watch(binding.optimizer)
        mine = [u for u in self.units if u.index in binding.unit_ids]
        hypers = kernel.plan(mine, binding)
        assert hypers is not None  # takes() said so
        work = []
        with OneStep(binding.optimizer) as one_step:  # no hooks (takes); the optimizer's own step() runs once
            for unit in mine:
                work.append((unit, *self.host.step_later(unit, binding, used, hypers)))
            one_step.step()
        # The jobs point into these tensors: held until the worker is done, whatever the optimizer's
        # state dict is given meanwhile (a load_state_dict between the step and the next forward).
        state = binding.optimizer.state
        self._held = [t for unit in mine for view, _ in binding.optimized[unit.index]
                      for t in (view, *state[view].values()) if isinstance(t, torch.Tensor)]
        with self._cv:
            self._pending.extend(mine)
            self._stepped.clear()
        threads = torch.get_num_threads()  # all of them: the calling thread mostly waits for the worker
        self._thread = threading.Thread(target=self._work, args=(work, threads), name="zeroq-async-step",
                                        daemon=True)
        self._thread.start()
        self.steps += 1

    def _watch(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.state_dict()`` and ``load_state_dict()`` called directly (not through the engine)
        wait for the step first, as the engine's own readers do."""
        if id(optimizer) not in self._watched:
            self._watched[id(optimizer)] = [
                optimizer.register_state_dict_pre_hook(EagerHook(self, "_before_read")),
                optimizer.register_load_state_dict_pre_hook(EagerHook(self, "_before_read"))]

    def _before_read(self, *hook_args: Any) -> None:
        """A state_dict / load_state_dict pre-hook (a module's or an optimizer's): the step first."""
        self.drain()

    def _work(self, work: list, threads: int) -> None:
        kernel = self.host.kernel
        assert kernel is not None
        try:
            left = list(work)  # in forward order
            while left:
                item = _next(left)
                left.remove(item)
                unit, copied, jobs = item
                self._may_start(unit)
                if jobs:
                    if copied is not None:
                        copied.synchronize()  # the gradient's copy to the host
                    with torch.profiler.record_function("zeroq.optimizer_step"):
                        kernel.kernel.run(jobs, threads=threads)
                with self._cv:
                    self._stepped.add(unit.index)
                    self._cv.notify_all()
        except BaseException as caught:  # reported by the next need() or drain(), on the calling thread
            with self._cv:
                self._error = caught
                self._cv.notify_all()

    def _may_start(self, unit: Unit) -> None:
        """The worker is about to step ``unit`` (a seam: the tests hold it here until the unit is needed)."""

    # ------------------------------------------------------------------ waiting

    def need(self, index: int, early: bool = True) -> None:
        """Publish every pending unit up to unit ``index`` (in unit order), each once it is stepped."""
        while self._pending and self._pending[0].index <= index:
            unit = self._pending[0]
            with self._cv:
                while unit.index not in self._stepped and self._error is None:
                    self._cv.wait()
                error = self._error
            if error is not None:
                self._fail(error)
            self._pending.popleft()
            kernel = self.host.kernel
            assert kernel is not None  # run() had it
            kernel.stepped(unit.index)  # its bf16 copy is the new master's cast, whatever a zero_grad cleared
            with torch.profiler.record_function("zeroq.publish"):
                self._publish(unit)
            self.published_early += early

    def drain(self) -> None:
        """Publish every pending unit; the worker has then ended."""
        if self._pending:
            self.need(self._pending[-1].index, early=False)
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._held = []
        if self._error is not None:
            self._fail(self._error)

    def _fail(self, error: BaseException) -> None:
        self._error = None
        self._pending.clear()
        raise RuntimeError("ZeroQ: the asynchronous host step failed part way (offload_async_step); the "
                           "model's weights and optimizer state are partly stepped: load the last "
                           "checkpoint") from error

    def ready(self, index: int, prefetch: bool) -> bool:
        """Before a stage-3 gather of unit ``index``: publish it first; a prefetch of a unit the worker
        has not stepped yet is left out instead (False), so the forward is not held up for it."""
        if prefetch and self._pending and self._pending[0].index <= index:
            with self._cv:
                if index not in self._stepped:
                    return False
        self.need(index)
        return True

    def _before_forward(self, index: int, module: nn.Module, args: Any) -> None:
        self.need(index)

    def close(self) -> None:
        self.drain()
        for handle in [*self._handles, *(h for hs in self._watched.values() for h in hs)]:
            handle.remove()
        self._handles, self._watched = [], {}


def _next(left: list) -> tuple:
    """The unit to step next: the first in forward order whose gradient is on the host (a speculated
    unit has nothing to wait for); if none has landed, the last (the gradients leave the device in
    reverse order, so it lands first). The host never waits while a gradient it could step is there."""
    for item in left:
        copied, jobs = item[1], item[2]
        if not jobs or copied is None or copied.query():
            return item
    return left[-1]


def _hook_modules(root: nn.Module, units: Sequence[Unit]) -> list[tuple[nn.Module, int]]:
    """Where the forward waits: the topmost modules whose parameters all lie in one unit (waiting for
    that unit), and any module holding parameters of several units directly (waiting for the last)."""
    owner = {id(p): unit.index for unit in units for p in unit.params}
    below: dict[int, set[int]] = {}

    def units_below(module: nn.Module) -> set[int]:
        if id(module) not in below:
            found = {owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner}
            for child in module.children():
                found |= units_below(child)
            below[id(module)] = found
        return below[id(module)]

    hooks: list[tuple[nn.Module, int]] = []

    def visit(module: nn.Module) -> None:
        found = units_below(module)
        if len(found) == 1:
            hooks.append((module, next(iter(found))))
            return
        direct = {owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner}
        if direct:
            hooks.append((module, max(direct)))
        for child in module.children():
            if units_below(child):
                visit(child)

    visit(root)
    return hooks
