"""Engine-level checkpoints: resharding across world sizes, stages, unit layouts and offload."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine
from tests.models import RichModel, param_groups

CONFIGS = {
    "s1": dict(stage=1, reduce_bucket_size=300),
    "s2": dict(stage=2, reduce_bucket_size=700),
    "s3": dict(stage=3, stage3_param_persistence_threshold=20, stage3_unit_size=200),
    "s3_offload": dict(stage=3, stage3_param_persistence_threshold=20, stage3_unit_size=200, offload_optimizer=True,
                       offload_parameters=True),
    "s2_int8": dict(stage=2, reduce_bucket_size=500, quantized_weights=True, quantized_weights_exact_numel=16),
    "s2_nvme": dict(stage=2, reduce_bucket_size=400, offload_optimizer=True, offload_optimizer_device="nvme"),
    # Partial offload: host units {0, 2} of 3 (s2_half), {0} of 4 (s1_quarter), {0, 1, 2} of 4 (s3_three_quarters).
    "s2_half": dict(stage=2, reduce_bucket_size=400, offload_optimizer=True, offload_optimizer_ratio=0.5),
    "s1_quarter": dict(stage=1, reduce_bucket_size=300, offload_optimizer=True, offload_optimizer_ratio=0.25),
    "s3_three_quarters": dict(stage=3, stage3_param_persistence_threshold=20, stage3_unit_size=200,
                              offload_optimizer=True, offload_parameters=True, offload_optimizer_ratio=0.75),
    # Hybrid sharding: groups of 2 ranks.
    "s2_hybrid": dict(stage=2, reduce_bucket_size=700, shard_group_size=2),
    "s3_hybrid": dict(stage=3, stage3_param_persistence_threshold=20, stage3_unit_size=200, shard_group_size=2),
}


def _engine(name: str, tmp: str, seed: int = 0) -> ZeroEngine:
    torch.manual_seed(seed)
    config = dict(CONFIGS[name])
    if config.get("offload_optimizer_device") == "nvme":
        config["nvme_path"] = tmp
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(**config))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    return engine


def _train(engine: ZeroEngine, steps: range) -> None:
    from tests.integration.checkpoint.test_interop import _loss  # one global batch per step, split over the ranks

    for step in steps:
        engine.backward(_loss(engine.parts.module, step))
        engine.clip_grad_norm_(1.0)
        engine.step()


def _state(engine: ZeroEngine) -> dict:
    return {"params": engine.full_state_dict(), "optimizer": engine.full_optimizer_state()}


def _save_body(name: str, tmp: str) -> tuple[dict, dict]:
    engine = _engine(name, tmp)
    _train(engine, range(3))
    save_engine(engine, os.path.join(tmp, "ckpt"), trainer_state={"step": 3, "note": (1, 2)})
    saved = _state(engine)
    _train(engine, range(3, 4))
    return saved, _state(engine)


def _load_body(name: str, tmp: str) -> tuple[dict, dict]:
    engine = _engine(name, tmp, seed=1)  # other initial values: everything must come from the checkpoint
    trainer_state = load_engine(engine, os.path.join(tmp, "ckpt"))
    assert trainer_state == {"step": 3, "note": (1, 2)}
    loaded = _state(engine)
    _train(engine, range(3, 4))  # the loaded optimizer state is the one that steps
    return loaded, _state(engine)


def _assert_state_equal(a: dict, b: dict, tol: float = 0.0) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert (a["params"][k] - b["params"][k]).abs().max() <= tol, k
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for name, entry in a["optimizer"].items():
        assert entry.keys() == b["optimizer"][name].keys(), name
        for key, value in entry.items():
            diff = (torch.as_tensor(value).float() - torch.as_tensor(b["optimizer"][name][key]).float()).abs().max()
            assert diff <= tol, (name, key, diff)


@pytest.mark.parametrize("save,load", [((2, "s2"), (3, "s3_offload")), ((3, "s3"), (2, "s1")),
                                       ((2, "s1"), (3, "s3")), ((3, "s1"), (1, "s3")), ((3, "s3_offload"), (2, "s2_nvme"))])
def test_reshard_bitwise(dist_pool, save, load):
    with tempfile.TemporaryDirectory() as tmp:
        saved, stepped = dist_pool(save[0]).run(_save_body, save[1], tmp)[0]
        loaded = dist_pool(load[0]).run(_load_body, load[1], tmp)
    for state, after in loaded:
        _assert_state_equal(saved, state)  # loading is exact
        _assert_state_equal(stepped, after, 1e-6)  # and the next step uses it (sums in another order: not bitwise)


@pytest.mark.parametrize("save,load", [((2, "s2_half"), (2, "s2_half")), ((2, "s2_half"), (3, "s1_quarter")),
                                       ((3, "s1_quarter"), (2, "s3_three_quarters")), ((2, "s2_half"), (2, "s2")),
                                       ((2, "s3_offload"), (3, "s2_half"))])
def test_partial_offload_round_trip(dist_pool, save, load):
    # Saved and loaded with partial optimizer offload, also into another ratio, no offload or full offload.
    with tempfile.TemporaryDirectory() as tmp:
        saved, stepped = dist_pool(save[0]).run(_save_body, save[1], tmp)[0]
        loaded = dist_pool(load[0]).run(_load_body, load[1], tmp)
    for state, after in loaded:
        _assert_state_equal(saved, state)
        _assert_state_equal(stepped, after, 1e-6)


def test_a_hybrid_save_records_the_world_and_the_shard_group_and_reshards(dist_pool):
    from pathlib import Path

    from lightning_zeroq.checkpoint.store import Manifest

    with tempfile.TemporaryDirectory() as tmp:
        saved, stepped = dist_pool(4).run(_save_body, "s2_hybrid", tmp)[0]
        manifest = Manifest.read(Path(tmp) / "ckpt")
        assert manifest.world_size == 4
        assert manifest.extra == {"world_size": 4, "shard_group_size": 2, "stage": 2,
                                  "optimizer_class": "torch.optim.adamw.AdamW"}, manifest.extra
        hybrid = dist_pool(4).run(_load_body, "s3_hybrid", tmp)
        flat = dist_pool(2).run(_load_body, "s1", tmp)
    for state, after in hybrid + flat:
        _assert_state_equal(saved, state)  # loading is exact, into groups or a world of another size
    for _, after in hybrid:  # the same world: the next step is the same math (6 rows do not split evenly over 4)
        _assert_state_equal(stepped, after, 1e-6)


def test_int8_weights_save_and_load_exact_masters(dist_pool):
    with tempfile.TemporaryDirectory() as tmp:
        saved, _ = dist_pool(2).run(_save_body, "s2_int8", tmp)[0]
        loaded = dist_pool(3).run(_load_body, "s2", tmp)
    for state, _ in loaded:
        _assert_state_equal(saved, state)


def _async_body(tmp: str) -> bool:
    import threading

    from lightning_zeroq.checkpoint.checkpointer import Checkpointer
    from lightning_zeroq.checkpoint.writer import ChunkWriter

    engine = _engine("s3_offload", tmp)
    _train(engine, range(2))
    save_engine(engine, os.path.join(tmp, "sync"))
    checkpointer = Checkpointer(async_save=True)
    trained = threading.Event()
    original = ChunkWriter.write_data

    def write_after_training(self, plan, planner):  # the files are written only after training moved on
        assert trained.wait(60)
        return original(self, plan, planner)

    ChunkWriter.write_data = write_after_training
    try:
        save_engine(engine, os.path.join(tmp, "async"), checkpointer=checkpointer)
        _train(engine, range(2, 4))  # training goes on while the save is in flight: the snapshot must not move
        trained.set()
        checkpointer.wait()
    finally:
        ChunkWriter.write_data = original
    checkpointer.release()
    states = []
    for name in ("sync", "async"):
        fresh = _engine("s2", tmp, seed=5)
        load_engine(fresh, os.path.join(tmp, name))
        states.append({"params": fresh.full_state_dict(), "optimizer": fresh.full_optimizer_state()})
    _assert_state_equal(*states)
    return True


def test_async_save_is_a_snapshot_equal_to_a_sync_save(dist_pool):
    with tempfile.TemporaryDirectory() as tmp:
        assert dist_pool(2).run(_async_body, tmp) == [True, True]
