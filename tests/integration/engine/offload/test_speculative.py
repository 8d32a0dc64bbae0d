"""Speculative host steps (offload_speculative_step): units step on the host during the backward and
are kept or undone at the step, so training is bitwise the training without speculation, whatever
the window does: clipping in effect or not, accumulation, a parameter no rank used, a non-finite
gradient on one rank, zero_grad or a state read between the backward and the step. Two gloo ranks.

The worker races the backward; so that every case speculates for certain, the tests let every undo wait
until each unit offered has been stepped (``scripted.finish_speculation``)."""

from __future__ import annotations

import pytest
import torch

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.integration.engine.offload.scripted import (
    WINDOWS, bitwise_runs, finish_speculation, same, snapshot, train, two_heads_engine)
from tests.integration.engine.offload.test_offload import TwoHeads, _loss


pytestmark = pytest.mark.usefixtures("host_kernel")  # tests/conftest.py: skips where it cannot match torch


CASES = {
    "s2_bf16": (2, {"offload_optimizer": True}, torch.bfloat16),
    "s2_fp32": (2, {"offload_optimizer": True}, torch.float32),
    "s3_params_bf16": (3, {"offload_optimizer": True, "offload_parameters": True}, torch.bfloat16),
    "s3_opt_bf16": (3, {"offload_optimizer": True}, torch.bfloat16),
    "s2_ratio_bf16": (2, {"offload_optimizer": True, "offload_optimizer_ratio": 0.5}, torch.bfloat16),
}
# What each step does between its backward passes and its step. The first makes the optimizer's state
# (never speculated); clipping in effect comes last, since the windows after it do not speculate.
SCRIPT = ["plain", "plain", "clip_idle", "accumulate", "read_before_step", "zero_grad_then_plain", "other_head",
          "clip_in_effect", "plain"]


def _train(case: str, speculative: bool, nan_step: int = -1, action: str = "skip"):
    finish_speculation()
    stage, options, dtype = CASES[case]
    model, engine = two_heads_engine(stage, {**options, "nonfinite_gradients": action,
                                             "offload_speculative_step": speculative}, dtype)
    placement = getattr(engine.parts.placement, "host", engine.parts.placement)
    assert (placement.spec is not None) == speculative
    out, errors = train(engine, model, [WINDOWS[w] for w in SCRIPT], nan_step=nan_step,
                        after_step=lambda: snapshot(engine, model))
    counts = placement.spec.counts if placement.spec is not None else None
    engine.close()
    return out, errors, counts


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_steps_are_bitwise_the_steps(dist_pool, case):
    for (_, errors_a, counts), (_, errors_b, _) in bitwise_runs(dist_pool(2), _train, case):
        assert not errors_a and not errors_b
        # speculated from the second step on: kept in plain steps, with clipping idle and with
        # accumulation; undone by a state read, zero_grad, unused parameters and clipping in effect
        # (which pauses the windows after it)
        assert counts.windows >= 6 and counts.kept > 0 and counts.undone > 0, counts
        # every unit the worker finished was offered to it, and its time was measured
        assert counts.offered >= counts.kept + counts.undone + counts.unstarted and counts.stepping_s > 0, counts


@pytest.mark.parametrize("case", ["s2_bf16", "s3_params_bf16", "s2_ratio_bf16"])
@pytest.mark.parametrize("action", ["skip", "error"])
def test_a_nonfinite_gradient_undoes_every_speculative_step_on_every_rank(dist_pool, case, action):
    """NaN on rank 1 in the first step that speculates: every rank restores what it stepped during the
    backward; the step is skipped (or fails) everywhere, and training goes on bitwise as without
    speculation."""
    for (out, errors_a, counts), (_, errors_b, _) in bitwise_runs(dist_pool(2), _train, case, 1, action):
        assert len(errors_a) == len(errors_b) == (action == "error")
        assert counts.undone > 0, counts
        before, after = out[0], out[1]  # steps 0 and 1: (step, losses, (masters, state, full state, working))
        assert same(before[2][2], after[2][2]), "the non-finite step left the model as it was"


def test_speculation_needs_what_it_says(dist_pool):
    """It is off (with a warning) where it cannot take effect: no CPU optimizer offload, fp16 loss scaling,
    unmanaged accumulation."""
    import warnings

    for options, loss_scaling, text in (({}, False, "without CPU optimizer offload"),
                                        ({"offload_optimizer": True}, True, "fp16 loss scaling"),
                                        ({"offload_optimizer": True, "managed_gradient_accumulation": False}, False,
                                         "managed_gradient_accumulation=False")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = ZeroEngine(TwoHeads(), ZeroConfig(stage=2, offload_speculative_step=True, **options),
                                loss_scaling=loss_scaling)
        assert any(text in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert getattr(getattr(engine.parts.placement, "host", engine.parts.placement), "spec", None) is None
        engine.close()
    with pytest.raises(ValueError, match="offload_speculative_step"):
        ZeroConfig(offload_speculative_step="yes")
    model = TwoHeads()  # an optimizer the host kernel does not step: a warning, and no speculation
    engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True, offload_speculative_step=True))
    with pytest.warns(UserWarning, match="offload_speculative_step=True has no effect: .* the optimizer is neither"):
        engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.parts.placement.spec is None
    engine.close()


