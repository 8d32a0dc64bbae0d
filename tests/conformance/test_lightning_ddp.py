"""Lightning's ``tests_pytorch/strategies/test_ddp.py`` and ``test_ddp_integration.py`` (2.6.5), run
against zeroq: ``ZeroQStrategy`` derives from Lightning's ``DDPStrategy`` (process group, launcher,
devices, timeout, ``sync_batchnorm``), so DDP's contract for these must hold unchanged. GPU cases run on
the CPU device with gloo; the cases about ``DistributedDataParallel`` itself (zeroq never wraps the
module in it) and about the spawn launcher (zeroq's ranks come from a launch, as here) are deselected.
"""

from __future__ import annotations

import os
from datetime import timedelta
from unittest import mock
from unittest.mock import Mock

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment
from lightning.pytorch import LightningModule
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from tests.conformance import harness as h
from tests.conformance.harness import SPECS, on_ranks

NO_DDP_WRAPPER = "checks the DistributedDataParallel wrapper; zeroq never wraps the module in it (the engine hooks it)"
SPAWN = "exercises the ddp_spawn launcher; zeroq's ranks come from a launch (popen, torchrun, this pool)"

DESELECTED = {
    "test_ddp_kwargs_from_registry": "DDP's registry names and their DistributedDataParallel kwargs; zeroq's presets are checked in test_deepspeed_strategy_string",
    "test_ddp_configure_ddp": NO_DDP_WRAPPER,
    "test_ddp_wrapper": NO_DDP_WRAPPER,
    "test_tensor_init_context[DoublePrecision]": "64-true: a precision zeroq refuses with an error (docs/training.md, 'Precision')",
    "test_tensor_init_context[HalfPrecision-16-true]": "16-true: a precision zeroq refuses with an error (docs/training.md, 'Precision')",
    "test_multi_gpu_early_stop_ddp_spawn": SPAWN,
    "test_multi_gpu_model_ddp_spawn": SPAWN,
    "test_ddp_spawn_add_get_queue": SPAWN,
    "test_find_unused_parameters_ddp_spawn_raises": "DDP's error for unused parameters; zeroq handles them as find_unused_parameters=True (docs/training.md, 'Unused parameters')",
    "test_find_unused_parameters_ddp_exception": "DDP's error for unused parameters; zeroq handles them as find_unused_parameters=True (docs/training.md, 'Unused parameters')",
    "test_ddp_strategy_checkpoint_zero_redundancy_optimizer": "torch's ZeroRedundancyOptimizer shards the optimizer itself; zeroq refuses optimizers that are not elementwise",
    "test_ddp_with_2_gpus": "CUDA memory after teardown; its CPU part (device during and after fit) is test_ddp_cpu",
    "test_ddp_barrier_non_consecutive_device_ids": "NCCL barrier device ids of 4 GPUs; no GPU here",
    "test_ddp_gradients_synced": "reads .grad after the step: zeroq keeps gradients in shards (.grad stays None, as DeepSpeed); its DDP parity tests check the synchronization",
}
test_deselected = h.deselected(DESELECTED)


# --------------------------------------------------------------------------- test_ddp.py (host process)


@pytest.mark.parametrize(("backend", "device", "expected"),
                         [("foo", "cpu", "foo"), ("foo", "cuda:0", "foo"), (None, "cuda:0", "nccl"), (None, "cpu", "gloo")])
def test_ddp_process_group_backend(backend, device, expected):
    from lightning_zeroq import ZeroQStrategy

    class MockStrategy(ZeroQStrategy):
        def __init__(self, root_device, process_group_backend):
            self._root_device = root_device
            super().__init__(process_group_backend=process_group_backend)

        @property
        def root_device(self):
            return self._root_device

    strategy = MockStrategy(process_group_backend=backend, root_device=torch.device(device))
    assert strategy._get_process_group_backend() == expected


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@mock.patch.dict(os.environ, {"LOCAL_RANK": "1"})
def test_tensor_init_context(precision, stage):
    from lightning_zeroq import ZeroQPrecision, ZeroQStrategy

    expected_dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[precision]
    parallel_devices = [torch.device("cpu"), torch.device("cpu")]  # upstream: cuda:0, cuda:1
    strategy = ZeroQStrategy(stage=stage, parallel_devices=parallel_devices, precision_plugin=ZeroQPrecision(precision),
                             cluster_environment=LightningEnvironment())
    assert strategy.local_rank == 1
    with strategy.tensor_init_context():
        module = nn.Linear(2, 2)
    # stage 3 never materializes a model under init: its parameters wait on the meta device
    expected_device = torch.device("meta") if stage == 3 else parallel_devices[1]
    assert module.weight.device == module.bias.device == expected_device
    assert module.weight.dtype == module.bias.dtype == expected_dtype


