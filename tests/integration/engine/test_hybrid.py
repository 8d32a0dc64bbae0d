"""Hybrid sharding (``shard_group_size``): 4 gloo ranks in 2 groups of 2, step by step against DDP.

Each group holds one full copy of the sharded state; gradients are reduce-scattered inside a group
and all-reduced across groups; stage 3 gathers inside a group. The tests check the layout (shards of
2 ranks, the same shard at the same position of both groups), parity with DDP at 1e-5 (stages 1-3,
accumulation, clipping, CPU offload), INT8 weights, and the values a bad ``shard_group_size`` is
refused with.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero.engine import ZeroEngine
from lightning_zeroq.zero.unit import UnitState
from lightning_zeroq.zero.policies import ineffective
from tests.models import RichModel, make_batch, param_groups
from tests.integration.engine.test_parity import OFFLOAD, _ddp_loss

TRANSIENT = {"stage3_wrap_classes": ["Sequential", "Linear"], "stage3_param_persistence_threshold": 0}
BACKWARDS_PER_STEP = [2, 3, 1]


def _same_across_groups(tensor: torch.Tensor, engine: ZeroEngine, within: bool = False) -> bool:
    """Is ``tensor`` bitwise the same on this rank and at its position in every other group (``within``:
    on every rank of this rank's group)?"""
    mine = tensor.detach().float().cpu().reshape(-1).clone()
    group = engine.parts.group if within else engine.parts.replica_group
    copies = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, mine, group=group)
    return all(torch.equal(c, mine) for c in copies)


