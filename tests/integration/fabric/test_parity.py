"""``Fabric(strategy="zeroq...")`` against ``Fabric(strategy="ddp")`` on gloo, step by step.

Both run in the same worker processes of the pool, in lockstep on the same micro-batches: each step
is 2, 5, 3 or 1 backward passes (managed: every one but the last inside ``no_backward_sync``;
unmanaged: plain backward passes, then the step), clipping by the global norm, AdamW (``eps=1e-3``,
see tests/integration/engine/test_parity.py for why) over two param groups. The model (tests/models.py) has a
tied embedding/head, a frozen layer, a block used twice, a layer used only on some steps, one never
used, a buffer and a LayerNorm. After every step the full fp32 parameters must match DDP's to 1e-5.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from tests.models import DIM, VOCAB, RichModel, make_batch, param_groups
from tests.integration.engine.test_parity import STAGE3

BACKWARDS_PER_STEP = [2, 5, 3, 1]


def _arm_options(arm: str, stage: int) -> dict:
    if arm in ("offload", "async"):  # fp32 masters and AdamW state on the host (stage 3: the parameters too)
        return {"offload_optimizer": True, "offload_parameters": stage == 3, "offload_async_step": arm == "async"}
    if arm == "int8":  # the INT8 wire; every tensor of this tiny model travels on its exact side channel
        return {"quantized_weights": True}
    return {}


def _launched(strategy, **kwargs):
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, **kwargs)
    fabric.launch()  # processes exist already (the pool); this joins the existing process group
    return fabric


def _loss(model, batch) -> torch.Tensor:
    """Through the model's forward (Fabric's wrapper: precision, DDP's hooks), not a side method."""
    tokens, targets, use_sometimes = batch
    logits = model(tokens, use_sometimes)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def _train_in_lockstep(zq, model, opt, ddp, ref_model, ref_opt, *, stage: int, managed: bool) -> float:
    rank, worst = dist.get_rank(), 0.0
    for step, n in enumerate(BACKWARDS_PER_STEP):
        for micro in range(n):
            batch = make_batch(step, micro, rank, uniform=stage == 3)
            last = micro == n - 1
            window = zq.no_backward_sync(model, enabled=not last) if managed else contextlib.nullcontext()
            with window:
                zq.backward(_loss(model, batch) / n)
            with ddp.no_backward_sync(ref_model, enabled=not last):
                ddp.backward(_loss(ref_model, batch) / n)
        norm = zq.clip_gradients(model, opt, max_norm=0.5)
        ref_norm = ddp.clip_gradients(ref_model, ref_opt, max_norm=0.5)
        assert abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm), (step, float(norm), float(ref_norm))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        full = zq.strategy.full_state_dict()
        ref = dict(ref_model.module.named_parameters(remove_duplicate=False))
        assert full.keys() == ref.keys()
        for name, p in ref.items():
            diff = (full[name] - p.detach().cpu()).abs().max().item()
            assert diff <= 1e-5, f"step {step}: {name} differs from DDP by {diff}"
            worst = max(worst, diff)
    assert torch.equal(full["never.weight"], ref["never.weight"].detach().cpu())  # never used: untouched
    assert torch.equal(full["frozen.weight"], ref["frozen.weight"].detach().cpu())
    with torch.no_grad():  # evaluation without gradients (stage 3: gathers and frees with no backward)
        for step in range(2):
            batch = make_batch(100 + step, 0, rank, uniform=True)
            got, expected = float(_loss(model, batch)), float(_loss(ref_model, batch))
            assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)
    return worst


