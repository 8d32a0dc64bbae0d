"""Asynchronous host steps (offload_async_step): step() returns before the host has stepped, the next
forward waits per unit, and training is bitwise the training with the step run in one go: losses,
masters, optimizer state, working weights, state dicts, whatever the window does between steps
(clipping, accumulation, unused parameters, a non-finite gradient on one rank, zero_grad, state reads,
an evaluation forward and the optimizer's load_state_dict right after a step). Two gloo ranks; stage 3 with units that really leave
the gathered state (persistence threshold 40 elements).

On CPU a tiny model's host step is over before the next forward begins, so the tests hold the worker
before each unit until something waits for it (``scripted.hold_async_steps``): every step's units are
then published by the next forward's hooks (or a stage-3 gather), which the tests check happened."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.integration.engine.offload.scripted import (
    WINDOWS, bitwise_runs, hold_async_steps, snapshot, train, two_heads_engine)
from tests.integration.engine.offload.test_offload import TwoHeads, _loss

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


def _train(case: str, asynchronous: bool, nan_step: int = -1, action: str = "skip"):
    hold_async_steps()
    stage, options, dtype = CASES[case]
    model, engine = two_heads_engine(stage, {**options, "nonfinite_gradients": action, "offload_optimizer": True,
                                             "offload_async_step": asynchronous}, dtype)
    assert (engine.parts.async_step is not None) == asynchronous
    if stage == 3:
        assert sum(not u.persistent for u in engine.parts.units) >= 3, "stage 3 must have units that are freed"
    out, errors = train(engine, model, [WINDOWS[w] for w in SCRIPT], nan_step=nan_step)
    out.append(snapshot(engine, model))
    early = engine.parts.async_step.published_early if asynchronous else 0
    engine.close()
    return out, errors, early


@pytest.mark.parametrize("case", list(CASES))
def test_async_steps_are_bitwise_the_steps(dist_pool, case):
    for (_, errors_a, early), (_, errors_b, _) in bitwise_runs(dist_pool(2), _train, case):
        assert not errors_a and not errors_b
        # Every step but the last is followed by a forward that had to publish its units itself (with a
        # ratio only the host's units wait, which some forwards reach only after the backward's wait).
        assert early >= (len(SCRIPT) - 1) // (2 if "ratio" in case else 1), early


@pytest.mark.parametrize("case", ["s2_bf16", "s3_params_bf16"])
@pytest.mark.parametrize("action", ["skip", "error"])
def test_a_nonfinite_gradient_after_an_async_step_leaves_the_model_as_it_was(dist_pool, case, action):
    """NaN on rank 1 in the window after an asynchronous step: that step's work is finished and
    published first, then this one is skipped (or fails) on every rank, bitwise as without it."""
    for (_, errors_a, _), (_, errors_b, _) in bitwise_runs(dist_pool(2), _train, case, 1, action):
        assert len(errors_a) == len(errors_b) == (action == "error")


def test_async_step_needs_what_it_says(dist_pool):
    """Off with a warning where it cannot take effect; a step it cannot take runs synchronously, with a warning."""
    import warnings

    for options in ({}, {"offload_optimizer": True, "offload_optimizer_ratio": 0.0},
                    {"offload_optimizer": True, "offload_optimizer_ratio": "auto"}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = ZeroEngine(TwoHeads(), ZeroConfig(stage=2, offload_async_step=True, **options))
        assert any("offload_async_step=True has no effect" in str(w.message) for w in caught), options
        assert engine.parts.async_step is None
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
    assert engine.parts.async_step is not None
    stepped = engine.parts.async_step.steps == 0 and all(not torch.equal(a, u.master)
                                                         for a, u in zip(before, engine.parts.units))
    engine.close()
    return stepped


def _copied_after_an_async_step() -> bool:
    """A deep copy of the model taken right after an asynchronous step (a callback copying it, an EMA
    made then) holds the stepped weights, as plain parameters."""
    hold_async_steps()
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


def _failed_async_step() -> bool:
    """The host kernel fails on the worker: the next wait on the calling thread raises, naming what happened,
    and the parameters are plain again."""
    model, engine = two_heads_engine(2, {"offload_optimizer": True, "offload_async_step": True}, torch.float32)
    engine.backward(_loss(model, 0, 0, head=0))
    engine.step()
    engine.zero_grad()
    engine.parts.worker.wait()  # that step done, with the kernel as it is
    kernel = engine.parts.placement.kernel

    def broken(jobs, threads=None) -> None:
        raise OSError("the host kernel broke")

    kernel.kernel.run = broken  # type: ignore[method-assign]
    engine.backward(_loss(model, 1, 0, head=0))
    with pytest.raises(RuntimeError, match="asynchronous host step failed part way .* load the last checkpoint") \
            as info:
        engine.step()
        engine.parts.worker.wait()
    assert "the host kernel broke" in str(info.value.__cause__)
    plain = all(type(p) is torch.nn.Parameter for p in model.parameters())
    del kernel.kernel.run
    engine.close()
    return plain


def test_a_failed_async_step_raises_on_the_calling_thread(dist_pool):
    assert dist_pool(1).run(_failed_async_step) == [True]