def _parity_body(stage: int, managed: bool, offload: str = "none", size: int = 2, **options) -> float:
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # every rank starts elsewhere: the engine syncs from rank 0, as DDP
    model = RichModel()
    ref_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref_model, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(param_groups(ref_model), eps=1e-3)  # eps: see test_engine_parity
    config = ZeroConfig(stage=stage, reduce_bucket_size=300, managed_gradient_accumulation=managed,
                        shard_group_size=size, **(TRANSIENT if stage == 3 else {}), **OFFLOAD[offload], **options)
    engine = ZeroEngine(model, config)
    groups = dist.get_world_size() // size
    assert (engine.parts.world_size, engine.parts.num_groups, engine.parts.rank, engine.parts.replica_rank) == (size, groups, rank % size,
                                                                                        rank // size)
    assert all(u.layout.world_size == size for u in engine.parts.units)
    transient = [u for u in engine.parts.units if not u.persistent]
    assert (len(transient) > 0) == (stage == 3)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), eps=1e-3))

    worst = 0.0
    for step, n in enumerate(BACKWARDS_PER_STEP):
        for micro in range(n):
            batch = make_batch(step, micro, rank, uniform=stage == 3)
            last = micro == n - 1
            engine.backward(model.loss(batch) / n, boundary=last if managed else None)
            assert all(u.state is UnitState.SHARDED for u in transient), "stage 3 must free its units"
            if last:
                (_ddp_loss(ddp, batch) / n).backward()
            else:
                with ddp.no_sync():
                    (_ddp_loss(ddp, batch) / n).backward()
        norm = engine.clip_grad_norm_(0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        assert abs(float(norm) - float(ref_norm)) < 1e-5 * max(1.0, float(ref_norm))
        if groups > 1:
            assert _same_across_groups(torch.cat([u.fp32_grad() for u in engine.parts.units]), engine)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        if groups > 1:
            assert _same_across_groups(torch.cat([engine.parts.placement.device_master(u) for u in engine.parts.units]), engine)
        full = engine.full_state_dict()
        for name, p in ref_model.named_parameters(remove_duplicate=False):
            diff = (full[name] - p.detach()).abs().max().item()
            assert diff < 1e-5, f"step {step}: {name} differs from DDP by {diff}"
            worst = max(worst, diff)
    for name in ("never.weight", "never.bias"):
        assert torch.equal(full[name], ref_model.get_parameter(name).detach()), name
    return worst


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_two_groups_of_two_match_ddp(dist_pool, stage: int, managed: bool) -> None:
    assert all(r < 1e-5 for r in dist_pool(4).run(_parity_body, stage, managed))


@pytest.mark.parametrize("stage, offload", [(2, "optimizer_cpu"), (3, "params_optimizer_cpu")])
def test_two_groups_of_two_with_cpu_offload_match_ddp(dist_pool, stage: int, offload: str) -> None:
    assert all(r < 1e-5 for r in dist_pool(4).run(_parity_body, stage, False, offload))


INT8_ARMS = {
    # The embedding and the 16x16 weights are quantized; LayerNorm and biases go exactly.
    "weights": {"quantized_weights": True, "quantized_weights_exact_numel": 64},
    "gradients_across_groups": {"quantized_gradients": True, "quantize_cross_group_only": True},
    "gradients_every_hop": {"quantized_gradients": True},
}


@pytest.mark.parametrize("size", [1, 4])
def test_groups_of_one_and_of_the_world_match_ddp(dist_pool, size: int) -> None:
    # 1: every rank a group (nothing sharded, gradients all-reduced); 4: one group (plain ZeRO)
    assert all(r < 1e-5 for r in dist_pool(4).run(_parity_body, 2, True, "none", size))


def _int8_body(stage: int, steps: int, arm: str = "weights") -> tuple[list[float], list[float]]:
    rank = dist.get_rank()
    runs = []
    for quantized in (False, True):
        torch.manual_seed(0)
        model = RichModel()
        int8 = INT8_ARMS[arm] if quantized else {}
        engine = ZeroEngine(model, ZeroConfig(stage=stage, shard_group_size=2, reduce_bucket_size=500,
                                              **int8, **(TRANSIENT if stage == 3 else {})))
        engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
        losses = []
        for step in range(steps):
            loss = model.loss(make_batch(step, 0, rank, uniform=True))
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            losses.append(float(loss.detach()))
        for unit in engine.parts.units:  # every rank of both groups holds the same (dequantized) weights
            assert _same_across_groups(engine.parts.placement.device_master(unit), engine)
            if unit.persistent:
                assert _same_across_groups(unit.flat, engine, within=True)
                assert _same_across_groups(unit.flat, engine)
        runs.append(losses)
    return runs[0], runs[1]


@pytest.mark.parametrize("stage, arm", [(2, "weights"), (3, "weights"), (2, "gradients_across_groups"),
                                        (3, "gradients_every_hop")])
def test_int8_in_groups_follows_full_width(dist_pool, stage: int, arm: str) -> None:
    # The tolerance of test_quantized.test_quantized_training_follows_full_width: INT8 groups of 64
    # move a weight by at most absmax/254 per gather and the masters stay exact, so the per-step
    # loss stays within 2% of the full-width run. The groups' copies stay bitwise equal.
    for plain, quant in dist_pool(4).run(_int8_body, stage, 15, arm):
        worst = max(abs(a - b) / a for a, b in zip(plain, quant))
        assert 0 < worst < 0.02, worst  # 0: nothing was quantized
        assert quant[-1] < quant[0] - 0.1


# ---------------------------------------------------------------- bad values


@pytest.mark.parametrize("value, words", [
    (0, "must be a positive integer"), (-2, "must be a positive integer"), (1.5, "must be a positive integer"),
    ("half", "must be a positive integer"), (True, "must be a positive integer"), ([2], "must be a positive integer"),
])
def test_config_refuses_a_bad_shard_group_size(value, words) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        ZeroConfig(shard_group_size=value)
    message = str(caught.value)
    assert f"shard_group_size={value!r}" in message and "'node'" in message and "\n" not in message


def test_config_accepts_node_none_and_integral_floats() -> None:
    assert ZeroConfig(shard_group_size="node").shard_group_size == "node"
    assert ZeroConfig().shard_group_size is None
    assert ZeroConfig(shard_group_size=2.0).shard_group_size == 2


def test_the_engine_alone_asks_for_a_number_instead_of_node() -> None:
    with pytest.raises(ValueError, match=r"shard_group_size='node' needs the ranks per node.*LOCAL_WORLD_SIZE"):
        ZeroEngine(RichModel(), ZeroConfig(shard_group_size="node"))


def _bad_world_body(value) -> str:
    try:
        ZeroEngine(RichModel(), ZeroConfig(shard_group_size=value))
    except ValueError as error:
        return str(error)
    return "built"


@pytest.mark.parametrize("value, words", [(5, "is larger than the world size 4"),
                                          (3, "does not divide the world size 4")])
def test_engine_refuses_a_size_that_does_not_fit_the_world(dist_pool, value, words) -> None:
    for message in dist_pool(4).run(_bad_world_body, value):
        assert f"shard_group_size={value} {words}" in message and "[1, 2, 4]" in message, message
        assert "\n" not in message


# ---------------------------------------------------------------- bytes on each hop


def _hop_bytes_body(options: dict) -> dict:
    """Every collective of one step (backward, clip, step), recorded: its hop and the bytes this rank
    sends in it, counted as a ring sends them (``n`` ranks, ``B`` bytes handed to the collective):
    reduce-scatter and all-to-all ``(n-1)/n B``, all-gather ``(n-1) B`` (B: this rank's input),
    all-reduce ``2 (n-1)/n B``."""
    from lightning_zeroq.ranks import rank_and_size
    from lightning_zeroq.zero import comm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=10**9, shard_group_size=2, **options))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters()))
    hops: dict[str, dict[str, float]] = {}

    def hop(group) -> str:
        return {id(engine.parts.group): "in_group", id(engine.parts.replica_group): "across_groups"}.get(id(group), "world")

    def record(group, nbytes: float, dtype: torch.dtype) -> None:
        entry = hops.setdefault(hop(group), {"bytes": 0.0, "calls": 0, "int8_calls": 0})
        entry["bytes"] += nbytes
        entry["calls"] += 1
        entry["int8_calls"] += dtype == torch.uint8

    size = lambda group: rank_and_size(group)[1]  # noqa: E731
    original = {name: getattr(comm, name) for name in ("reduce_scatter", "all_gather", "all_to_all", "all_reduce")}

    def reduce_scatter(output, input, group):
        record(group, input.nbytes * (size(group) - 1) / size(group), input.dtype)
        return original["reduce_scatter"](output, input, group)

    def all_gather(output, input, group):
        record(group, input.nbytes * (size(group) - 1), input.dtype)
        return original["all_gather"](output, input, group)

    def all_to_all(output, input, group):
        record(group, input.nbytes * (size(group) - 1) / size(group), input.dtype)
        return original["all_to_all"](output, input, group)

    def all_reduce(tensor, op, group):
        record(group, 2 * tensor.nbytes * (size(group) - 1) / size(group), tensor.dtype)
        return original["all_reduce"](tensor, op, group)

    for name, fn in (("reduce_scatter", reduce_scatter), ("all_gather", all_gather), ("all_to_all", all_to_all),
                     ("all_reduce", all_reduce)):
        setattr(comm, name, fn)
    try:
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(dist.get_rank()))
        engine.backward(model(x).pow(2).mean())
        engine.clip_grad_norm_(1.0)
        engine.step()
    finally:
        for name, fn in original.items():
            setattr(comm, name, fn)
    return {"hops": hops, "padded": sum(u.layout.padded_numel for u in engine.parts.units),
            "params": sum(p.numel() for p in model.parameters()), "num_params": engine.num_params}


