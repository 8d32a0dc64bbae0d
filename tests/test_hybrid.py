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
from tests.models import RichModel, make_batch, param_groups
from tests.test_engine_parity import OFFLOAD, _ddp_loss

TRANSIENT = {"stage3_wrap_classes": ["Sequential", "Linear"], "stage3_param_persistence_threshold": 0}
BACKWARDS_PER_STEP = [2, 3, 1]


def _same_across_groups(tensor: torch.Tensor, engine: ZeroEngine, within: bool = False) -> bool:
    """Is ``tensor`` bitwise the same on this rank and at its position in every other group (``within``:
    on every rank of this rank's group)?"""
    mine = tensor.detach().float().cpu().reshape(-1).clone()
    group = engine.group if within else engine.replica_group
    copies = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, mine, group=group)
    return all(torch.equal(c, mine) for c in copies)


def _parity_body(stage: int, managed: bool, offload: str = "none", **options) -> float:
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # every rank starts elsewhere: the engine syncs from rank 0, as DDP
    model = RichModel()
    ref_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref_model, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(param_groups(ref_model), eps=1e-3)  # eps: see test_engine_parity
    config = ZeroConfig(stage=stage, reduce_bucket_size=300, managed_gradient_accumulation=managed,
                        shard_group_size=2, **(TRANSIENT if stage == 3 else {}), **OFFLOAD[offload], **options)
    engine = ZeroEngine(model, config)
    assert (engine.world_size, engine.num_groups, engine.rank, engine.replica_rank) == (2, 2, rank % 2, rank // 2)
    assert all(u.layout.world_size == 2 for u in engine.units)
    transient = [u for u in engine.units if not u.persistent]
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
        assert _same_across_groups(torch.cat([u.grad for u in engine.units]), engine)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert _same_across_groups(torch.cat([engine.placement.device_master(u) for u in engine.units]), engine)
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


def _int8_body(stage: int, steps: int) -> tuple[list[float], list[float]]:
    rank = dist.get_rank()
    runs = []
    for quantized in (False, True):
        torch.manual_seed(0)
        model = RichModel()
        # The embedding and the 16x16 weights are quantized; LayerNorm and biases go exactly.
        int8 = {"quantized_weights": True, "quantized_weights_exact_numel": 64} if quantized else {}
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
        for unit in engine.units:  # every rank of both groups holds the same (dequantized) weights
            if unit.persistent:
                assert _same_across_groups(unit.flat, engine, within=True)
                assert _same_across_groups(unit.flat, engine)
        runs.append(losses)
    return runs[0], runs[1]


@pytest.mark.parametrize("stage", [2, 3])
def test_int8_weights_in_groups_follow_full_width(dist_pool, stage: int) -> None:
    # The tolerance of test_quantized.test_quantized_training_follows_full_width: INT8 groups of 64
    # move a weight by at most absmax/254 per gather and the masters stay exact, so the per-step
    # loss stays within 2% of the full-width run.
    for plain, quant in dist_pool(4).run(_int8_body, stage, 15):
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
    from lightning_zeroq.zero import comm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=10**9, shard_group_size=2, **options))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters()))
    hops: dict[str, dict[str, float]] = {}

    def hop(group) -> str:
        return {id(engine.group): "in_group", id(engine.replica_group): "across_groups"}.get(id(group), "world")

    def record(group, nbytes: float, dtype: torch.dtype) -> None:
        entry = hops.setdefault(hop(group), {"bytes": 0.0, "calls": 0, "int8_calls": 0})
        entry["bytes"] += nbytes
        entry["calls"] += 1
        entry["int8_calls"] += dtype == torch.uint8

    size = lambda group: comm.world(group)[1]  # noqa: E731
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
    return {"hops": hops, "padded": sum(u.layout.padded_numel for u in engine.units),
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
