"""A write into the weights between optimizer steps (a callback's or hook's ``p.mul_`` under ``no_grad``: a
max-norm clamp, a projection, a pruning mask) is kept, as under DDP, or refused on every rank: never undone by
the next step's publish.

- fp32 working weights at full width: the write becomes the masters before anything reads them, and training
  matches DDP doing the same writes, step by step (stages 1, 2 and stage 3's persistent units; on the device,
  offloaded, on NVMe, a share offloaded, speculative and asynchronous host steps; writes after a step and
  between the backward passes of a window).
- bf16 working weights, or INT8 on the wire: the step refuses it on every rank, naming the parameter and
  ``gathered_parameters(module, writeback=True)``, also where one rank wrote alone; a write inside that block
  is kept.

Two gloo ranks, a tiny model."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zeroq import ZeroConfig, ZeroEngine, gathered_parameters
from tests.integration.engine.offload.scripted import finish_speculation

STEPS, TOL = 4, 1e-6
KERNEL = ("offload_speculative_step", "offload_async_step")  # these need the host kernel

CASES = {
    "s1": {"stage": 1},
    "s2": {"stage": 2},
    "s3_persistent": {"stage": 3},  # a tiny model: one persistent unit (its transient units refuse writes)
    "s1_offload": {"stage": 1, "offload_optimizer": True},
    "s2_offload": {"stage": 2, "offload_optimizer": True},
    "s2_offload_half": {"stage": 2, "offload_optimizer": True, "offload_optimizer_ratio": 0.5},
    "s2_nvme": {"stage": 2, "offload_optimizer": True, "offload_optimizer_device": "nvme"},
    "s2_speculative": {"stage": 2, "offload_optimizer": True, "offload_speculative_step": True},
    "s1_async": {"stage": 1, "offload_optimizer": True, "offload_async_step": True},
    "s2_async": {"stage": 2, "offload_optimizer": True, "offload_async_step": True},
    "s2_speculative_async": {"stage": 2, "offload_optimizer": True, "offload_speculative_step": True,
                             "offload_async_step": True},
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * step + 7 * micro + dist.get_rank())
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _loss(model: nn.Module, step: int, micro: int) -> torch.Tensor:
    x, y = _batch(step, micro)
    return nn.functional.mse_loss(model(x).float(), y)


@torch.no_grad()
def _write(model: nn.Module, step: int) -> None:
    """What a max-norm clamp or a projection does: every parameter scaled, in place."""
    for p in model.parameters():
        p.mul_(0.5 if step % 2 == 0 else 0.9)


def _matches_ddp_body(case: str, backwards: int) -> dict:
    options = dict(CASES[case])
    if options.get("offload_optimizer_device") == "nvme":
        options["nvme_path"] = tempfile.mkdtemp()
    if options.get("offload_speculative_step"):  # every unit offered is stepped, so the window speculates for certain
        finish_speculation()
    torch.manual_seed(0)
    model = _model()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref)
    if options["stage"] < 3:
        options["reduce_bucket_size"] = 64
    engine = ZeroEngine(model, ZeroConfig(**options))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05, eps=1e-3, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, eps=1e-3, weight_decay=0.1)
    assert all(u.persistent for u in engine.parts.units) and (len(engine.parts.units) > 1 or options["stage"] == 3)
    worst = 0.0
    for step in range(STEPS):
        for micro in range(backwards):
            last = micro == backwards - 1
            engine.backward(_loss(model, step, micro) / backwards, boundary=last)
            if last:
                (_loss(ddp, step, micro) / backwards).backward()
            else:
                with ddp.no_sync():
                    (_loss(ddp, step, micro) / backwards).backward()
            if not last:  # a write between the backward passes of one window
                _write(model, step + 1)
                _write(ref, step + 1)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):  # waits for an asynchronous step
            diff = (p.detach() - q.detach()).abs().max().item()
            assert diff <= TOL, f"step {step}: {name} differs from DDP by {diff}"
            worst = max(worst, diff)
        _write(model, step)  # what an on_train_batch_end callback does, after the step
        _write(ref, step)
    full = engine.full_state_dict()  # the masters took the writes too
    for name, q in ref.named_parameters():
        assert (full[name] - q.detach()).abs().max().item() <= TOL, name
    spec = getattr(getattr(engine.parts.placement, "host", engine.parts.placement), "spec", None)
    engine.close()
    return {"worst": worst, "kept": spec.counts.kept if spec is not None else None}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_write_between_steps_is_kept_as_under_ddp(dist_pool, request, case: str) -> None:
    if any(CASES[case].get(k) for k in KERNEL):
        request.getfixturevalue("host_kernel")
    results = dist_pool(2).run(_matches_ddp_body, case, 1)
    assert all(r["worst"] <= TOL for r in results)
    if CASES[case].get("offload_speculative_step") and not CASES[case].get("offload_async_step"):
        # the write was taken before the backward: the speculative steps read it and stood
        assert all(r["kept"] > 0 for r in results), results


@pytest.mark.parametrize("case", ["s1", "s2_offload", "s2_async"])
def test_a_write_between_backward_passes_is_kept_as_under_ddp(dist_pool, request, case: str) -> None:
    if any(CASES[case].get(k) for k in KERNEL):
        request.getfixturevalue("host_kernel")
    results = dist_pool(2).run(_matches_ddp_body, case, 2)
    assert all(r["worst"] <= TOL for r in results)


REFUSED = {
    "s2_bf16": ({"stage": 2}, torch.bfloat16),
    "s1_int8": ({"stage": 1, "quantized_weights": True, "quantized_weights_exact_numel": 0}, torch.float32),
    "s2_bf16_async": ({"stage": 2, "offload_optimizer": True, "offload_async_step": True}, torch.bfloat16),
}


def _refused_body(case: str, writers: list[int], gathered: bool) -> dict:
    options, dtype = REFUSED[case]
    torch.manual_seed(0)
    model = _model()
    engine = ZeroEngine(model, ZeroConfig(reduce_bucket_size=64, **options), param_dtype=dtype)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        engine.backward(_loss(model, 0, 0))
    engine.step()
    before = engine.full_state_dict()
    if gathered:  # the fix the error names: the write goes into the fp32 masters
        with gathered_parameters(model, writeback=True), torch.no_grad():
            model[0].weight.mul_(0.5)
    elif dist.get_rank() in writers:
        with torch.no_grad():
            model[0].weight.mul_(0.5)
    after = engine.full_state_dict()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        engine.backward(_loss(model, 1, 0))
    try:
        engine.step()
    except RuntimeError as error:
        return {"error": str(error), "masters_untouched": all(torch.equal(before[n], after[n]) for n in before)}
    return {"error": None, "halved": torch.equal(after["0.weight"], before["0.weight"] * 0.5)}


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("writers", [[0, 1], [1]], ids=["every_rank", "one_rank"])
def test_a_write_the_masters_cannot_take_is_refused_on_every_rank(dist_pool, request, case: str,
                                                                   writers: list[int]) -> None:
    if REFUSED[case][0].get("offload_async_step"):
        request.getfixturevalue("host_kernel")
    results = dist_pool(2).run(_refused_body, case, writers, False)
    for r in results:
        message = r["error"]
        assert message is not None, "the step took a write it cannot represent"
        assert "0.weight" in message and f"rank(s) {writers}" in message, message
        assert "gathered_parameters(module, writeback=True)" in message and "\n" not in message, message
        assert r["masters_untouched"]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_write_inside_gathered_parameters_is_kept(dist_pool, request, case: str) -> None:
    if REFUSED[case][0].get("offload_async_step"):
        request.getfixturevalue("host_kernel")
    for r in dist_pool(2).run(_refused_body, case, [], True):
        assert r["error"] is None and r["halved"], r
