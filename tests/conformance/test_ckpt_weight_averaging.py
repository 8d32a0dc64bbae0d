"""Lightning's weight-averaging tests (tests_pytorch/callbacks/test_weight_averaging.py, 2.6.x), the cases
that save a full checkpoint with the callback and resume from it, run under zeroq on 2 gloo ranks.

Each case keeps the original's assertions, its callbacks' (``EMATestCallback``: how many updates the average
had, how often the models were swapped and copied) included; what changes is only what names the strategy
and the checkpoint: a zeroq checkpoint is a directory (as DeepSpeed's), which ``os.listdir`` of the checkpoint
folder finds as the original finds its file and ``load_from_checkpoint`` reads. Batches per epoch are per rank
as the original's one process (datasets ``world_size`` times as long, see ``harness_fabric.Boring``), except
in the original's 2-device case, which counts for 2 devices itself. Checkpoints hold the module's own weights
beside the average's, and the resumed fit must match the uninterrupted one (``test_ema_resume``). The cases
that save no checkpoint, or involve no strategy, are in ``ORIGINAL`` with why; training with the callbacks
under zeroq is compared with DDP in ``test_weight_callbacks.py``.
"""

from __future__ import annotations

import glob
import os
from copy import deepcopy
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from tests.conformance.harness_fabric import PORTED, STAGES, assert_ported_or_explained, run, trainer

NO_CHECKPOINT = ("saves no checkpoint: training with the callback under zeroq is compared with DDP in "
                 "test_weight_callbacks.py")
ORIGINAL = {
    "test_weight_averaging_deepcopy": NO_CHECKPOINT + " (the callback's copy of the module in setup)",
    "test_ema": NO_CHECKPOINT,
    "test_ema_accelerator": "GPU/MPS twin of test_ema on one device; no strategy involved",
    "test_ema_ddp": "CUDA twin of test_ema_ddp_spawn_cpu: " + NO_CHECKPOINT,
    "test_ema_ddp_spawn": "CUDA twin of test_ema_ddp_spawn_cpu: " + NO_CHECKPOINT,
    "test_ema_ddp_spawn_cpu": NO_CHECKPOINT,
    "test_ema_resume": PORTED,
    "test_ema_resume_ddp": PORTED,
    "test_swa": NO_CHECKPOINT,
    "test_ema_configure_model": "the callback's own configure_model call (FSDP on a GPU); saves no checkpoint",
    "test_ema_weight_averaging": NO_CHECKPOINT,
    "test_ema_weight_averaging_step_frequency": NO_CHECKPOINT,
    "test_ema_weight_averaging_starting_step": NO_CHECKPOINT,
    "test_ema_weight_averaging_starting_epoch": NO_CHECKPOINT,
    "test_ema_weight_averaging_should_update": "should_update's arithmetic; no Trainer, no strategy involved",
    "test_ema_weight_averaging_checkpoint_save_load": PORTED,
    "test_ema_weight_averaging_decay_values": NO_CHECKPOINT,
}


# --------------------------------------------------------------------------- the original's helpers


class TestModel(BoringModel):
    __test__ = False  # a model, not a test class

    def __init__(self, batch_norm: bool = True) -> None:
        super().__init__()
        layers = [nn.Linear(32, 32)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(32))
        layers += [nn.ReLU(), nn.Linear(32, 2)]
        self.layer = nn.Sequential(*layers)
        self.crash_on_epoch = None

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        if self.crash_on_epoch and self.trainer.current_epoch >= self.crash_on_epoch:
            raise Exception("CRASH")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> None:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class EMAAveragingFunction:
    """EMA averaging function (the original's: a closure would not pickle for ddp_spawn)."""

    def __init__(self, decay: float = 0.999) -> None:
        self.decay = decay

    @torch.no_grad()
    def __call__(self, ema_param: Tensor, current_param: Tensor, num_averaged: Tensor) -> Tensor:
        return self.decay * ema_param + (1 - self.decay) * current_param