def _parity_body(stage: int, managed: bool, arm: str = "plain", separate_setup: bool = False) -> float:
    from lightning_zeroq import ZeroQFabricStrategy

    options = {**(STAGE3 if stage == 3 else {}), **_arm_options(arm, stage)}
    zq = _launched(ZeroQFabricStrategy(stage=stage, reduce_bucket_size=300, managed_gradient_accumulation=managed,
                                       **options))
    ddp = _launched("ddp_find_unused_parameters_true")
    torch.manual_seed(1234 + dist.get_rank())  # different init per rank: both start from rank 0's values
    model = RichModel()
    ref = copy.deepcopy(model)
    if separate_setup:  # LitGPT's order: the model first, then an optimizer over its (sharded) parameters
        model = zq.setup_module(model)
        opt = zq.setup_optimizers(torch.optim.AdamW(param_groups(model.module), eps=1e-3))
    else:
        model, opt = zq.setup(model, torch.optim.AdamW(param_groups(model), eps=1e-3))
    ref_model, ref_opt = ddp.setup(ref, torch.optim.AdamW(param_groups(ref), eps=1e-3))
    engine = zq.strategy.engine
    if stage == 3:  # gather/free really happens: block (used twice), sometimes, never
        assert sum(not u.persistent for u in engine.parts.units) == 3
    if arm == "offload":
        assert all(u.master.device.type == "cpu" and engine.parts.placement.step_grad(u) is not u.grad for u in engine.parts.units)
    worst = _train_in_lockstep(zq, model, opt, ddp, ref_model, ref_opt, stage=stage, managed=managed)
    if arm == "async":  # every step was asynchronous (param groups of their own hyperparameters included)
        assert engine.parts.async_step.steps == len(BACKWARDS_PER_STEP)
    return worst


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_fabric_matches_ddp(dist_pool, world_size, stage, managed):
    # 2 ranks: fabric.setup(model, optimizer); 3 ranks: setup_module, then setup_optimizers (LitGPT's order)
    worst = dist_pool(world_size).run(_parity_body, stage, managed, "plain", world_size == 3)
    assert max(worst) <= 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("arm, world_size, managed", [("offload", 2, True), ("int8", 3, False), ("async", 2, False)],
                         ids=["offload-2ranks-managed", "int8-3ranks-unmanaged", "async-2ranks-unmanaged"])
def test_fabric_offload_and_int8_match_ddp(dist_pool, request, stage, arm, world_size, managed):
    if arm == "async":
        request.getfixturevalue("host_kernel")  # tests/conftest.py: skips where the kernel cannot match torch
    worst = dist_pool(world_size).run(_parity_body, stage, managed, arm)
    assert max(worst) <= 1e-5


def _quantized_body(stage: int) -> None:
    """With INT8 quantization really on, DDP is no reference; Fabric must train exactly as the engine
    driven by hand does (tests/integration/engine/test_quantized.py checks the engine against the INT8 reference)."""
    from lightning_zeroq import ZeroConfig, ZeroEngine, ZeroQFabricStrategy

    rank = dist.get_rank()
    config = ZeroConfig(stage=stage, reduce_bucket_size=500, quantized_weights=True, quantized_weights_exact_numel=64,
                        allgather_bucket_size=512, **(STAGE3 if stage == 3 else {}))
    zq = _launched(ZeroQFabricStrategy(config))
    torch.manual_seed(0)
    model = RichModel()
    by_hand = copy.deepcopy(model)
    model, opt = zq.setup(model, torch.optim.AdamW(param_groups(model)))
    engine = ZeroEngine(by_hand, config)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(by_hand)))
    for step, n in enumerate(BACKWARDS_PER_STEP):
        for micro in range(n):
            batch = make_batch(step, micro, rank, uniform=stage == 3)
            with zq.no_backward_sync(model, enabled=micro < n - 1):
                zq.backward(_loss(model, batch) / n)
            engine.backward(_loss(by_hand, batch) / n, boundary=micro == n - 1)
        zq.clip_gradients(model, opt, max_norm=0.5)
        engine.clip_grad_norm_(0.5)
        opt.step()
        engine.step()
        a, b = zq.strategy.full_state_dict(), engine.full_state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b), step


@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_int8_quantized_trains_as_the_engine(dist_pool, stage):
    dist_pool(2).run(_quantized_body, stage)


class MetaReadyModel(RichModel):
    """``RichModel`` plus a ``reset_parameters`` for its own buffer, so it can be built on meta."""

    def reset_parameters(self) -> None:
        self.gain.copy_(torch.linspace(0.5, 1.5, DIM))