def _setup_environment_call(strategy, init_process_group):
    from lightning.pytorch import Trainer

    trainer = Trainer(max_epochs=1, accelerator="cpu", strategy=strategy)
    trainer.strategy.connect(BoringModel())
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()
    env = trainer.strategy.cluster_environment
    init_process_group.assert_called_with(trainer.strategy._get_process_group_backend(), rank=env.global_rank(),
                                          world_size=env.world_size(), timeout=trainer.strategy._timeout,
                                          device_id=None)  # None on the CPU


@mock.patch("torch.distributed.init_process_group")
def test_set_timeout(init_process_group):
    strategy = h.strategy("zeroq_stage_2", timeout=timedelta(seconds=30))
    _setup_environment_call(strategy, init_process_group)
    assert strategy._timeout == timedelta(seconds=30)


@mock.patch("torch.distributed.init_process_group")
def test_device_id_passed_for_cuda_devices_pytorch(init_process_group):
    _setup_environment_call(h.strategy("zeroq_stage_2"), init_process_group)


def _no_sync_batchnorm(spec: str, root: str, trainer_fn: str) -> None:
    model = BoringModel()
    model.layer = nn.BatchNorm1d(10)
    trainer = h.trainer(spec, root, sync_batchnorm=True)
    trainer.state.fn = TrainerFn(trainer_fn)
    trainer.strategy.connect(model)
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()
    assert isinstance(trainer.model, LightningModule)
    trainer.strategy.setup(trainer)
    # not fitting: no SyncBatchNorm
    assert not isinstance(trainer.strategy.model.layer, nn.modules.batchnorm.SyncBatchNorm)


@pytest.mark.parametrize("trainer_fn", ["validate", "test", "predict"])
@pytest.mark.parametrize("spec", ["zeroq_stage_1", "zeroq_stage_2", "zeroq_stage_3"])
def test_ddp_dont_configure_sync_batchnorm(dist_pool, tmp_path, spec, trainer_fn):
    on_ranks(dist_pool, _no_sync_batchnorm, spec, str(tmp_path), trainer_fn)


# --------------------------------------------------------------------------- test_ddp_integration.py