class EMATestCallback(WeightAveraging):
    def __init__(self, devices: int = 1, **kwargs: Any) -> None:
        super().__init__(avg_fn=EMAAveragingFunction(), **kwargs)
        self.devices = devices
        self.swap_calls = 0
        self.copy_calls = 0
        # Record the first epoch, as if we are resuming from a checkpoint this may not be equal to 0.
        self.first_epoch: Optional[int] = None

    def _swap_models(self, *args: Any, **kwargs: Any):
        self.swap_calls += 1
        return super()._swap_models(*args, **kwargs)

    def _copy_average_to_current(self, *args: Any, **kwargs: Any):
        self.copy_calls += 1
        return super()._copy_average_to_current(*args, **kwargs)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        assert self.swap_calls == 0
        assert self.copy_calls == 0

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        # Since the checkpoint loaded was saved `on_train_epoch_end`, the first `FitLoop` iteration will not update
        # the model and will just call the epoch-level hooks. For that reason, we check that we are not restarting
        # before choosing the first epoch.
        if self.first_epoch is None and not trainer.fit_loop.restarting:
            self.first_epoch = trainer.current_epoch

    def on_train_epoch_end(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_end(trainer, *args)
        assert self._average_model.n_averaged == trainer.global_step
        assert self.swap_calls == (trainer.current_epoch + 1 - self.first_epoch) * 2
        assert self.copy_calls == 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # length=32, batch_size=4, accumulate_grad_batches=2
        # => Using one process we have 4 optimizer steps per epoch.
        # => Using two processes we have 2 optimizer steps per epoch.
        steps_per_epoch = 4 // self.devices
        assert self._average_model.n_averaged == trainer.max_epochs * steps_per_epoch
        assert self.swap_calls == (trainer.max_epochs - self.first_epoch) * 2
        assert self.copy_calls == 1


def _dataset(length: int = 32, per_rank: bool = True) -> Dataset:
    """The original's ``RandomDataset(32, 32)``; ``per_rank``: ``world_size`` times as long, so every rank
    counts the original's batches (adapted: the original runs one process)."""
    return RandomDataset(32, length * (dist.get_world_size() if per_rank else 1))


def _train(
    model: BoringModel,
    dataset: Dataset,
    tmp_path: str,
    callback: WeightAveraging,
    arm: str,
    checkpoint_path: Optional[str] = None,
    will_crash: bool = False,
) -> None:
    # Adapted: the original's strategy/accelerator/devices arguments name the zeroq arm here (CPU, 2 ranks).
    deterministic = True
    t = trainer(
        arm,
        logger=False,
        callbacks=callback,
        max_epochs=8,
        num_sanity_val_steps=0,
        enable_checkpointing=will_crash,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=2,
        deterministic=deterministic,
        default_root_dir=tmp_path,
    )
    dataloader = DataLoader(dataset, batch_size=4, shuffle=False)
    try:
        if will_crash:
            with pytest.raises(Exception, match="CRASH"):
                t.fit(model, dataloader, ckpt_path=checkpoint_path)
        else:
            t.fit(model, dataloader, ckpt_path=checkpoint_path)
    finally:
        torch.use_deterministic_algorithms(False)  # the pool's process runs other cases next
    assert t.lightning_module == model


def _train_and_resume(model: TestModel, dataset: Dataset, tmp_path: str, arm: str, devices: int = 1) -> TestModel:
    _train(model, dataset, tmp_path, EMATestCallback(devices=devices), arm, will_crash=True)

    checkpoint_dir = Path(tmp_path) / "checkpoints"
    checkpoint_names = os.listdir(checkpoint_dir)
    assert len(checkpoint_names) == 1
    checkpoint_path = str(checkpoint_dir / checkpoint_names[0])

    model = TestModel.load_from_checkpoint(checkpoint_path)
    callback = EMATestCallback(devices=devices)
    _train(model, dataset, tmp_path, callback, arm, checkpoint_path=checkpoint_path)
    return model


# --------------------------------------------------------------------------- the ported cases


def _ema_resume_body(tmp: str, arm: str, crash_on_epoch: int) -> None:
    dataset = _dataset()
    model1 = TestModel()
    model2 = deepcopy(model1)

    _train(model1, dataset, os.path.join(tmp, "uninterrupted"), EMATestCallback(), arm)

    model2.crash_on_epoch = crash_on_epoch
    model2 = _train_and_resume(model2, dataset, tmp, arm)

    for param1, param2 in zip(model1.parameters(), model2.parameters()):
        assert torch.allclose(param1, param2)


# Adapted: the original's crash epochs (1, 3, 5) each under one arm, not all three under every arm.
@pytest.mark.parametrize(("crash_on_epoch", "arm"), [(1, "stage3_freed"), (3, "zeroq_stage_1"), (5, "zeroq_stage_2")])
def test_ema_resume(dist_pool, tmp_path, crash_on_epoch: int, arm: str) -> None:
    run(dist_pool(2), _ema_resume_body, str(tmp_path), arm, crash_on_epoch)


def _ema_resume_ddp_body(tmp: str, arm: str) -> None:
    model = TestModel()
    model.crash_on_epoch = 3
    dataset = _dataset(per_rank=False)  # the original's 2-device case: its callback counts for 2 devices
    _train_and_resume(model, dataset, tmp, arm, devices=2)


# Adapted: strategy="ddp_spawn", devices=2 is each zeroq arm on the pool's 2 ranks.
@pytest.mark.parametrize("arm", STAGES)
def test_ema_resume_ddp(dist_pool, tmp_path, arm: str) -> None:
    run(dist_pool(2), _ema_resume_ddp_body, str(tmp_path), arm)


def _checkpoint_save_load_body(tmp: str, arm: str) -> None:
    model = TestModel()
    model.crash_on_epoch = 2
    dataset = _dataset()

    callback = EMAWeightAveraging(decay=0.99, update_every_n_steps=2)

    # Train and create checkpoint
    _train(model, dataset, tmp, callback, arm, will_crash=True)

    # Resume from checkpoint
    model2 = TestModel()
    callback2 = EMAWeightAveraging(decay=0.99, update_every_n_steps=2)

    _train(
        model2,
        dataset,
        tmp,
        callback2,
        arm,
        # Adapted: the checkpoint is a directory named like the original's file.
        checkpoint_path=glob.glob((Path(tmp) / "checkpoints" / "*.ckpt").as_posix())[0],
    )

    assert callback2._average_model is not None


@pytest.mark.parametrize("arm", STAGES)
def test_ema_weight_averaging_checkpoint_save_load(dist_pool, tmp_path, arm: str) -> None:
    run(dist_pool(2), _checkpoint_save_load_body, str(tmp_path), arm)


def test_every_original_case_is_ported_or_has_a_reason() -> None:
    assert_ported_or_explained(ORIGINAL, globals(), 17)
