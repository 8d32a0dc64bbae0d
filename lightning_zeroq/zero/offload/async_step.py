"""Asynchronous host steps (``offload_async_step``): ``step()`` queues the host's work and returns; the
next forward waits for each unit's new weights, not for the whole step.

[Note: the host step runs beside the next forward]
Why. With every unit's optimizer on the host, a step is the host kernel's pass over all masters and
moments, bound by the host's memory bandwidth (``benchmarks/results/host_adam_1xh200_2026-12-02.jsonl``),
while the device waits, and the next forward waits for its end. Its first unit's weights are ready
long before that.

How. At ``step()``, on the calling thread, each unit of the optimizer is prepared in forward order
(unit 0 first, the one the forward needs first): a speculative step of it is kept (``speculative_step.py``;
the units speculation has not started yet are taken over here), or its kernel jobs are built (state
made, step counts advanced, the gradient multiplier taken; see ``HostOptimizer.step_later``). Each unit
then becomes two jobs of the host's worker (``host_worker.py``), queued in forward order: its step,
ready once its gradient has landed on the host, and its publication (the copy to the device, the gather
of stages 1/2, the bf16 payload of a stage-3 store), ready once it is stepped and the unit before it
published. The worker takes the first ready job, so it steps the first unit in forward order whose
gradient has landed (the host never waits while there is work; the gradients land in reverse order,
unit 0's last) and publishes the units strictly in unit order as they are stepped, on a stream of its
own and, with several ranks, on a process group of its own. So every rank issues the publishing
collectives in the same order whatever its calling thread does meanwhile: a module that only some
ranks run, or a collective of the user's (``self.log(..., sync_dist=True)``), cannot interleave with
them.

Nothing reads a unit before it is published:

- A persistent unit's parameters are ``PendingParameter``s from ``step()`` until their unit is
  published: reading their values by any torch function (a module's forward, a callback averaging the
  weights, ``.data``, a state dict) waits for that unit first (the worker's ``wait(index)``), on the
  calling thread, which turns them back into what they were (``_joined``); their metadata (shape,
  dtype, ``grad``) reads as usual. A stage-3 unit is sharded at rest, and its gather waits the same
  way (``gather.Gatherer``).
- Forward pre-hooks publish ahead of the forward's first read, outside any compiled graph: on the
  topmost modules whose parameters all lie in one unit, below the module given to the engine (a
  LightningModule's own forward is never called by the Trainer), and on any module holding parameters
  of several units directly.
- Whatever reads or writes masters, state or host gradients waits for all of it first (the worker's
  ``wait()``): the host placement (its walks over the masters, which state dicts, checkpoints, loads and
  ``gathered_parameters`` take; the next backward; the next step; attaching an optimizer; a gradient's
  copy to the host waits for its unit), and the optimizer's own ``state_dict`` and ``load_state_dict``
  and the model's ``state_dict`` (pre-hooks). ``zero_grad`` does not wait.

So the numbers are those of the step run in one go: the same jobs on the same inputs; only when each
is run and when each unit is published move.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils import _pytree as pytree

from lightning_zeroq.zero.hooks import EagerHook, WeakHook
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.offload.host_worker import HostWorker, Job
from lightning_zeroq.zero.optim.binding import Binding, OneStep
from lightning_zeroq.zero.unit import METADATA, Unit


class AsyncHostStep:
    """The asynchronous step of the units of one engine that step on the host (``units``: all of them
    with full offload; with ``offload_optimizer_ratio`` below 1 the others step on the device, in the
    step itself, and are published before it returns, as without this). Its work runs on the host's
    worker (``host_worker.py``), two jobs per unit: the unit's step and its publication."""

    def __init__(
        self,
        host: HostOptimizer,
        worker: HostWorker,
        module: nn.Module,
        units: Sequence[Unit],
        publish: Callable[[Unit], None],
        device: torch.device,
        own_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """``publish``: a unit's publication, run on the worker's thread (with several ranks, its
        collectives on ``own_group``, a process group no other thread uses, destroyed at ``close``)."""
        self.host, self.worker, self.units, self._publish, self._own_group = host, worker, units, publish, own_group
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        """The worker's stream: its copies and collectives; the calling thread waits per unit."""
        self._last: list[Unit] = []
        """The units of the last step (made readable again should it fail)."""
        self._order: deque[Unit] = deque()
        """On the worker's thread: the units of the step left to publish, in unit order."""
        self._stepped: set[int] = set()
        """On the worker's thread: the units of the step stepped so far."""
        self._published: dict[int, Optional[torch.cuda.Event]] = {}
        """Units the worker has published and no wait has joined yet, with the event after it on its stream."""
        self._warned = False
        self.steps = 0
        """Steps taken asynchronously."""
        self.published_early = 0
        """Units joined by a wait for a unit (a forward, a gather, a parameter read), not for the whole step,
        over all steps."""
        self._watched: dict[int, list] = {}
        """Per optimizer (by id): its state_dict / load_state_dict pre-hooks, which wait for the step."""
        for unit in units:
            if unit.persistent:
                for p in unit.params:
                    p.__dict__["_zeroq_wait"] = WeakHook(worker.wait, unit.index)
        hooked = _hook_modules(module, units)
        self._handles = [m.register_forward_pre_hook(EagerHook(self._before_forward, index)) for m, index in hooked]
        # A module's state_dict() (the model's, or one of those modules') reads the weights: the step first.
        for m in {id(m): m for m in [module, *(m for m, _ in hooked)]}.values():
            self._handles.append(m.register_state_dict_pre_hook(EagerHook(self._before_read)))

    # ------------------------------------------------------------------ the step

    def takes(self, binding: Binding, several: bool) -> bool:
        """Whether this step runs asynchronously: one optimizer, the host kernel takes every unit, no
        optimizer step hooks (they would run before the step's work is done); else a warning, once."""
        optimizer = binding.optimizer
        kernel = self.host.kernel
        why = None
        if several:
            why = "several optimizers are attached"
        elif (
            kernel is None
            or kernel.kernel_args([u for u in self.units if u.index in binding.unit_ids], binding) is None
        ):
            why = "the host kernel does not take this optimizer (it needs torch's Adam or AdamW, see the log)"
        elif (
            optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks
        ):
            why = "the optimizer has step hooks, which would run before the step's work is done"
        if why is not None and not self._warned:
            self._warned = True
            warnings.warn(f"offload_async_step=True: this step runs synchronously: {why}.", stacklevel=3)
        return why is None

    def run(
        self, binding: Binding, used: Sequence[Any], device_step: Optional[Callable[[OneStep], Any]] = None
    ) -> None:
        """Prepare every unit of ``binding`` here, in forward order, and hand their jobs to the worker;
        ``device_step``: the step of the units on the device, run first, within the same optimizer step."""
        kernel = self.host.kernel
        assert kernel is not None  # takes() said so
        if self.host.spec is not None:
            self.host.spec.hand_over()  # the units it has not started step here, in forward order
        self.worker.wait()  # the step before (a step with no backward since is possible), a speculative step
        self._watch(binding.optimizer)
        mine = [u for u in self.units if u.index in binding.unit_ids]
        hypers = kernel.kernel_args(mine, binding)
        assert hypers is not None  # takes() said so
        work = []
        with OneStep(binding.optimizer) as one_step:  # no hooks (takes); the optimizer's own step() runs once
            ran = device_step is not None and device_step(one_step)
            for unit in mine:
                work.append((unit, *self.host.step_later(unit, binding, used, hypers)))
            if not ran:
                one_step.step()
        self._last = mine
        for unit in mine:  # readable again once published (the worker's wait joins the unit)
            if unit.persistent:
                for p in unit.params:
                    p.__class__ = PendingParameter
        if self._stream is not None:  # the worker's stream after the calling thread's work so far (the backward)
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._device))
            self._stream.wait_event(after)
        # A core stays with the calling thread: it launches the next forward while the worker steps the
        # units that forward reaches last; on a full machine the launches would queue behind the kernel.
        threads = max(1, torch.get_num_threads() - 1)
        self._order, self._stepped, self._published = deque(mine), set(), {}
        self.steps += 1
        state = binding.optimizer.state
        for unit, copied, jobs in work:
            # The jobs point into these tensors: held until the unit is stepped, whatever the optimizer's
            # state dict is given meanwhile (a load_state_dict between the step and the next forward).
            held = [
                t
                for view, _ in binding.optimized[unit.index]
                for t in (view, *state[view].values())
                if isinstance(t, torch.Tensor)
            ]
            self.worker.submit(
                Job(
                    unit.index,
                    functools.partial(self._step, unit, copied, jobs, threads, held),
                    self._failed,
                    ready=functools.partial(_landed, copied, jobs),
                )
            )
            self.worker.submit(
                Job(
                    unit.index,
                    functools.partial(self._publish_one, unit),
                    self._failed,
                    ready=functools.partial(self._publishable, unit),
                    waits=False,
                    joined=functools.partial(self._joined, unit),
                )
            )

    def _watch(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.state_dict()`` and ``load_state_dict()`` called directly (not through the engine)
        wait for the step first, as the engine's own readers do."""
        if id(optimizer) not in self._watched:
            self._watched[id(optimizer)] = [
                optimizer.register_state_dict_pre_hook(EagerHook(self._before_read)),
                optimizer.register_load_state_dict_pre_hook(EagerHook(self._before_read)),
            ]

    def _before_read(self, *hook_args: Any) -> None:
        """A state_dict / load_state_dict pre-hook (a module's or an optimizer's): the step first."""
        self.worker.wait()

    def _before_forward(self, index: int, module: nn.Module, args: Any) -> None:
        self.worker.wait(index)

    # ------------------------------------------------------------------ on the worker

    def _step(self, unit: Unit, copied: Optional["torch.cuda.Event"], jobs: list, threads: int, held: list) -> None:
        kernel = self.host.kernel
        assert kernel is not None  # run() had it
        self._may_start(unit)
        if jobs:
            if copied is not None:
                copied.synchronize()  # the gradient's copy to the host
            with torch.profiler.record_function("zeroq.optimizer_step"):
                kernel.kernel.run(jobs, threads=threads)
        self._stepped.add(unit.index)

    def _publishable(self, unit: Unit) -> bool:
        """The worker publishes in unit order: ``unit`` once it is stepped and every unit before it published."""
        return self._order[0] is unit and unit.index in self._stepped

    def _publish_one(self, unit: Unit) -> None:
        kernel = self.host.kernel
        assert kernel is not None  # run() had it
        self._order.popleft()
        kernel.stepped(unit.index)  # its bf16 copy is the new master's cast, whatever a zero_grad cleared
        with self._on_stream(), torch.profiler.record_function("zeroq.publish"):
            self._publish(unit)
            done = None
            if self._stream is not None:
                done = torch.cuda.Event()
                done.record(self._stream)
        self._published[unit.index] = done

    def _on_stream(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if self._stream is not None:
            stack.enter_context(torch.cuda.device(self._device))
            stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def _may_start(self, unit: Unit) -> None:
        """The worker is about to step ``unit`` (a seam: the tests hold it here until the unit is waited for)."""

    # ------------------------------------------------------------------ on the calling thread

    def _joined(self, unit: Unit, early: bool) -> None:
        """A wait covered ``unit``'s publication: its parameters are readable again, and the calling
        thread's stream comes after the worker's copies of it."""
        done = self._published.pop(unit.index)
        _readable(unit)
        if done is not None:
            torch.cuda.current_stream(self._device).wait_event(done)
        self.published_early += early

    def _failed(self, error: BaseException) -> BaseException:
        for unit in self._last:
            _readable(unit)
        return RuntimeError(
            "ZeroQ: the asynchronous host step failed part way (offload_async_step); the "
            "model's weights and optimizer state are partly stepped: load the last "
            "checkpoint"
        )

    def close(self) -> None:
        self.worker.wait()
        if self._own_group is not None:
            dist.destroy_process_group(self._own_group)
            self._own_group = None
        for handle in [*self._handles, *(h for hs in self._watched.values() for h in hs)]:
            handle.remove()
        self._handles, self._watched = [], {}


class PendingParameter(nn.Parameter):
    """A persistent unit's parameter between an asynchronous step and its unit's publication. Its
    metadata (shape, dtype, device, ``grad``) reads as usual; any other torch function of it (its values
    read or written, ``.data``) first waits for its unit (the host worker's ``wait``, which turns it back into
    what it was), so no path reads the weights from before the step."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        descriptor = getattr(func, "__self__", None)
        metadata = name in _METADATA or (
            name in ("__get__", "__set__", "__delete__") and getattr(descriptor, "__name__", "") != "data"
        )
        if not metadata:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, PendingParameter):
                    leaf.__dict__["_zeroq_wait"]()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy of the published parameter (``Parameter.__deepcopy__`` would copy this class too)."""
        self.__dict__["_zeroq_wait"]()
        if type(self) is PendingParameter:  # its engine is gone: nothing will publish it
            self.__class__ = nn.Parameter  # type: ignore[assignment]
        return self.__deepcopy__(memo)


# Pickling, printing: values read under the metadata's switch (no torch function of the values is seen).
_METADATA = METADATA - {"__repr__", "__format__", "__reduce_ex__"}


def _readable(unit: Unit) -> None:
    for p, cls in zip(unit.params, unit.param_classes):
        if type(p) is PendingParameter:
            p.__class__ = cls


def _landed(copied: Optional["torch.cuda.Event"], jobs: list) -> bool:
    """Whether a unit's step can start without waiting: its gradient is on the host (a kept speculative
    step has nothing to do)."""
    return not jobs or copied is None or copied.query()


def _hook_modules(root: nn.Module, units: Sequence[Unit]) -> list[tuple[nn.Module, int]]:
    """Where the forward waits: below ``root`` (whose own forward may never run: the Trainer calls a
    LightningModule's ``training_step``, which calls its submodules), the topmost modules whose parameters
    all lie in one unit (waiting for that unit); and any other module holding parameters directly,
    ``root`` included (waiting for the last unit of those)."""
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
        if len(found) == 1 and module is not root:
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
