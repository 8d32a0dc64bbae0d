"""The scripted training loop of the bitwise offload suites (``test_speculative.py``, ``test_async_step.py``,
``test_host_kernel.py``): the same training run twice, with and without what is tested, and compared bit
for bit. A script is a list of windows (``Window``: the backward passes between two steps and what the
caller does around the step); ``WINDOWS`` names the ones the suites share.

Two seams make the worker's order certain, so no test depends on thread timing (``host_worker.py``):
``hold_async_steps`` holds the worker before each unit of an asynchronous step until the calling thread
waits for that unit (every step's units are then published by the next forward's waits);
``finish_speculation`` lets ``undo_all`` wait until every unit offered has been stepped (so reads and
``zero_grad`` before a step find speculated units to undo)."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.integration.engine.offload.test_offload import TwoHeads, _loss

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Window:
    backwards: int = 1
    head: int = 0
    """The head the backward passes go through (``TwoHeads``: the other head's parameters get no gradient)."""
    managed: bool = True
    """The last backward says it ends the window (``boundary=True``); else no backward says anything."""
    clip: Optional[float] = None
    """``clip_grad_norm_`` before the step (1e6: a clip that changes nothing; 1e-3: one in effect)."""
    read_before: bool = False
    """``full_state_dict`` between the backward passes and the step."""
    zero_grad_first: bool = False
    """``zero_grad`` after the backward passes, then one more backward through the other head."""
    eval_after: bool = False
    """A forward without gradients right after the step (its loss is recorded)."""
    read_after: bool = False
    """The model's own state dict (stages 1 and 2), ``full_state_dict`` and ``full_optimizer_state`` after the step."""
    reload_after: bool = False
    """``optimizer.load_state_dict`` of the state after step 1, right after the step."""


WINDOWS = {
    "plain": Window(),
    "accumulate": Window(backwards=2),
    "other_head": Window(head=1),
    "clip_idle": Window(clip=1e6),
    "clip_in_effect": Window(clip=1e-3),
    "read_before_step": Window(read_before=True),
    "zero_grad_then_plain": Window(zero_grad_first=True),
    "eval_after_step": Window(eval_after=True),
    "read_after_step": Window(read_after=True),
    "reload_state_after_step": Window(reload_after=True),
}


def two_heads_engine(stage: int, options: dict, dtype: torch.dtype, *, optimizer: str = "adamw",
                     device: torch.device = CPU) -> tuple[TwoHeads, ZeroEngine]:
    """``TwoHeads`` in ``dtype`` under an engine whose stage 3 has units that are really freed (every
    ``Linear``, persistence threshold 40 elements), with AdamW (or Adam with L2 decay, ``"adam_l2"``)."""
    torch.manual_seed(0)
    model = TwoHeads().to(dtype).to(device)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, reduce_bucket_size=700, stage3_wrap_classes=["Linear"],
                                          stage3_param_persistence_threshold=40, **options), param_dtype=dtype)
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, betas=(0.8, 0.95))}[optimizer]
    engine.attach_optimizer(make(model.parameters()))
    return model, engine


def train(engine: ZeroEngine, model: TwoHeads, script: Sequence[Window], *, nan_step: int = -1,
          device: torch.device = CPU, before_step: Callable[[], None] = lambda: None,
          after_step: Optional[Callable[[], Any]] = None) -> tuple[list, list[str]]:
    """Train through ``script``, one window a step: a NaN loss on rank 1 in step ``nan_step``; ``before_step``
    called after the window's backward passes, ``after_step`` (what it returns is recorded) after the step's
    ``zero_grad``. Returns what the script recorded, in order (each step's losses, the reads), and the
    errors of the steps that failed (the window is then dropped)."""
    out: list = []
    errors: list[str] = []
    saved = None
    for step, window in enumerate(script):
        losses = []
        for micro in range(window.backwards):
            loss = _loss(model, step, micro, head=window.head, device=device).float()
            losses.append(loss.detach().cpu().clone())
            if step == nan_step and dist.get_rank() == 1:
                loss = loss * float("nan")
            last = micro == window.backwards - 1
            engine.backward(loss / window.backwards, boundary=last if window.managed else None)
        before_step()
        if window.clip is not None:
            engine.clip_grad_norm_(window.clip)
        if window.read_before:
            out.append(("read", engine.full_state_dict()))  # before the step: the masters as before it
        if window.zero_grad_first:
            engine.zero_grad()
            engine.backward(_loss(model, step, 7, head=1, device=device).float(), boundary=True)
        try:
            engine.step()
        except RuntimeError as error:
            errors.append(str(error))
        engine.zero_grad()
        if window.eval_after:  # a forward without gradients, as validation runs right after a step
            with torch.no_grad():
                losses.append(_loss(model, step, 9, head=0, device=device).float().cpu())
        if window.read_after:
            if engine.parts.stage3 is None:  # the model's own state dict first: its working weights, after the step
                out.append(("module", {k: v.clone() for k, v in model.state_dict().items()}))
            out.append(("after", engine.full_state_dict(), engine.full_optimizer_state()))
        if step == 1 and any(w.reload_after for w in script):
            saved = copy.deepcopy(engine.optimizer.state_dict())
        if window.reload_after:  # while the step's jobs may still point into the state it replaces
            engine.optimizer.load_state_dict(saved)
        out.append((step, losses) if after_step is None else (step, losses, after_step()))
    return out, errors


