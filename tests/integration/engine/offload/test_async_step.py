"""Asynchronous host steps (offload_async_step): step() returns before the host has stepped, the next
forward waits per unit, and training is bitwise the training with the step run in one go: losses,
masters, optimizer state, working weights, state dicts, whatever the window does between steps
(clipping, accumulation, unused parameters, a non-finite gradient on one rank, zero_grad, state reads,
an evaluation forward and the optimizer's load_state_dict right after a step). Two gloo ranks; stage 3 with units that really leave
the gathered state (persistence threshold 40 elements).

On CPU a tiny model's host step is over before the next forward begins, so the tests hold the worker
before each unit until something asks for it (``_gate``): every step's units are then published by
the next forward's hooks (or a stage-3 gather), which the tests check happened."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.zero.offload.async_step import AsyncHostStep
from tests.integration.engine.offload.test_offload import TwoHeads, _loss
from tests.integration.engine.offload.test_speculative import _same

pytestmark = pytest.mark.usefixtures("host_kernel")  # tests/conftest.py: skips where it cannot match torch

CASES = {
    "s1_bf16": (1, {}, torch.bfloat16),
    "s2_bf16": (2, {}, torch.bfloat16),
    "s2_fp32": (2, {}, torch.float32),
    "s3_bf16": (3, {}, torch.bfloat16),
    "s3_params_bf16": (3, {"offload_parameters": True}, torch.bfloat16),
    "s3_params_fp32": (3, {"offload_parameters": True}, torch.float32),
    "s2_spec_bf16": (2, {"offload_speculative_step": True}, torch.bfloat16),
    "s3_params_spec_bf16": (3, {"offload_parameters": True, "offload_speculative_step": True}, torch.bfloat16),
    # a share of the units on the host (the others step on the device within step())
    "s2_ratio_bf16": (2, {"offload_optimizer_ratio": 0.5}, torch.bfloat16),
    "s3_ratio_bf16": (3, {"offload_optimizer_ratio": 0.6}, torch.bfloat16),
    "s3_ratio_spec_bf16": (3, {"offload_optimizer_ratio": 0.6, "offload_speculative_step": True}, torch.bfloat16),
}
SCRIPT = ["plain", "plain", "clip_idle", "accumulate", "read_before_step", "eval_after_step", "zero_grad_then_plain",
          "other_head", "clip_in_effect", "read_after_step", "reload_state_after_step", "plain"]


def _gate() -> None:
    """Hold the worker before each unit until the main thread needs that unit (or a later one)."""
    if getattr(AsyncHostStep, "_gated", False):
        return
    run, need = AsyncHostStep.run, AsyncHostStep.need

    def gated_run(self, *args) -> None:
        self._asked = -1  # nothing is pending: the worker starts inside run
        run(self, *args)

    def gated_need(self, index: int, early: bool = True) -> None:
        with self._cv:
            self._asked = max(getattr(self, "_asked", -1), index)
            self._cv.notify_all()
        need(self, index, early)

    def may_start(self, unit) -> None:
        with self._cv:
            while self._asked < unit.index:
                self._cv.wait()

    AsyncHostStep.run, AsyncHostStep.need, AsyncHostStep._may_start = gated_run, gated_need, may_start  # type: ignore[method-assign]
    AsyncHostStep._gated = True


def _train(case: str, asynchronous: bool, nan_step: int = -1, action: str = "skip"):
    _gate()
    stage, options, dtype = CASES[case]
    torch.manual_seed(0)
    model = TwoHeads().to(dtype)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, reduce_bucket_size=700, stage3_wrap_classes=["Linear"],
                                          stage3_param_persistence_threshold=40, nonfinite_gradients=action,
                                          offload_optimizer=True, offload_async_step=asynchronous, **options),
                        param_dtype=dtype)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    assert isinstance(engine.parts.host_step, AsyncHostStep) == asynchronous
    if stage == 3:
        assert sum(not u.persistent for u in engine.parts.units) >= 3, "stage 3 must have units that are freed"
    out, errors = [], []
    for step, what in enumerate(SCRIPT):
        head = 1 if what == "other_head" else 0  # the other head: parameters no rank used this window
        backwards = 2 if what == "accumulate" else 1
        losses = []
        for micro in range(backwards):
            loss = _loss(model, step, micro, head=head).float()
            losses.append(loss.detach().clone())
            if step == nan_step and dist.get_rank() == 1:
                loss = loss * float("nan")
            engine.backward(loss / backwards, boundary=micro == backwards - 1)
        if what == "clip_in_effect":
            engine.clip_grad_norm_(1e-3)
        elif what == "clip_idle":
            engine.clip_grad_norm_(1e6)
        elif what == "read_before_step":
            out.append(("read", engine.full_state_dict()))
        elif what == "zero_grad_then_plain":
            engine.zero_grad()
            engine.backward(_loss(model, step, 7, head=1).float(), boundary=True)
        try:
            engine.step()
        except RuntimeError as error:
            errors.append(str(error))
        engine.zero_grad()
        if what == "eval_after_step":  # a forward without gradients, as validation runs right after a step
            with torch.no_grad():
                losses.append(_loss(model, step, 9, head=0).float())
        if what == "read_after_step":
            if stage < 3:  # the model's own state dict first: its working weights, after the step
                out.append(("module", {k: v.clone() for k, v in model.state_dict().items()}))
            out.append(("after", engine.full_state_dict(), engine.full_optimizer_state()))
        if step == 1:
            saved = copy.deepcopy(engine.optimizer.state_dict())
        if what == "reload_state_after_step":  # while the step's jobs still point into the state it replaces
            engine.optimizer.load_state_dict(saved)
        out.append((step, losses))
    engine.wait_for_step()
    opt = engine.optimizer  # state in the groups' order (an asynchronous step makes it in another order)
    state = [t.detach().clone() for g in opt.param_groups for v in g["params"] for t in opt.state[v].values()]
    out.append(([u.master.detach().clone() for u in engine.parts.units], state, engine.full_state_dict(),
                [p.detach().clone() for p in model.parameters()] if stage < 3 else []))  # working weights
    early = getattr(engine.parts.host_step, "published_early", 0)
    engine.close()
    return out, errors, early


@pytest.mark.parametrize("case", list(CASES))
def test_async_steps_are_bitwise_the_steps(dist_pool, case):
    ours = dist_pool(2).run(_train, case, True)
    theirs = dist_pool(2).run(_train, case, False)
    for (a, errors_a, early), (b, errors_b, _) in zip(ours, theirs):
        assert not errors_a and not errors_b
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert _same(x, y), f"{case}: {x[0]} differs"
        # Every step but the last is followed by a forward that had to publish its units itself (with a
        # ratio only the host's units wait, which some forwards reach only after the backward's wait).
        assert early >= (len(SCRIPT) - 1) // (2 if "ratio" in case else 1), early


@pytest.mark.parametrize("case", ["s2_bf16", "s3_params_bf16"])
@pytest.mark.parametrize("action", ["skip", "error"])
def test_a_nonfinite_gradient_after_an_async_step_leaves_the_model_as_it_was(dist_pool, case, action):
    """NaN on rank 1 in the window after an asynchronous step: that step's work is finished and
    published first, then this one is skipped (or fails) on every rank, bitwise as without it."""
    ours = dist_pool(2).run(_train, case, True, 1, action)
    theirs = dist_pool(2).run(_train, case, False, 1, action)
    for (a, errors_a, _), (b, errors_b, _) in zip(ours, theirs):
        assert len(errors_a) == len(errors_b) == (action == "error")
        for x, y in zip(a, b):
            assert _same(x, y), f"{case}: {x[0]} differs"


def test_async_step_needs_what_it_says(dist_pool):
    """Off with a warning where it cannot take effect; a step it cannot take runs synchronously, with a warning."""
    import warnings

    for options in ({}, {"offload_optimizer": True, "offload_optimizer_ratio": 0.0},
                    {"offload_optimizer": True, "offload_optimizer_ratio": "auto"}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = ZeroEngine(TwoHeads(), ZeroConfig(stage=2, offload_async_step=True, **options))
        assert any("offload_async_step=True has no effect" in str(w.message) for w in caught), options
        assert not isinstance(engine.parts.host_step, AsyncHostStep)
        engine.close()
    with pytest.raises(ValueError, match="offload_async_step"):
        ZeroConfig(offload_async_step="yes")
    assert dist_pool(1).run(_sgd_runs_synchronously) == [True]


def _sgd_runs_synchronously() -> bool:
    torch.manual_seed(0)
    model = TwoHeads()
    engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True, offload_async_step=True))
    engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(_loss(model, 0, 0, head=0))
    before = [u.master.clone() for u in engine.parts.units]
    with pytest.warns(UserWarning, match="runs synchronously: the host kernel does not take this optimizer"):
        engine.step()
    stepped = not engine.parts.host_step._pending and all(not torch.equal(a, u.master) for a, u in zip(before, engine.parts.units))
    engine.close()
    return stepped


def _copied_after_an_async_step() -> bool:
    """A deep copy of the model taken right after an asynchronous step (a callback copying it, an EMA
    made then) holds the stepped weights, as plain parameters."""
    _gate()
    torch.manual_seed(0)
    copies = []
    for asynchronous in (True, False):
        torch.manual_seed(0)
        model = TwoHeads()
        engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True, offload_async_step=asynchronous))
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        engine.backward(_loss(model, 0, 0, head=0))
        engine.step()
        copied = copy.deepcopy(model)
        copies.append([p.detach().clone() for p in copied.parameters()])
        assert all(type(p) is torch.nn.Parameter for p in copied.parameters())
        engine.close()
    return all(torch.equal(a, b) for a, b in zip(*copies))


def test_a_deep_copy_after_an_async_step_holds_the_stepped_weights(dist_pool):
    assert dist_pool(2).run(_copied_after_an_async_step) == [True, True]
