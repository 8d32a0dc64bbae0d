"""Engine-level checkpoints: resharding across world sizes, stages, unit layouts and offload."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine
from lightning_zeroq.zero import state_dict as zsd
from tests.models import RichModel, make_batch, param_groups

CONFIGS = {
    "s1": dict(stage=1, reduce_bucket_size=300),
    "s2": dict(stage=2, reduce_bucket_size=700),
    "s3": dict(stage=3, stage3_param_persistence_threshold=20, stage3_unit_size=200),
    "s3_offload": dict(stage=3, stage3_param_persistence_threshold=20, stage3_unit_size=200, offload_optimizer=True,
                       offload_parameters=True),
    "s2_int8": dict(stage=2, reduce_bucket_size=500, quantized_weights=True, quantized_weights_exact_numel=16),
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
    for step in steps:
        engine.backward(engine.module.loss(make_batch(step, 0, dist.get_rank(), uniform=True)))
        engine.clip_grad_norm_(1.0)
        engine.step()


def _save_body(name: str, tmp: str) -> dict:
    engine = _engine(name, tmp)
    _train(engine, range(3))
    save_engine(engine, os.path.join(tmp, "ckpt"), trainer_state={"step": 3, "note": (1, 2)})
    return {"params": engine.full_state_dict(), "optimizer": zsd.full_optimizer_state(engine)}


def _load_body(name: str, tmp: str) -> dict:
    engine = _engine(name, tmp, seed=1)  # other initial values: everything must come from the checkpoint
    trainer_state = load_engine(engine, os.path.join(tmp, "ckpt"))
    assert trainer_state == {"step": 3, "note": (1, 2)}
    return {"params": engine.full_state_dict(), "optimizer": zsd.full_optimizer_state(engine)}


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for name, entry in a["optimizer"].items():
        assert entry.keys() == b["optimizer"][name].keys(), name
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer"][name][key])), (name, key)


@pytest.mark.parametrize("save,load", [((2, "s2"), (3, "s3_offload")), ((3, "s3"), (2, "s1")),
                                       ((2, "s2_int8"), (3, "s2")), ((3, "s1"), (1, "s3"))])
def test_reshard_bitwise(dist_pool, save, load):
    with tempfile.TemporaryDirectory() as tmp:
        saved = dist_pool(save[0]).run(_save_body, save[1], tmp)[0]
        loaded = dist_pool(load[0]).run(_load_body, load[1], tmp)
    for state in loaded:
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
        states.append({"params": fresh.full_state_dict(), "optimizer": zsd.full_optimizer_state(fresh)})
    _assert_state_equal(*states)
    return True


def test_async_save_is_a_snapshot_equal_to_a_sync_save(dist_pool):
    with tempfile.TemporaryDirectory() as tmp:
        assert dist_pool(2).run(_async_body, tmp) == [True, True]
