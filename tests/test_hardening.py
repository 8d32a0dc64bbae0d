"""Silent wrong answers found when the product was tried as a careful user would, each with the test
that would have caught it: late gradients (reentrant checkpointing), ``zero_grad`` between
backward passes, stage-1 accumulation precision, one optimizer step per step with offload, non-finite
gradients, ``training_step`` returning ``None``."""

from __future__ import annotations

import copy
import logging
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zeroq import ZeroConfig, ZeroEngine, register_elementwise_optimizer
from tests.models import DIM, SEQ, VOCAB, RichModel, make_batch, param_groups

TRANSIENT = {"stage3_wrap_classes": ["Sequential"], "stage3_param_persistence_threshold": 0}


def _stage_options(stage: int) -> dict:
    return TRANSIENT if stage == 3 else {"reduce_bucket_size": 300}


class Reentrant(nn.Module):
    """A block applied twice under reentrant checkpointing, and a parameter used inside and outside
    the checkpointed region: hooks fire more than once per backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def _segment(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h) * self.scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = checkpoint(self._segment, h, use_reentrant=True)
        h = checkpoint(self._segment, h, use_reentrant=True)
        return self.head(h * self.scale)


def _tokens(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + dist.get_rank())
    return torch.randint(0, VOCAB, (4, SEQ), generator=g)


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))


def _averaged_step(ref: nn.Module, ref_opt: torch.optim.Optimizer) -> None:
    """The data-parallel reference: average the replica's gradients over the ranks, then step (a
    parameter no rank used keeps ``grad=None``, as with DDP)."""
    params = [p for p in ref.parameters() if p.requires_grad]
    used = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(used)
    for p, anyone in zip(params, used.tolist()):
        if anyone:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            p.grad = grad / dist.get_world_size()
    ref_opt.step()
    ref_opt.zero_grad()


def _assert_matches(engine: ZeroEngine, ref: nn.Module, what: str, tol: float = 1e-5) -> float:
    full = engine.full_state_dict()
    worst = 0.0
    for name, p in ref.named_parameters():
        diff = (full[name] - p.detach().cpu()).abs().max().item()
        assert diff < tol, f"{what}: {name} differs from the reference by {diff}"
        worst = max(worst, diff)
    return worst


def _device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _reentrant_body(stage: int, managed: bool, device: str = "cpu") -> float:
    torch.manual_seed(0)
    dev = _device(device)
    model = Reentrant().to(dev)
    ref = copy.deepcopy(model)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, managed_gradient_accumulation=managed, **_stage_options(stage)))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    worst = 0.0
    for step, n in enumerate([1, 3, 2]):
        for micro in range(n):
            tokens = _tokens(step, micro).to(dev)
            engine.backward(_lm_loss(model, tokens) / n, boundary=micro == n - 1)
            (_lm_loss(ref, tokens) / n).backward()
        engine.step()
        _averaged_step(ref, ref_opt)
        worst = max(worst, _assert_matches(engine, ref, f"stage {stage} step {step}"))
    return worst


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_arriving_after_their_unit_was_reduced_are_not_lost(dist_pool, world_size, stage):
    # Before: stage 2 and 3 dropped the second firing's gradients (parameters off by 1e-2 to 1e-1) and
    # stage 3 crashed in the recomputation ("setStorage ... out of bounds").
    dist_pool(world_size).run(_reentrant_body, stage, True)


def test_late_gradients_in_unmanaged_mode(dist_pool):
    dist_pool(2).run(_reentrant_body, 2, False)


def _zero_grad_body(stage: int) -> None:
    torch.manual_seed(0)
    model = RichModel()
    ref = copy.deepcopy(model)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, **_stage_options(stage)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach_optimizer(optimizer)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(3):
        dropped = make_batch(step, 0, rank, uniform=stage == 3)
        kept = make_batch(step, 1, rank, uniform=stage == 3)
        engine.backward(model.loss(dropped) * 100.0)
        optimizer.zero_grad()  # the user's optimizer, as manual optimization calls it
        engine.backward(model.loss(kept))
        engine.step()
        ref.loss(kept).backward()
        _averaged_step(ref, ref_opt)
        _assert_matches(engine, ref, f"stage {stage} step {step}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_users_zero_grad_drops_the_engines_gradients(dist_pool, stage):
    # Before: backward, zero_grad(), backward, step gave an update 101x DDP's in stages 1 and 2.
    dist_pool(2).run(_zero_grad_body, stage)


def _stage1_precision_body(micro_batches: int) -> float:
    """Relative error of the reduced bf16-mixed gradient over many micro-batches, against the exact
    (float64) mean of the very same per-micro-batch bf16 gradients."""
    torch.manual_seed(0)
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(stage=1, managed_gradient_accumulation=False, reduce_bucket_size=10**6),
                        param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    unit = engine.units[0]
    exact = [torch.zeros(p.numel(), dtype=torch.float64) for p in unit.params]
    rank = dist.get_rank()
    for micro in range(micro_batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as precision="bf16-mixed" runs the forward
            loss = model.loss(make_batch(0, micro, rank)) / micro_batches
        # autograd.grad leaves .grad alone (no hook fires), so this is the same bf16 gradient the
        # engine's backward then accumulates.
        grads = torch.autograd.grad(loss, unit.params, retain_graph=True, allow_unused=True)
        for total, g in zip(exact, grads):
            if g is not None:
                total += g.double().reshape(-1)
        engine.backward(loss)
    engine.finalize_gradients()
    for total in exact:  # every rank, every parameter, same order
        dist.all_reduce(total)
    worst = 0.0
    for seg in unit.segments:
        reference = exact[seg.param][seg.param_span] / dist.get_world_size()
        got = unit.grad[seg.shard_span].double()
        scale = reference.abs().max().item()
        if scale > 0:
            worst = max(worst, ((got - reference).abs().max() / scale).item())
    return worst


def test_stage1_accumulates_low_precision_gradients_in_fp32(dist_pool):
    # Before: stage 1 summed 64 bf16 micro-batch gradients in bf16 p.grad (relative error 8.3e-3).
    # Now: an fp32 sum per unit, reduced in fp32 once per window; what remains is fp32 rounding.
    worst = max(dist_pool(2).run(_stage1_precision_body, 64))
    assert worst < 1e-5, worst


@register_elementwise_optimizer
class CountingSGD(torch.optim.Optimizer):
    """Elementwise, with a per-group step counter that scales the update (like bias correction)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "step": 0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] += 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / group["step"])