def _init_module_body() -> float:
    from lightning_zeroq import ZeroQFabricStrategy

    zq = _launched(ZeroQFabricStrategy(stage=3, reduce_bucket_size=300, **STAGE3))
    with zq.init_module(empty_init=False):  # stage 3 without empty_init: really initialized, on the host
        host = RichModel()
    assert all(p.device.type == "cpu" for p in host.parameters())
    torch.manual_seed(7 + dist.get_rank())
    with zq.init_module(empty_init=True):
        model = MetaReadyModel()
    assert all(p.is_meta for p in model.parameters())  # parameters only: buffers and other state are real
    assert not any(b.is_meta for b in model.buffers())
    opt = torch.optim.AdamW(param_groups(model), eps=1e-3)  # over the meta parameters
    model, opt = zq.setup(model, opt)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.module.head.weight is model.module.embed.weight  # still tied after materializing
    engine = zq.strategy.engine
    optimized = {id(view) for views in engine._binding(engine.optimizer).optimized.values() for view, _ in views}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == optimized  # rebound to the masters
    ddp = _launched("ddp_find_unused_parameters_true")
    ref = RichModel()
    start = zq.strategy.full_state_dict()  # what reset_parameters() gave rank 0, on every rank
    ref.load_state_dict({**start, "gain": model.module.gain.detach().cpu()})
    ref_model, ref_opt = ddp.setup(ref, torch.optim.AdamW(param_groups(ref), eps=1e-3))
    return _train_in_lockstep(zq, model, opt, ddp, ref_model, ref_opt, stage=3, managed=True)


def test_init_module_stage3_meta_then_matches_ddp(dist_pool):
    assert max(dist_pool(2).run(_init_module_body)) <= 1e-5


def _precision_body(precision: str) -> tuple[list[float], list[float]]:
    from lightning_zeroq import ZeroQFabricPrecision, ZeroQFabricStrategy

    def run(precision: str) -> list[float]:
        kwargs: dict = {"precision": precision}
        if precision == "16-mixed":  # on CPU Fabric turns precision="16-mixed" into bf16; a plugin keeps fp16
            kwargs = {"plugins": [ZeroQFabricPrecision(precision)]}
        # fp16: a dynamic scale low enough for this tiny model that no step is skipped
        fabric = _launched(ZeroQFabricStrategy(stage=2, initial_scale_power=8), **kwargs)
        torch.manual_seed(0)
        net = RichModel()
        model, opt = fabric.setup(net, torch.optim.AdamW(param_groups(net)))
        dtype = fabric.strategy.precision.param_dtype
        assert net.embed.weight.dtype == dtype and fabric.strategy.engine.parts.param_dtype == dtype
        losses = []
        for step in range(12):
            batch = make_batch(step, 0, dist.get_rank())
            tokens, targets, flag = batch
            logits = model(tokens, flag)
            assert logits.dtype == torch.float32  # outputs in the default dtype, as from Fabric's plugins
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        scaler = fabric.strategy.engine.loss_scaler
        assert (scaler is not None) == (precision == "16-mixed")
        assert scaler is None or scaler.skipped_steps == 0, scaler
        return losses

    return run("32-true"), run(precision)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_half_precision_follows_fp32(dist_pool, precision):
    # As for the Trainer (tests/integration/lightning/test_parity.py): one rounding of weights and activations to 8 (bf16)
    # or 11 (fp16) mantissa bits, kept from compounding by the fp32 masters.
    fp32, low = dist_pool(2).run(_precision_body, precision)[0]
    worst = max(abs(a - b) / abs(a) for a, b in zip(fp32, low))
    print(f"{precision}: worst relative loss deviation from fp32 over {len(fp32)} steps = {worst:.4f}")
    assert worst < 0.02, worst
    assert low[-1] < low[0]


def _zero_grad_body(stage: int) -> None:
    import copy as _copy

    zq, ddp = _launched(f"zeroq_stage_{stage}"), _launched("ddp_find_unused_parameters_true")
    torch.manual_seed(0)
    base = RichModel()
    mine, theirs = _copy.deepcopy(base), _copy.deepcopy(base)
    model, opt = zq.setup(mine, torch.optim.SGD(mine.parameters(), lr=0.1))
    ref_model, ref_opt = ddp.setup(theirs, torch.optim.SGD(theirs.parameters(), lr=0.1))
    rank = dist.get_rank()
    for step in range(2):
        dropped, kept = make_batch(step, 0, rank, uniform=True), make_batch(step, 1, rank, uniform=True)
        for fabric, m, o in ((zq, model, opt), (ddp, ref_model, ref_opt)):
            fabric.backward(_loss(m, dropped) * 100.0)
            o.zero_grad()  # the Fabric-wrapped optimizer: drops the engine's gradients too
            fabric.backward(_loss(m, kept))
            o.step()
            o.zero_grad()
    full = zq.strategy.full_state_dict()
    for name, p in ref_model.module.named_parameters():
        assert (full[name] - p.detach()).abs().max().item() < 1e-5, name


