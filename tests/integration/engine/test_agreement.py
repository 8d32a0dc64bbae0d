"""Every rank builds the same engine: a configuration or a model that differs on some ranks (a per-node
config file, an override given on one node) is one error on every rank, naming the setting and the ranks,
raised before any collective that could hang (the process groups of ``shard_group_size`` included).

Each case runs well under the collective timeout (``run_within``): a hang fails the test, it does not wait.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq.common.precision import ZeroQPrecision
from lightning_zeroq.common.strategy import build_engine
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero.engine import ZeroEngine
from tests.models import DIM, RichModel

BOUND_S = 30.0


class Wider(RichModel):
    def __init__(self) -> None:
        super().__init__()
        self.never = torch.nn.Linear(DIM, 4)


def _build(options_by_rank: dict, model_by_rank: dict | None = None, ranks_per_node: dict | None = None) -> tuple:
    rank = dist.get_rank()
    model = (model_by_rank or {}).get(rank, RichModel)()
    config = ZeroConfig(**{**options_by_rank.get("all", {}), **options_by_rank.get(rank, {})})
    try:
        if ranks_per_node is None:
            engine = ZeroEngine(model, config)
        else:  # as the strategies build it: "node" is the ranks on this node
            engine = build_engine(model, config, ZeroQPrecision(), torch.device("cpu"), ranks_per_node[rank])
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error)
    return "built", (engine.parts.world_size, engine.parts.num_groups)


def _nothing() -> None:
    return None


def _run(dist_pool, world_size: int, *args) -> list:
    pool = dist_pool(world_size)
    pool.run(_nothing)  # started (slow on a loaded machine) before the bounded run
    return pool.run_within(BOUND_S, _build, *args)


def _one_error(results: list, kind: str = "ValueError") -> str:
    assert {r[0] for r in results} == {kind}, results
    messages = {r[1] for r in results}
    assert len(messages) == 1, f"ranks disagree: {messages}"
    message = messages.pop()
    assert "\n" not in message, message
    return message


def test_a_setting_that_differs_on_one_rank_is_named_on_every_rank(dist_pool) -> None:
    results = _run(dist_pool, 2, {"all": {"stage": 2}, 0: {"reduce_bucket_size": 500_000_000},
                                                        1: {"reduce_bucket_size": 400}})
    message = _one_error(results)
    assert "reduce_bucket_size differs across ranks: rank 0 has 500000000, rank 1 has 400" in message, message
    assert "give every rank the same configuration" in message, message


def test_several_settings_are_all_named(dist_pool) -> None:
    results = _run(dist_pool, 2, {1: {"stage": 3, "overlap_comm": False}})
    message = _one_error(results)
    assert "stage differs across ranks: rank 0 has 2, rank 1 has 3" in message, message
    assert "overlap_comm differs across ranks: rank 0 has True, rank 1 has False" in message, message


def test_a_shard_group_size_on_one_rank_only_is_named_before_groups_are_made(dist_pool) -> None:
    results = _run(dist_pool, 2, {1: {"shard_group_size": 1}})
    message = _one_error(results)
    assert "shard_group_size differs across ranks: rank 0 has None, rank 1 has 1" in message, message


def test_hybrid_a_shard_group_size_on_one_rank_of_four(dist_pool) -> None:
    results = _run(dist_pool, 4, {"all": {"shard_group_size": 2}, 3: {"shard_group_size": 4}})
    message = _one_error(results)
    assert "shard_group_size differs across ranks: ranks 0-2 have 2, rank 3 has 4" in message, message


def test_a_model_that_differs_on_one_rank_is_named(dist_pool) -> None:
    results = _run(dist_pool, 2, {}, {1: Wider})
    message = _one_error(results)
    assert "never.weight" in message and "(3, 16)" in message and "(4, 16)" in message, message
    assert "rank 0" in message and "rank 1" in message, message


def test_the_same_configuration_builds(dist_pool) -> None:
    assert _run(dist_pool, 4, {"all": {"shard_group_size": 2}}) == [("built", (2, 2))] * 4


# ---------------------------------------------------------------- shard_group_size="node"


def test_node_on_uneven_nodes_names_node_and_what_it_resolved_to(dist_pool) -> None:
    # A node of 2 ranks and a node of 1: "node" is 2 on ranks 0 and 1, 1 on rank 2.
    results = _run(dist_pool, 3, {"all": {"shard_group_size": "node"}}, None,
                                      {0: 2, 1: 2, 2: 1})
    message = _one_error(results)
    assert "shard_group_size differs across ranks" in message, message
    assert "ranks 0-1 have 'node' (2 ranks on this node), rank 2 has 'node' (1 ranks on this node)" in message
    assert "shard_group_size=2" not in message, message


def test_node_that_does_not_divide_the_world_names_node(dist_pool) -> None:
    results = _run(dist_pool, 3, {"all": {"shard_group_size": "node"}}, None,
                                      {0: 2, 1: 2, 2: 2})
    message = _one_error(results)
    assert "shard_group_size='node' (2 ranks on this node) does not divide the world size 3" in message, message
    assert "[1, 3]" in message, message


def test_rank_local_settings_may_differ(dist_pool, tmp_path) -> None:
    # Each node its own NVMe mount: not a difference the ranks must agree on.
    for rank in (0, 1):
        (tmp_path / f"nvme{rank}").mkdir()
    options = {"all": {"offload_optimizer": True, "offload_optimizer_device": "nvme"},
               0: {"nvme_path": str(tmp_path / "nvme0")}, 1: {"nvme_path": str(tmp_path / "nvme1")}}
    assert _run(dist_pool, 2, options) == [("built", (2, 1))] * 2