def _one_step_body(offload: str, device: str = "cpu") -> tuple[int, int]:
    torch.manual_seed(0)
    dev = _device(device)
    model = RichModel().to(dev)
    ref = copy.deepcopy(model)
    options = {"offload_optimizer": True} if offload == "cpu" else {}
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=200, **options))
    optimizer = CountingSGD(model.parameters())
    calls = {"pre": 0, "post": 0}
    optimizer.register_step_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
    optimizer.register_step_post_hook(lambda *a: calls.__setitem__("post", calls["post"] + 1))
    engine.attach_optimizer(optimizer)
    ref_opt = CountingSGD(ref.parameters())
    for step in range(3):
        batch = tuple(t.to(dev) if torch.is_tensor(t) else t for t in make_batch(step, 0, dist.get_rank()))
        engine.backward(model.loss(batch))
        engine.step()
        ref.loss(batch).backward()
        _averaged_step(ref, ref_opt)
        _assert_matches(engine, ref, f"offload={offload} step {step}")
    assert optimizer.param_groups[0]["step"] == 3
    return calls["pre"], calls["post"]


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_the_optimizer_sees_one_step_per_step_whatever_the_placement(dist_pool, offload):
    # Before: with offload the optimizer stepped once per unit (8 units here): its hooks fired 8 times
    # a step and a per-group counter advanced 8 times (bias correction 2.7e-2 off).
    counts = dist_pool(2).run(_one_step_body, offload)
    assert all(c == (3, 3) for c in counts), counts


OFFLOADS = {"none": {}, "cpu": {"offload_optimizer": True}, "params_cpu": {"offload_optimizer": True, "offload_parameters": True},
            "ratio": {"offload_optimizer": True, "offload_optimizer_ratio": 0.5},
            "auto": {"offload_optimizer": True, "offload_optimizer_ratio": "auto", "offload_memory_budget": "50%"}}