@pytest.mark.parametrize("stage", [1, 2])
def test_the_fabric_optimizers_zero_grad_drops_the_engines_gradients(dist_pool, stage):
    dist_pool(2).run(_zero_grad_body, stage)


# ------------------------------------------------------------------------------ fabric.save / fabric.load


def _fabric_steps(fabric, model, opt, sched, first: int, count: int) -> None:
    rank = dist.get_rank()
    for step in range(first, first + count):
        fabric.backward(_loss(model, make_batch(step, 0, rank, uniform=True)))
        fabric.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
        sched.step()
        opt.zero_grad()


def _setup(fabric, seed: int):
    torch.manual_seed(seed)
    model = RichModel()
    model, opt = fabric.setup(model, torch.optim.AdamW(param_groups(model), eps=1e-3))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched


def _save_body(tmp: str) -> None:
    """2 ranks, stage 2: two steps in lockstep with DDP, then both save (ZeroQ: a directory; DDP: one file)."""
    from lightning_zeroq import ZeroQFabricStrategy

    zq = _launched(ZeroQFabricStrategy(stage=2, reduce_bucket_size=300))
    ddp = _launched("ddp_find_unused_parameters_true")
    parts, ref_parts = _setup(zq, 5), _setup(ddp, 5)
    _fabric_steps(zq, *parts, 0, 2)
    _fabric_steps(ddp, *ref_parts, 0, 2)
    for fabric, (model, opt, sched), path in ((zq, parts, f"{tmp}/zeroq"), (ddp, ref_parts, f"{tmp}/ddp.pt")):
        fabric.save(path, {"model": model, "optimizer": opt, "sched": sched, "step": 2, "note": {"a": [1, 2.5]}})
    if dist.get_rank() == 0:  # what fabric.load_raw reads: a bare state dict
        torch.save(ref_parts[0].module.state_dict(), f"{tmp}/raw.pt")
    dist.barrier()


def _load_body(tmp: str) -> float:
    """3 ranks: DDP resumes from its file; ZeroQ stage 3 with CPU offload from ZeroQ's directory and
    ZeroQ stage 2 from DDP's file; two more steps must match DDP after each."""
    from lightning_zeroq import ZeroQFabricStrategy

    ddp = _launched("ddp_find_unused_parameters_true")
    ref = _setup(ddp, 99)
    ref_state = {"model": ref[0], "optimizer": ref[1], "step": 0, "sched": ref[2]}
    rest = ddp.load(f"{tmp}/ddp.pt", ref_state)
    assert ref_state["step"] == 2 and "note" in rest
    expected = {k: v.detach().cpu() for k, v in ref[0].module.named_parameters(remove_duplicate=False)}
    raw = _launched(ZeroQFabricStrategy(stage=3, **STAGE3))
    raw_model, _, _ = _setup(raw, 7 + dist.get_rank())
    assert raw.load_raw(f"{tmp}/raw.pt", raw_model) is None
    assert all(torch.equal(v, expected[k]) for k, v in raw.strategy.full_state_dict().items())
    resumed = []
    for options, path in (({"stage": 3, "offload_optimizer": True, **STAGE3}, f"{tmp}/zeroq"),
                          ({"stage": 2}, f"{tmp}/ddp.pt")):
        zq = _launched(ZeroQFabricStrategy(reduce_bucket_size=300, **options))
        model, opt, sched = _setup(zq, 99 + dist.get_rank())  # other weights: the load must replace them
        state = {"model": model, "optimizer": opt, "sched": sched, "step": 0}
        rest = zq.load(path, state)
        assert state["step"] == 2 and rest["note"] == {"a": [1, 2.5]}, (state["step"], rest)
        assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == ref[1].param_groups[0]["lr"]
        resumed.append((zq, model, opt, sched))
    worst = 0.0
    for step in range(2, 4):
        _fabric_steps(ddp, *ref, step, 1)
        expected = {k: v.detach().cpu() for k, v in ref[0].module.named_parameters(remove_duplicate=False)}
        for zq, model, opt, sched in resumed:
            _fabric_steps(zq, model, opt, sched, step, 1)
            full = zq.strategy.full_state_dict()
            for name, value in expected.items():
                diff = (full[name] - value).abs().max().item()
                assert diff <= 1e-5, f"step {step}: {name} differs from DDP by {diff}"
                worst = max(worst, diff)
    return worst


