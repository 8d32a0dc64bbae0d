"""Non-finite gradients and fp16 overflow: training stops on every rank by default with the model
untouched (offloaded or not), or skips the step everywhere; overflow skips are logged."""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.models import RichModel, make_batch, param_groups
from tests.integration.engine.test_accumulation import _device, _stage_options


OFFLOADS = {"none": {}, "cpu": {"offload_optimizer": True}, "params_cpu": {"offload_optimizer": True, "offload_parameters": True},
            "ratio": {"offload_optimizer": True, "offload_optimizer_ratio": 0.5},
            "auto": {"offload_optimizer": True, "offload_optimizer_ratio": "auto", "offload_memory_budget": "50%"},
            "cpu_spec": {"offload_optimizer": True, "offload_speculative_step": True},
            "params_cpu_spec": {"offload_optimizer": True, "offload_parameters": True, "offload_speculative_step": True}}


def _nonfinite_body(action: str, stage: int, device: str = "cpu", offload: str = "none",
                    boundary: Optional[bool] = None) -> dict:
    torch.manual_seed(0)
    dev = _device(device)
    model = RichModel().to(dev)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, nonfinite_gradients=action, **_stage_options(stage),
                                          **OFFLOADS[offload]))
    if offload == "auto":  # a stand-in device that holds about half the units (see test_engine_parity)
        engine.parts.placement.measure = lambda: (0, 0, 16000)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    rank = dist.get_rank()
    batch = lambda step: tuple(t.to(dev) if torch.is_tensor(t) else t for t in make_batch(step, 0, rank, uniform=True))  # noqa: E731
    engine.backward(model.loss(batch(0)), boundary=boundary)
    assert engine.step()
    if offload == "auto":
        assert 0 < len(engine.parts.placement.host_units) < len(engine.parts.units)
    before = engine.full_state_dict()
    state_before = [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()]
    loss = model.loss(batch(1))
    engine.backward(loss * float("nan") if rank == 1 else loss, boundary=boundary)  # only rank 1 goes wrong
    out: dict = {}
    try:
        out["stepped"] = engine.step()
    except RuntimeError as err:
        out["error"] = str(err)
    after = engine.full_state_dict()
    state_after = list(engine.optimizer.state.values())
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before) and len(state_before) == len(state_after) \
        and all(torch.equal(a[k], b[k]) for a, b in zip(state_before, state_after) for k in a)
    out["skipped"] = engine.skipped_steps
    engine.backward(model.loss(batch(2)), boundary=boundary)  # training goes on with finite ones
    out["next_stepped"] = engine.step() if "error" not in out else None
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_nonfinite_gradients_stop_training_on_every_rank_by_default(dist_pool, stage):
    results = dist_pool(2).run(_nonfinite_body, "error", stage)
    for r in results:
        assert "non-finite gradients" in r["error"] and "step 2" in r["error"] and "rank(s) [1]" in r["error"], r
        assert "nonfinite_gradients='skip'" in r["error"] and r["unchanged"]


@pytest.mark.parametrize("stage, offload", [(2, "cpu"), (3, "params_cpu"), (2, "ratio"), (2, "auto"), (3, "auto"),
                                            (2, "cpu_spec"), (3, "params_cpu_spec")])
@pytest.mark.parametrize("boundary", [None, True], ids=["copies_at_finalize", "copies_during_backward"])
def test_nonfinite_gradients_leave_offloaded_models_untouched_on_every_rank(dist_pool, stage, offload, boundary):
    # Optimizer offload (host step unit by unit), partial and auto offload: a NaN on rank 1 in step 2
    # stops the step on both ranks before any unit is stepped; values and optimizer state are as before.
    # boundary=True: the gradients leave for the host during the backward, before the agreement.
    results = dist_pool(2).run(_nonfinite_body, "error", stage, "cpu", offload, boundary)
    assert all("non-finite gradients" in r["error"] and r["unchanged"] for r in results), results


def test_nonfinite_gradients_can_skip_the_step_everywhere(dist_pool):
    results = dist_pool(2).run(_nonfinite_body, "skip", 2)
    assert all(r == {"stepped": False, "unchanged": True, "skipped": 1, "next_stepped": True} for r in results), results


def _overflow_log_body() -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("lightning_zeroq")
    handler = Keep()
    logger.addHandler(handler)
    try:
        model = RichModel()
        engine = ZeroEngine(model, ZeroConfig(stage=2), param_dtype=torch.float16, loss_scaling=True)
        engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.loss(make_batch(0, 0, dist.get_rank()))
        engine.backward(loss * float("inf"))
        assert engine.step() is False and engine.skipped_steps == 1
    finally:
        logger.removeHandler(handler)
    return records


def test_fp16_overflow_skips_are_logged_with_the_step_and_the_new_scale(dist_pool):
    records = dist_pool(2).run(_overflow_log_body)
    assert any("fp16 overflow in step 1" in m and "loss scale 65536 -> 32768" in m for m in records[0]), records[0]
    assert records[1] == []  # said once, by rank 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_names_itself_for_nonfinite_gradients(stage):
    # One rank skips the per-unit origin check (any non-finite shard came from it): the error still names
    # rank 0 and the parameters, and the model is untouched.
    torch.manual_seed(0)
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(stage=stage, **_stage_options(stage)))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    before = engine.full_state_dict()
    engine.backward(model.loss(make_batch(0, 0, 0, uniform=True)) * float("nan"))
    with pytest.raises(RuntimeError, match=r"non-finite gradients .* on rank\(s\) \[0\], in the gradients of"):
        engine.step()
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