ARMS = {
    "full_width": {},
    "int8_every_hop": {"quantized_gradients": True, "quantized_weights": True, "quantized_weights_exact_numel": 0},
    "int8_across_groups_only": {"quantized_gradients": True, "quantize_cross_group_only": True},
}


def hop_formula(arm: str, N: int, g: int, G: int, b: int, params: int) -> dict[str, float]:
    """Bytes each rank sends per step and hop (stage 2, one unit of ``N`` padded elements, shard
    ``S = N/g``, ``g`` ranks per group, ``G`` groups, ``b`` bytes per working element, INT8 packing
    ``q(n) = n (1 + 4/64)``):

    - in the group: the gradients' reduce-scatter ``(g-1)/g N b`` (INT8: an all-to-all ``(g-1) q(S)``),
      the weights' all-gather after the step ``(g-1) S b`` (INT8: ``(g-1) q(S)``), the clip norm's
      all-reduce ``2 (g-1)/g 4``;
    - across groups: the gradient shard's all-reduce ``2 (G-1)/G S b`` (INT8: a reduce-scatter as an
      all-to-all plus an all-gather, ``2 (G-1) q(S/G)``); nothing else crosses groups;
    - the whole world (``W = gG`` ranks): the step's agreement, one all-reduce of
      ``(params + 2 units + W)`` fp32 flags, ``2 (W-1)/W 4 (params + 2 + W)``.
    """
    S, W = N // g, g * G
    q = lambda n: n * (1 + 4 / 64)  # noqa: E731
    int8_in = arm == "int8_every_hop"
    int8_across = arm != "full_width"
    return {
        "in_group": ((g - 1) * q(S) if int8_in else (g - 1) / g * N * b)
        + ((g - 1) * q(S) if int8_in else (g - 1) * S * b) + 2 * (g - 1) / g * 4,
        "across_groups": 2 * (G - 1) * q(S // G) if int8_across else 2 * (G - 1) / G * S * b,
        "world": 2 * (W - 1) / W * 4 * (params + 2 + W),
    }


@pytest.mark.parametrize("arm", list(ARMS))
def test_bytes_on_each_hop_follow_the_formula(dist_pool, arm: str) -> None:
    results = dist_pool(4).run(_hop_bytes_body, ARMS[arm])
    for result in results:
        hops, N = result["hops"], result["padded"]
        expected = hop_formula(arm, N, 2, 2, 4, result["num_params"])
        assert set(hops) == set(expected), hops
        for name, value in expected.items():
            assert hops[name]["bytes"] == pytest.approx(value), (arm, name, hops[name], value)
        across, inside = hops["across_groups"], hops["in_group"]
        assert across["int8_calls"] == (across["calls"] if arm != "full_width" else 0)
        assert inside["int8_calls"] == (2 if arm == "int8_every_hop" else 0)  # gradients and weights
    print(f"\n{arm}: {results[0]['params']} parameters, N={results[0]['padded']} padded elements; bytes sent per "
          f"rank and step: " + ", ".join(f"{k} {v['bytes']:.0f} ({v['calls']} calls)" for k, v in results[0]["hops"].items()))


# ---------------------------------------------------------------- checkpoints across layouts

GLOBAL_BATCH, STEPS_PER_EPOCH = 12, 2  # 12 samples a step: 3 per rank at 4 ranks, 4 at 3 ranks


def _fit(options, epochs: int, ckpt_path=None, save_to=None) -> list[dict]:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy
    from tests.models import TokenDataset, make_lit_module
    from tests.integration.checkpoint.test_reshard import _recorder

    world = dist.get_world_size()
    torch.manual_seed(7)
    recorder = _recorder()
    strategy = ZeroQStrategy(**options) if isinstance(options, dict) else options
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder])
    data = torch.utils.data.DataLoader(TokenDataset(GLOBAL_BATCH * STEPS_PER_EPOCH), batch_size=GLOBAL_BATCH // world)
    trainer.fit(make_lit_module(scheduler=True), data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    if isinstance(options, dict):
        assert trainer.strategy.engine.parts.num_groups == world // (options.get("shard_group_size") or world)
    return recorder.snapshots


HYBRID_S3 = {"stage": 3, "shard_group_size": 2, **TRANSIENT}
HYBRID_S2 = {"stage": 2, "shard_group_size": 2, "reduce_bucket_size": 400}
FLAT_S2 = {"stage": 2, "reduce_bucket_size": 300}
FLAT_S1 = {"stage": 1, "reduce_bucket_size": 250}


@pytest.mark.parametrize("before, after", [((4, HYBRID_S3), (3, FLAT_S2)), ((3, FLAT_S1), (4, HYBRID_S2))],
                         ids=["4-hybrid-stage3-to-3-flat-stage2", "3-flat-stage1-to-4-hybrid-stage2"])
def test_resume_across_hybrid_and_flat_layouts_matches_ddp(dist_pool, tmp_path, before, after) -> None:
    from tests.integration.checkpoint.test_reshard import assert_runs_match

    ckpt = str(tmp_path / "epoch1.ckpt")
    first = dist_pool(before[0]).run(_fit, before[1], 1, None, ckpt)[0]
    second = dist_pool(after[0]).run(_fit, after[1], 2, ckpt)[0]
    reference = dist_pool(after[0]).run(_fit, "ddp_find_unused_parameters_true", 2)[0]
    assert len(first) == STEPS_PER_EPOCH and len(reference) == 2 * STEPS_PER_EPOCH
    assert_runs_match(first + second, reference)


# ---------------------------------------------------------------- zeroq-train (Hydra)


def test_hydra_key_zero_shard_group_size() -> None:
    from lightning_zeroq.cli.train import compose_config, to_run_config
    from lightning_zeroq.cli.config import config_error_line, preflight

    assert to_run_config(compose_config(["zero.shard_group_size=2", "trainer.devices=4"])).zero.shard_group_size == 2
    assert to_run_config(compose_config(["zero.shard_group_size=node"])).zero.shard_group_size == "node"
    assert to_run_config(compose_config([])).zero.shard_group_size is None
    too_large = "shard_group_size=3 is larger than the world size 2"
    for overrides, words in ((["zero.shard_group_size=0"], "shard_group_size=0 must be a positive integer"),
                             (["zero.shard_group_size=3", "trainer.devices=2"], too_large)):
        with pytest.raises(ValueError) as info:
            preflight(to_run_config(compose_config(overrides)))  # before any process starts
        line = config_error_line(info.value)
        assert words in line and "[Hydra key: zero.shard_group_size]" in line and "\n" not in line, line


# ---------------------------------------------------------------- Fabric, two "nodes"


def _fabric_two_nodes_body() -> float:
    import os

    import lightning as L

    from lightning_zeroq import ZeroQFabricStrategy
    from tests.integration.fabric.test_parity import _train_in_lockstep

    rank = dist.get_rank()
    os.environ.update(NODE_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))  # 2 nodes of 2 (the pool resets them)
    fabrics = []
    for strategy in (ZeroQFabricStrategy(stage=2, reduce_bucket_size=300, shard_group_size="node"),
                     "ddp_find_unused_parameters_true"):
        fabrics.append(L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy))
        fabrics[-1].launch()
    zq, ddp = fabrics
    torch.manual_seed(1234 + rank)
    model = RichModel()
    ref = copy.deepcopy(model)
    model, opt = zq.setup(model, torch.optim.AdamW(param_groups(model), eps=1e-3))
    ref_model, ref_opt = ddp.setup(ref, torch.optim.AdamW(param_groups(ref), eps=1e-3))
    engine = zq.strategy.engine
    assert (zq.node_rank, zq.global_rank, engine.parts.world_size, engine.parts.num_groups) == (rank // 2, rank, 2, 2)
    return _train_in_lockstep(zq, model, opt, ddp, ref_model, ref_opt, stage=2, managed=True)


def test_fabric_with_a_group_per_node_matches_ddp(dist_pool) -> None:
    assert max(dist_pool(4).run(_fabric_two_nodes_body)) <= 1e-5


# ---------------------------------------------------------------- agreement across the world


def _nonfinite_in_one_group_body() -> tuple[bool, list[int]]:
    rank = dist.get_rank()
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(stage=2, shard_group_size=2, nonfinite_gradients="skip"))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    before = [p.detach().clone() for p in model.parameters()]
    loss = model.loss(make_batch(0, 0, rank))
    engine.backward(loss * float("nan") if rank == 3 else loss)  # only the second group's last rank
    engine.finalize_gradients()
    ranks = list(engine.stepper.verdict.nonfinite_ranks)
    stepped = engine.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return stepped, ranks


def test_a_nonfinite_gradient_in_one_group_skips_the_step_everywhere(dist_pool) -> None:
    # The agreement spans the world: rank 3 (world rank, not its rank in its group) is named on every rank.
    assert dist_pool(4).run(_nonfinite_in_one_group_body) == [(False, [3])] * 4


def test_quantize_cross_group_only_says_when_it_cannot_take_effect() -> None:
    alone = ineffective(ZeroConfig(quantize_cross_group_only=True), loss_scaling=False)
    assert any("no effect without quantized_gradients=True" in m for m in alone)
    weights = ZeroConfig(quantize_cross_group_only=True, quantized_gradients=True, quantized_weights=True)
    assert any(m.startswith("quantized_weights=True has no effect") for m in ineffective(weights, loss_scaling=False))
    with pytest.warns(UserWarning, match="quantize_cross_group_only=True has no effect: one group holds all 1 ranks"):
        ZeroEngine(RichModel(), ZeroConfig(quantize_cross_group_only=True, quantized_gradients=True))