def snapshot(engine: ZeroEngine, model: TwoHeads) -> tuple:
    """Once the host's work is done: this rank's masters, the optimizer state (in the param groups' order: an
    asynchronous step makes it in another), the full state and (stages 1 and 2) the working weights."""
    engine.parts.worker.wait()
    opt = engine.optimizer
    state = [t.detach().cpu().clone() for g in opt.param_groups for v in g["params"] for t in opt.state[v].values()]
    working = [p.detach().clone() for p in model.parameters()] if engine.parts.stage3 is None else []
    return ([u.master.detach().cpu().clone() for u in engine.parts.units], state, engine.full_state_dict(), working)


def bitwise_runs(pool: Any, body: Callable[..., tuple], case: str, *args: Any) -> list[tuple[tuple, tuple]]:
    """``body(case, True, *args)`` (what is tested on) and ``body(case, False, *args)`` on every rank of ``pool``:
    the records each returns first are bitwise the same, one by one. Per rank, what each returned."""
    ours, theirs = pool.run(body, case, True, *args), pool.run(body, case, False, *args)
    for (a, *_), (b, *_) in zip(ours, theirs):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert same(x, y), f"{case}: {x[0]} differs"
    return list(zip(ours, theirs))


def same(a: Any, b: Any) -> bool:
    """Bitwise equal, through dicts, lists and tuples."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------- seams


def hold_async_steps() -> None:
    """Hold the worker before each unit of an asynchronous step until the calling thread waits for that unit
    (or a later one, or the whole step) after the step."""
    from lightning_zeroq.zero.offload.async_step import AsyncHostStep
    from lightning_zeroq.zero.offload.host_worker import HostWorker

    if getattr(AsyncHostStep, "_held", False):
        return
    run, wait = AsyncHostStep.run, HostWorker.wait
    cv = threading.Condition()
    asked: list[float] = []  # every unit a wait asked for, in order (a wait for everything: inf)

    def held_run(self, *args) -> None:
        self._asked_from = None  # the units of this step start once waited for after it
        run(self, *args)  # (its own wait for the step before comes first)
        with cv:
            self._asked_from = len(asked)
            cv.notify_all()

    def held_wait(self, index: Optional[int] = None) -> None:
        with cv:
            asked.append(float("inf") if index is None else index)
            cv.notify_all()
        wait(self, index)

    def may_start(self, unit) -> None:
        with cv:
            while self._asked_from is None or max(asked[self._asked_from:], default=-1) < unit.index:
                cv.wait()

    AsyncHostStep.run, AsyncHostStep._may_start = held_run, may_start  # type: ignore[method-assign]
    HostWorker.wait = held_wait  # type: ignore[method-assign]
    AsyncHostStep._held = True


def finish_speculation() -> None:
    """Let ``Speculation.undo_all`` wait until every unit offered so far has been stepped."""
    from lightning_zeroq.zero.offload.speculative_step import Speculation

    if getattr(Speculation, "_finished", False):
        return
    undo_all = Speculation.undo_all

    def finishing(self) -> None:
        for job in list(self._jobs):
            self.worker.wait(job.unit)
        undo_all(self)

    Speculation.undo_all = finishing  # type: ignore[method-assign]
    Speculation._finished = True