def _nonfinite_body(action: str, stage: int, device: str = "cpu", offload: str = "none",
                    boundary: Optional[bool] = None) -> dict:
    torch.manual_seed(0)
    dev = _device(device)
    model = RichModel().to(dev)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, nonfinite_gradients=action, **_stage_options(stage),
                                          **OFFLOADS[offload]))
    if offload == "auto":  # a stand-in device that holds about half the units (see test_engine_parity)
        engine.placement.measure = lambda: (0, 0, 16000)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    rank = dist.get_rank()
    batch = lambda step: tuple(t.to(dev) if torch.is_tensor(t) else t for t in make_batch(step, 0, rank, uniform=True))  # noqa: E731
    engine.backward(model.loss(batch(0)), boundary=boundary)
    assert engine.step()
    if offload == "auto":
        assert 0 < len(engine.placement.host_units) < len(engine.units)
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


@pytest.mark.parametrize("stage, offload", [(2, "cpu"), (3, "params_cpu"), (2, "ratio"), (2, "auto"), (3, "auto")])
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


# --------------------------------------------------------------------------- faults: every rank agrees


def _one_bad_path_body(tmp: str) -> str:
    import os

    rank = dist.get_rank()
    path = tmp if rank == 0 else os.path.join(tmp, "missing", "dir")  # only rank 1's path is wrong
    model = RichModel()
    try:
        ZeroEngine(model, ZeroConfig(stage=3, offload_parameters=True, offload_params_device="nvme", nvme_path=path,
                                     **TRANSIENT))
    except (RuntimeError, ValueError) as err:
        return str(err)
    return "no error"


def test_a_failure_on_one_rank_before_a_collective_ends_every_rank(dist_pool, tmp_path):
    # Before: rank 1 raised and rank 0 walked into the first broadcast and waited for the collective
    # timeout (30 minutes by default).
    import time

    start = time.monotonic()
    messages = dist_pool(2).run(_one_bad_path_body, str(tmp_path))
    assert time.monotonic() - start < 30
    assert "missing" in messages[1]  # rank 1: its own error, naming its path
    assert "rank(s) [1] failed while building the ZeRO engine" in messages[0] and "missing" in messages[0]


def _one_full_disk_body(tmp: str) -> str:
    from lightning_zeroq.swap import swapper

    original = swapper.free_bytes
    if dist.get_rank() == 1:
        swapper.free_bytes = lambda path: 1024  # rank 1's disk is "full"
    try:
        model = RichModel()
        engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True, offload_optimizer_device="nvme",
                                              nvme_path=tmp))
        engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    except RuntimeError as err:
        return str(err)
    finally:
        swapper.free_bytes = original
    return "no error"


def test_a_full_disk_on_one_rank_stops_every_rank_at_attach(dist_pool, tmp_path):
    messages = dist_pool(2).run(_one_full_disk_body, str(tmp_path))
    assert "rank(s) [1] failed while attaching the optimizer" in messages[0], messages
    assert "free" in messages[1].lower() or "space" in messages[1].lower(), messages[1]


def _timeout_body() -> str:
    """A collective that fails (here: a rank that never joins) must raise, not switch the engine to a
    fallback path for the rest of the run."""
    from datetime import timedelta

    from lightning_zeroq.zero import comm

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    out = torch.empty(4)
    if dist.get_rank() == 0:
        try:
            comm.reduce_scatter(out[:2], torch.ones(4), group)  # rank 1 never comes
        except RuntimeError as err:
            message = str(err)
        else:
            message = "no error"
    else:
        message = "skipped"
    dist.barrier()
    comm.reduce_scatter(out[:2], torch.ones(4), group=None)  # the flat collective is still used afterwards
    return message


def test_a_failing_collective_raises_instead_of_switching_paths(dist_pool):
    # Before: comm.reduce_scatter caught any gloo RuntimeError (a timeout, say) and silently switched
    # every later reduce-scatter to the all-reduce fallback.
    from lightning_zeroq.zero.comm import has_flat_collectives

    assert has_flat_collectives("nccl", (2, 4)) and has_flat_collectives("gloo", (2, 13))
    assert not has_flat_collectives("gloo", (2, 7))
    messages = dist_pool(2).run(_timeout_body)
    assert messages[1] == "skipped" and messages[0] != "no error", messages
