"""Resume through the Trainer at another world size, stage and offload: every step of the resumed
run, parameters and optimizer state (Adam's step count and moments), matches an uninterrupted DDP run.

Every step sees the same global batch of 6 samples whatever the world size (6 // world_size per
rank, Lightning's ``DistributedSampler`` without shuffling), so a 2-rank and a 3-rank run take the
same steps, and the run is saved at the end of epoch 1 and resumed for epoch 2.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from tests.models import TokenDataset, make_lit_module
from tests.integration.engine.test_parity import STAGE3

GLOBAL_BATCH, STEPS_PER_EPOCH = 6, 4
TOL = 1e-5


def _recorder():
    import lightning as L


    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.snapshots: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                params, optim = trainer.strategy.full_state_dict(), engine.full_optimizer_state()
            else:
                names = {id(p): n for n, p in pl_module.named_parameters()}
                params = {n: p.detach().clone() for n, p in pl_module.named_parameters(remove_duplicate=False)}
                state = trainer.strategy.optimizers[0].state
                optim = {names[id(p)]: {k: v.detach().clone() for k, v in s.items()} for p, s in state.items()}
            self.snapshots.append({"params": params, "optimizer": optim, "step": trainer.global_step})

    return Recorder()


def _fit(strategy, epochs: int, ckpt_path=None, save_to=None, callbacks=()) -> list[dict]:
    import lightning as L

    world = dist.get_world_size()
    torch.manual_seed(7)
    recorder = _recorder()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder, *callbacks])
    data = torch.utils.data.DataLoader(TokenDataset(GLOBAL_BATCH * STEPS_PER_EPOCH), batch_size=GLOBAL_BATCH // world)
    trainer.fit(make_lit_module(scheduler=True), data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return recorder.snapshots


def _strategy(kind: dict):
    from lightning_zeroq import ZeroQStrategy

    return ZeroQStrategy(**kind)


def _first(kind: dict, ckpt: str) -> list[dict]:
    return _fit(_strategy(kind), 1, save_to=ckpt)


def _second(kind: dict, ckpt: str) -> list[dict]:
    return _fit(_strategy(kind), 2, ckpt_path=ckpt)


def _ddp() -> list[dict]:
    return _fit("ddp_find_unused_parameters_true", 2)


def assert_runs_match(got: list[dict], ref: list[dict], tol: float = TOL) -> None:
    assert [s["step"] for s in got] == [s["step"] for s in ref], ([s["step"] for s in got], [s["step"] for s in ref])
    for snap, want in zip(got, ref):
        step = snap["step"]
        assert snap["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            diff = (snap["params"][name] - value).abs().max().item()
            assert diff <= tol, f"step {step}: parameter {name} differs from DDP by {diff}"
        assert snap["optimizer"].keys() == want["optimizer"].keys(), step
        for name, state in want["optimizer"].items():
            mine = snap["optimizer"][name]
            assert mine.keys() == state.keys(), (step, name)
            for key, value in state.items():
                diff = (torch.as_tensor(mine[key]).float() - torch.as_tensor(value).float()).abs().max().item()
                assert diff <= tol, f"step {step}: optimizer state {name}.{key} differs from DDP by {diff}"


S2 = {"stage": 2, "reduce_bucket_size": 400}
S3_OFFLOAD = {"stage": 3, **STAGE3, "offload_optimizer": True, "offload_parameters": True}
S1 = {"stage": 1, "reduce_bucket_size": 250}


@pytest.mark.parametrize("before,after", [((2, S2), (3, S3_OFFLOAD)), ((3, S3_OFFLOAD), (2, S2)), ((3, S2), (1, S1))],
                         ids=["2xstage2-to-3xstage3offload", "3xstage3offload-to-2xstage2", "3xstage2-to-1xstage1"])
def test_resume_at_another_world_size_matches_ddp(dist_pool, before, after):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "epoch1.ckpt")
        first = dist_pool(before[0]).run(_first, before[1], ckpt)[0]
        second = dist_pool(after[0]).run(_second, after[1], ckpt)[0]
    reference = dist_pool(after[0]).run(_ddp)[0]
    assert len(first) == STEPS_PER_EPOCH and len(reference) == 2 * STEPS_PER_EPOCH
    assert_runs_match(first + second, reference)