class ClassificationModel(LightningModule):
    """A stand-in for Lightning's test helper of the same name: a small MLP, Adam, accuracy logged."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        from torchmetrics import Accuracy

        self.lr = lr
        self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
        self.train_acc, self.valid_acc, self.test_acc = (Accuracy(task="multiclass", num_classes=3) for _ in range(3))

    def forward(self, x):
        return self.net(x)

    def _step(self, batch, metric, prefix):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log(f"{prefix}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{prefix}_acc", metric(logits.softmax(-1), y), prog_bar=True, sync_dist=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, self.train_acc, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, self.valid_acc, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, self.test_acc, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _classification(spec: str, root: str, what: str) -> list:
    from lightning.pytorch import seed_everything

    seed_everything(4321)
    dm = h.classif_datamodule()
    model = ClassificationModel()
    trainer = h.trainer(spec, root, wrap=("Linear",), max_epochs=1)
    if what == "test":
        trainer.test(model, datamodule=dm)
        return []
    trainer.fit(model, datamodule=dm)
    if what == "fit":
        return []
    return [out["test_acc"] for out in trainer.test(model, datamodule=dm)]


@pytest.mark.parametrize("spec", SPECS)
def test_multi_gpu_model_ddp_fit_only(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _classification, spec, str(tmp_path), "fit")


@pytest.mark.parametrize("spec", SPECS)
def test_multi_gpu_model_ddp_test_only(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _classification, spec, str(tmp_path), "test")


@pytest.mark.parametrize("spec", SPECS)
def test_multi_gpu_model_ddp_fit_test(dist_pool, tmp_path, spec):
    for accuracies in on_ranks(dist_pool, _classification, spec, str(tmp_path), "fit_test"):
        for acc in accuracies:
            assert acc > 0.7


def _dist_in_setup(spec: str, root: str) -> None:
    from lightning.fabric.utilities.distributed import _distributed_is_initialized

    class TestModel(BoringModel):
        def setup(self, stage: str) -> None:
            assert _distributed_is_initialized()
            raise SystemExit()

    trainer = h.trainer(h.strategy(spec, process_group_backend="gloo"), root, fast_dev_run=True)
    with pytest.raises(SystemExit):
        trainer.fit(TestModel())


@pytest.mark.parametrize("spec", SPECS)
def test_ddp_torch_dist_is_available_in_setup(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _dist_in_setup, spec, str(tmp_path))


def _dataloaders_to_fit(spec: str, root: str) -> None:
    model = BoringModel()
    trainer = h.trainer(spec, root, enable_progress_bar=False, max_epochs=1, limit_train_batches=0.2,
                        limit_val_batches=0.2)
    trainer.fit(model, train_dataloaders=model.train_dataloader(), val_dataloaders=model.val_dataloader())


@pytest.mark.parametrize("spec", SPECS)
def test_ddp_all_dataloaders_passed_to_fit(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _dataloaders_to_fit, spec, str(tmp_path))


class BoringModelDDPCPU(BoringModel):
    def on_train_start(self) -> None:
        assert self.device == torch.device("cpu")


def _ddp_cpu(spec: str, root: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    trainer = h.trainer(spec, root, fast_dev_run=True)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    trainer.fit(BoringModelDDPCPU())


@pytest.mark.parametrize("spec", SPECS)
def test_ddp_cpu(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _ddp_cpu, spec, str(tmp_path))


def test_configure_launcher_create_processes_externally():
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    from lightning_zeroq import ZeroQStrategy

    class External(ClusterEnvironment):
        creates_processes_externally = property(lambda self: True)
        main_address = property(lambda self: "")
        main_port = property(lambda self: 8080)

        @staticmethod
        def detect():
            return True

        def world_size(self):
            return 1

        def set_world_size(self, size):
            pass

        def global_rank(self):
            return 0

        def set_global_rank(self, rank):
            pass

        def local_rank(self):
            return 0

        def node_rank(self):
            return 0

    strategy = ZeroQStrategy(cluster_environment=External(), parallel_devices=[torch.device("cpu")])
    assert strategy.launcher is None
    strategy._configure_launcher()
    assert isinstance(strategy.launcher, _SubprocessScriptLauncher)
    strategy.launcher._call_children_scripts = Mock()
    launch_fn = Mock()
    strategy.launcher.launch(launch_fn)
    strategy.launcher._call_children_scripts.assert_not_called()
    launch_fn.assert_called_once()


class CheckOptimizerDeviceModel(BoringModel):
    def configure_optimizers(self):
        assert all(param.device.type == "cpu" for param in self.parameters())  # upstream: "cuda"
        super().configure_optimizers()  # as upstream: returns nothing, Lightning then fits without an optimizer


def _params_on_device(spec: str, root: str) -> None:
    h.trainer(spec, root, fast_dev_run=1).fit(CheckOptimizerDeviceModel())


@pytest.mark.parametrize("spec", SPECS)
def test_model_parameters_on_device_for_optimizer(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _params_on_device, spec, str(tmp_path))


@mock.patch.dict(os.environ, {"LOCAL_RANK": "1"})
def test_incorrect_ddp_script_spawning(tmp_path):
    from lightning.pytorch import Trainer

    class WronglyImplementedEnvironment(LightningEnvironment):
        @property
        def creates_processes_externally(self):
            return False

    trainer = Trainer(default_root_dir=tmp_path, strategy=h.strategy("zeroq_stage_2"), accelerator="cpu", devices=2,
                      plugins=[WronglyImplementedEnvironment()], barebones=True)
    with pytest.raises(RuntimeError, match="Lightning attempted to launch new distributed processes with `local_rank > 0`."):
        trainer.fit(BoringModel())