def test_fabric_save_at_two_ranks_loads_at_three_and_trains_as_ddp(dist_pool, tmp_path):
    dist_pool(2).run(_save_body, str(tmp_path))
    assert (tmp_path / "zeroq").is_dir() and (tmp_path / "ddp.pt").is_file()
    assert max(dist_pool(3).run(_load_body, str(tmp_path))) <= 1e-5


def _consolidated_body(tmp: str) -> None:
    """A ZeroQ directory consolidated by Lightning's ``_load_distributed_checkpoint`` (as its FSDP users do)
    loads with ``fabric.load``: the Trainer-layout keys go to the caller's model and optimizer, the entries it
    drops are named in a warning; ``consolidate(lightning=True, optimizer=True)`` keeps them. A step after
    each load equals, bit for bit, a step after loading the directory itself."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    from lightning_zeroq import ZeroQFabricStrategy
    from lightning_zeroq.checkpoint.agree import CheckpointError
    from lightning_zeroq.checkpoint.convert import consolidate

    zq = _launched(ZeroQFabricStrategy(stage=2))
    model, opt, sched = _setup(zq, 5)
    _fabric_steps(zq, model, opt, sched, 0, 2)
    zq.save(f"{tmp}/dir", {"model": model, "optimizer": opt, "sched": sched, "step": 2})
    if dist.get_rank() == 0:
        torch.save(_load_distributed_checkpoint(Path(f"{tmp}/dir")), f"{tmp}/lightning.pt")
        consolidate(Path(f"{tmp}/dir"), Path(f"{tmp}/convert.pt"), lightning=True, optimizer=True)
    dist.barrier()
    results = {}
    for source in ("dir", "lightning.pt", "convert.pt"):
        fabric = _launched(ZeroQFabricStrategy(stage=3, **STAGE3))
        model, opt, sched = _setup(fabric, 99 + dist.get_rank())  # other weights: the load must replace them
        state = {"model": model, "optimizer": opt, "sched": sched, "step": 0}
        lost = pytest.warns(UserWarning, match=r"not \['sched', 'step'\].*zeroq-convert.*consolidate\(")
        with lost if source == "lightning.pt" else contextlib.nullcontext():
            fabric.load(f"{tmp}/{source}", state)
        assert state["step"] == (0 if source == "lightning.pt" else 2), (source, state["step"])
        assert opt.param_groups[0]["lr"] == pytest.approx(2e-2 * 0.9 ** 2), source  # from the optimizer's state
        before = fabric.strategy.full_state_dict()
        fabric.backward(_loss(model, make_batch(2, 0, dist.get_rank(), uniform=True)))
        opt.step()
        opt.zero_grad()
        results[source] = (before, fabric.strategy.full_state_dict())
    for source in ("lightning.pt", "convert.pt"):
        for when in (0, 1):  # the weights as loaded, then after a step that reads the Adam moments
            for name, value in results["dir"][when].items():
                assert torch.equal(results[source][when][name], value), (source, when, name)
    # a name-keyed optimizer state whose names are not this model's is refused on every rank, before any change
    if dist.get_rank() == 0:
        other = torch.load(f"{tmp}/lightning.pt", weights_only=True)
        other["optimizer_0"]["param_groups"][0]["params"][0] = "not_a_parameter"
        torch.save(other, f"{tmp}/other.pt")
    dist.barrier()
    fabric = _launched(ZeroQFabricStrategy(stage=2))
    model, opt, _ = _setup(fabric, 3)
    with pytest.raises(CheckpointError, match="names 'not_a_parameter' where this model has"):
        fabric.load(f"{tmp}/other.pt", {"model": model, "optimizer": opt})


def test_fabric_load_reads_a_directory_consolidated_by_lightning(dist_pool, tmp_path):
    dist_pool(2).run(_consolidated_body, str(tmp_path))