def _train_behind(speculative: bool, asynchronous: bool = False):
    """Three plain steps where the worker sees no gradient land before the step begins, as when a GPU
    runs the backward after the CPU has queued it and moved on to the step. With ``asynchronous``, the
    first unit's gradient lands only once the step has taken over the units not started."""
    import threading

    torch.manual_seed(0)
    model = TwoHeads().to(torch.bfloat16)
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=700, offload_optimizer=True,
                                          offload_speculative_step=speculative, offload_async_step=asynchronous),
                        param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    placement = getattr(engine.parts.placement, "host", engine.parts.placement)
    landed = threading.Event()
    if speculative:
        spec = placement.spec
        grad_of, hand_over = spec._grad_of, spec.hand_over

        def held(unit):
            landed.wait()
            return grad_of(unit)

        def handed():
            hand_over()
            landed.set()

        spec._grad_of, spec.hand_over = held, handed
    offered_first = 0
    for step in range(3):
        landed.clear()
        engine.backward(_loss(model, step, 0, head=0).float(), boundary=True)
        if not asynchronous:
            landed.set()  # the step begins: the gradients land now
        engine.step()
        engine.zero_grad()
        if step == 0 and speculative:
            offered_first = placement.spec.counts.offered  # the first step makes the state: not speculated
    engine.parts.worker.wait()  # an asynchronous step's end
    counts = placement.spec.counts if speculative else None
    masters = [u.master.detach().clone() for u in engine.parts.units]
    state = [{k: t.detach().clone() for k, t in s.items()} for s in engine.optimizer.state.values()]
    engine.close()
    return masters, counts, offered_first, state


def test_a_device_behind_the_cpu_still_steps_every_unit_offered(dist_pool):
    """The backward's end on the CPU is not the device's: the step waits for each unit offered during
    the backward (kept) instead of dropping those the worker had not begun."""
    ours = dist_pool(2).run(_train_behind, True)
    theirs = dist_pool(2).run(_train_behind, False)
    for (a, counts, first, _), (b, _, _, _) in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        # After the first step (which makes the state), each step offers 3 units: the worker is held on the
        # first until the step begins, and those behind it are kept, not dropped. Without mapped read-back
        # (CPU) the unit the last backward reduced last goes at the step: in the second step the trunk's
        # first unit (the reverse order of the first backward: 2 kept); in the third the head no rank
        # used, reduced last since the first step agreed on the order the units complete in (3 kept).
        assert first == 3 and counts.offered == 9, counts
        assert counts.kept == 2 + 3 and counts.undone == 0 and counts.unstarted == 0, counts


def test_an_asynchronous_step_takes_over_the_units_speculation_has_not_started(dist_pool):
    """With ``offload_async_step`` the step steps the units speculation has not begun itself, in forward
    order, instead of waiting for the speculation worker to reach them in its order; bitwise the same."""
    ours = dist_pool(2).run(_train_behind, True, True)
    theirs = dist_pool(2).run(_train_behind, False, True)
    for (a, counts, first, state), (b, _, _, state_b) in zip(ours, theirs):
        # Bitwise the step without speculation: masters and optimizer state (moments and step counts).
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert len(state) == len(state_b) and all(
            s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s) for s, t in zip(state, state_b))
        # Every unit stepped exactly once per step, whoever stepped it (the worker or the step); the other head,
        # which no rank uses, never.
        steps = [float(s["step"]) for s in state if "step" in s]
        assert steps and all(step == 3 for step in steps), steps
        # Each step offers 3 units (the backward's doing, not the worker's). How many the worker began before
        # the step took over the rest depends on thread timing; that the worker is held on the first it takes
        # until then does not: at most one per speculated step (the second and third) is the worker's.
        assert first == 3 and counts.offered == 9, counts
        assert counts.kept + counts.undone <= 2 and counts.unstarted >= 4, counts


def _failed_speculation() -> bool:
    """A speculative step fails on the worker (after the backward, so the step is the wait that finds it): the
    step raises, naming what happened, with the model as before it; the next window trains as usual."""
    import threading

    model, engine = two_heads_engine(2, {"offload_optimizer": True, "offload_speculative_step": True}, torch.bfloat16)
    train(engine, model, [WINDOWS["plain"]])  # the optimizer's state made
    spec = engine.parts.placement.spec
    grad_of, backward_done = spec._grad_of, threading.Event()

    def broken(unit):
        backward_done.wait()
        raise OSError("the gradient never landed")

    spec._grad_of = broken
    before = engine.full_state_dict()
    engine.backward(_loss(model, 1, 0, head=0).float(), boundary=True)
    backward_done.set()
    with pytest.raises(RuntimeError, match="a speculative host step failed; the model is as before it") as info:
        engine.step()
    assert "the gradient never landed" in str(info.value.__cause__)
    engine.zero_grad()
    untouched = same(engine.full_state_dict(), before)
    spec._grad_of = grad_of
    _, errors = train(engine, model, [WINDOWS["plain"]])
    engine.close()
    return untouched and not errors


def test_a_failed_speculative_step_raises_on_the_calling_thread(dist_pool):
    assert dist_pool(1).run(_failed_speculation) == [True]


def _train_offered_twice(case: str, speculative: bool):
    """``_train`` with every unit offered twice in each backward that speculates (as a unit whose gradient grew
    after its first offer would be): the second speculative step of a unit replaces the first."""
    from lightning_zeroq.zero.offload.speculative_step import Speculation

    offer = Speculation.offer

    def twice(self, unit) -> None:
        offer(self, unit)
        offer(self, unit)

    Speculation.offer = twice  # type: ignore[method-assign]
    try:
        return _train(case, speculative)
    finally:
        Speculation.offer = offer  # type: ignore[method-assign]


@pytest.mark.parametrize("case", ["s2_bf16", "s3_params_bf16"])
def test_a_unit_speculated_twice_steps_once(dist_pool, case):
    """The second speculative step of a unit drops the first (its step count too): what is kept is one step."""
    for (_, errors_a, counts), (_, errors_b, _) in bitwise_runs(dist_pool(2), _train_offered_twice, case):
        assert not errors_a and not errors_b
        assert counts.kept > 0, counts
