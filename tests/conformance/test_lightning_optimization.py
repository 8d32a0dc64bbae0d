"""Lightning's ``tests_pytorch/trainer/optimization/`` (2.6.5): ``test_backward_calls.py``,
``test_manual_optimization.py``, ``test_multiple_optimizers.py`` and ``test_optimizers.py``, run against
zeroq on 2 ranks: the cases in which the strategy takes part (it calls ``configure_optimizers`` through
Lightning, keeps the user's optimizer and schedulers, runs backward and step).

Two documented differences from DDP decide the deselections below, as they do for DeepSpeed: zeroq
keeps one sharded optimizer state per parameter, so two optimizers over the same parameters are refused
with an error; and gradients live in shards, so ``.grad`` stays ``None`` between backward and step.
In stage 3 with freed units a parameter's values cannot be read outside forward/backward (an error
naming it): cases that clone ``self.layer.weight`` in a hook run under the other specs only.
"""

from __future__ import annotations

from unittest import mock
from unittest.mock import ANY, call, patch

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel, ManualOptimBoringModel
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import optim

from tests.conformance import harness as h
from tests.conformance.harness import SPECS, on_ranks

READS_WEIGHTS = [s for s in SPECS if s != h.STAGE3_FREED]  # cases that read parameters in hooks
SHARED = "two optimizers over the same parameters: zeroq shards one optimizer state per parameter and refuses it"
GRAD = "reads .grad between backward and step: zeroq keeps gradients in shards, .grad stays None (as DeepSpeed)"
PARSER = "calls Lightning's optimizer-config parser directly, no Trainer or strategy involved"

DESELECTED = {
    # test_backward_calls.py
    "test_backward_count_with_closure": "LBFGS (not elementwise) is refused by name, as by DeepSpeed's ZeRO (docs/training.md, 'Optimizers')",
    # test_multiple_optimizers.py
    "test_multiple_optimizers_manual": SHARED,
    # test_manual_optimization.py
    "test_multiple_optimizers_manual_call_counts": f"{SHARED}; {GRAD}",
    "test_multiple_optimizers_manual_log": f"{SHARED}; {GRAD}",
    "test_multiple_optimizers_manual_amp": f"{SHARED}; {GRAD}",
    "test_multiple_optimizers_step": f"{SHARED}; {GRAD}; reads the fp16 scaler of Lightning's plugin",
    "test_manual_optimization_and_accumulated_gradient": GRAD,
    "test_step_with_optimizer_closure_with_different_frequencies": SHARED,
    "test_step_with_optimizer_closure_with_different_frequencies_ddp": f"{SHARED}; all-reduces .grad by hand",
    "test_step_with_optimizer_closure_with_different_frequencies_ddp_spawn": f"{SHARED}; all-reduces .grad by hand",
    "test_step_with_optimizer_closure_with_different_frequencies_ddp_with_toggle_model": f"{SHARED}; all-reduces .grad by hand",
    "test_lr_schedulers": SHARED,
    "test_multiple_optimizers_logging": SHARED,
    # test_optimizers.py
    "test_multi_optimizer_with_scheduling": SHARED,
    "test_onecyclelr_with_epoch_interval_warns": PARSER,
    "test_scheduler_initialized_with_custom_reduceonplateau": PARSER,
    "test_optimizer_return_options": PARSER,
    "test_optimizer_config_dict_with_extra_keys_warns": PARSER,
    "test_multiple_optimizer_config_dicts_with_extra_keys_warns": PARSER,
    "test_invalid_scheduler_missing_state_dict": PARSER,
    "test_invalid_lr_scheduler_with_custom_step_method": PARSER,
    # stage 3 with freed units, for the cases that read weights in hooks
    "test_manual_optimization_and_return_tensor[stage3_freed]": "clones self.layer.weight outside forward: freed in stage 3, a clear error (as with DeepSpeed)",
    "test_step_with_optimizer_closure[stage3_freed]": "clones self.layer.weight outside forward: freed in stage 3, a clear error (as with DeepSpeed)",
    "test_step_with_optimizer_closure_2[stage3_freed]": "clones self.layer.weight outside forward: freed in stage 3, a clear error (as with DeepSpeed)",
}
test_deselected = h.deselected(DESELECTED)


# --------------------------------------------------------------------------- test_backward_calls.py


def _backward_counts(spec: str, root: str, case: str, num_steps: int = 0) -> list:
    counts = []
    model = BoringModel()
    with patch("torch.Tensor.backward") as torch_backward:
        if case == "simple":
            h.trainer(spec, root, max_steps=num_steps, logger=False, enable_checkpointing=False).fit(model)
            counts.append(torch_backward.call_count)
            torch_backward.reset_mock()
            h.trainer(spec, root, max_steps=num_steps, logger=False, enable_checkpointing=False).test(model)
            counts.append(torch_backward.call_count)
        else:
            h.trainer(spec, root, max_epochs=1, limit_train_batches=6, accumulate_grad_batches=2, logger=False,
                      enable_checkpointing=False).fit(model)
            counts.append(torch_backward.call_count)
            torch_backward.reset_mock()
            h.trainer(spec, root, max_steps=6, accumulate_grad_batches=2, logger=False,
                      enable_checkpointing=False).fit(model)
            counts.append(torch_backward.call_count)
    return counts


@pytest.mark.parametrize("num_steps", [1, 2, 3])
@pytest.mark.parametrize("spec", SPECS)
def test_backward_count_simple(dist_pool, tmp_path, spec, num_steps):
    for fit_calls, test_calls in on_ranks(dist_pool, _backward_counts, spec, str(tmp_path), "simple", num_steps):
        assert fit_calls == num_steps
        assert test_calls == 0


@pytest.mark.parametrize("spec", SPECS)
def test_backward_count_with_grad_accumulation(dist_pool, tmp_path, spec):
    for by_epoch, by_steps in on_ranks(dist_pool, _backward_counts, spec, str(tmp_path), "accumulation"):
        assert by_epoch == 6
        assert by_steps == 12


# --------------------------------------------------------------------------- test_multiple_optimizers.py


def _multiple_optimizers_automatic(spec: str, root: str) -> None:
    class WithIndex(BoringModel):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return super().training_step(batch, batch_idx)

    model = WithIndex()
    model.automatic_optimization = True
    with pytest.raises(RuntimeError, match="Remove the `optimizer_idx` argument from `training_step`"):
        h.trainer(spec, root, logger=False, enable_checkpointing=False).fit(model)

    class TwoOptimizers(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters()), torch.optim.Adam(self.parameters())

    model = TwoOptimizers()
    model.automatic_optimization = True
    with pytest.raises(RuntimeError, match="multiple optimizers is only supported with manual optimization"):
        h.trainer(spec, root, logger=False, enable_checkpointing=False).fit(model)


@pytest.mark.parametrize("spec", SPECS)
def test_multiple_optimizers_automatic_optimization_raises(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _multiple_optimizers_automatic, spec, str(tmp_path))


# --------------------------------------------------------------------------- test_manual_optimization.py


class ManualOptimizationExtendedModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.count = 0
        self.called = {"training_step": 0, "on_train_batch_start": 0, "on_train_batch_end": 0}

    @property
    def should_update(self) -> bool:
        return self.count % 2 == 0

    def on_train_batch_start(self, batch, batch_idx):
        self.called["on_train_batch_start"] += 1
        self.weight_before = self.layer.weight.clone()

    def training_step(self, batch, batch_idx):
        self.called["training_step"] += 1
        opt = self.optimizers()
        loss = self.step(batch)
        loss /= loss.clone().detach()
        loss *= 0.1
        if self.should_update:
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
        return loss

    def on_train_batch_end(self, *_):
        self.called["on_train_batch_end"] += 1
        after = self.layer.weight.clone()
        if self.should_update:
            # upstream tolerates an unchanged weight here (an exception suppressed), so no check either
            pass
        elif not torch.equal(self.weight_before, after):
            assert torch.abs(torch.sum(self.weight_before) - torch.sum(after)).item() < 10e-6
        assert self.layer.weight.grad is None
        self.count += 1

    def on_train_end(self):
        assert self.called["training_step"] == 10
        assert self.called["on_train_batch_start"] == 10
        assert self.called["on_train_batch_end"] == 10


def _manual_return_tensor(spec: str, root: str) -> None:
    trainer = h.trainer(spec, root, max_epochs=1, limit_train_batches=10, limit_test_batches=0, limit_val_batches=0,
                        precision="16-mixed")
    trainer.fit(ManualOptimizationExtendedModel())


@pytest.mark.parametrize("spec", READS_WEIGHTS)
def test_manual_optimization_and_return_tensor(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _manual_return_tensor, spec, str(tmp_path))


def _closure(spec: str, root: str) -> dict:
    from lightning.pytorch import seed_everything

    seed_everything(1)

    class TestModel(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self._losses = []

        def training_step(self, batch, batch_idx):
            assert self.layer.weight.grad is None
            opt = self.optimizers()

            def compute_loss():
                predictions = F.dropout(self(F.dropout(batch[0], 0.1)), 0.1)
                return self.loss(predictions)

            def optimizer_closure():
                num_backward = 2  # as Bayesian optimization would
                losses = []
                for backward_idx in range(num_backward):
                    loss = compute_loss()
                    losses.append(loss)
                    self.manual_backward(loss, retain_graph=(num_backward - 1) != backward_idx)
                loss = torch.stack(losses).mean()  # as MC dropout would
                self._losses.append(loss)
                self.log("train_loss", loss, on_step=True, prog_bar=True, on_epoch=True)
                assert losses[0] != losses[1]

            weight_before = self.layer.weight.clone()
            opt.step(closure=optimizer_closure)
            opt.zero_grad()
            assert not torch.equal(weight_before, self.layer.weight.clone())

    model = TestModel()
    limit_train_batches = 2
    trainer = h.trainer(spec, root, limit_train_batches=limit_train_batches, limit_val_batches=0, max_epochs=1,
                        log_every_n_steps=1)
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as bwd_mock:
        trainer.fit(model)
    assert bwd_mock.call_count == limit_train_batches * 2
    assert trainer.progress_bar_metrics["train_loss_step"] == model._losses[-1]
    assert trainer.progress_bar_metrics["train_loss_epoch"] == torch.stack(model._losses).mean()


@pytest.mark.parametrize("spec", READS_WEIGHTS)
def test_step_with_optimizer_closure(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _closure, spec, str(tmp_path))


def _closure_2(spec: str, root: str) -> None:
    class TestModel(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = self(batch[0]).sum()

            def optimizer_closure():
                num_backward = 1
                for backward_idx in range(num_backward + 1):
                    self.manual_backward(loss, retain_graph=num_backward != backward_idx)

            weight_before = self.layer.weight.clone()
            opt.step(closure=optimizer_closure)
            assert not torch.equal(weight_before, self.layer.weight.clone())

    limit_train_batches = 4
    trainer = h.trainer(spec, root, limit_train_batches=limit_train_batches, limit_val_batches=0, max_epochs=1,
                        log_every_n_steps=1)
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as bwd_mock:
        trainer.fit(TestModel())
    assert bwd_mock.call_count == limit_train_batches * 2
    assert trainer.global_step == limit_train_batches


@pytest.mark.parametrize("spec", READS_WEIGHTS)
def test_step_with_optimizer_closure_2(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _closure_2, spec, str(tmp_path))


def _plateau_manual(spec: str, root: str, scheduler_as_dict: bool) -> None:
    class TestModel(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def on_train_epoch_end(self):
            self.lr_schedulers().step(torch.tensor(0.0))

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            if scheduler_as_dict:
                scheduler = {"scheduler": scheduler, "monitor": "train_loss", "interval": "step"}  # not warned
            return [optimizer], [scheduler]

    trainer = h.trainer(spec, root, max_epochs=1, limit_train_batches=1, limit_val_batches=1, limit_test_batches=1)
    if scheduler_as_dict:
        with h.warns_on_rank_zero(RuntimeWarning, r"\['monitor'\], but the keys will be ignored"):
            trainer.fit(TestModel())
        assert trainer.lr_scheduler_configs[0].interval == "step"
    else:
        trainer.fit(TestModel())


@pytest.mark.parametrize("scheduler_as_dict", [True, False])
@pytest.mark.parametrize("spec", SPECS)
def test_lr_schedulers_reduce_lr_on_plateau(dist_pool, tmp_path, spec, scheduler_as_dict):
    on_ranks(dist_pool, _plateau_manual, spec, str(tmp_path), scheduler_as_dict)


def _scheduler_not_stepped(spec: str, root: str) -> int:
    trainer = h.trainer(spec, root, max_epochs=1, fast_dev_run=2)
    with patch("torch.optim.lr_scheduler.StepLR.step") as lr_step:
        trainer.fit(ManualOptimBoringModel())
    return lr_step.call_count


@pytest.mark.parametrize("spec", SPECS)
def test_lr_scheduler_step_not_called(dist_pool, tmp_path, spec):
    for count in on_ranks(dist_pool, _scheduler_not_stepped, spec, str(tmp_path)):
        assert count == 1  # once when the scheduler is made, never by Lightning in manual optimization


class _IncompatibleScheduler:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def state_dict(self):
        return {}

    def load_state_dict(self, _):
        pass


def _non_pytorch_scheduler(spec: str, root: str, automatic: bool) -> None:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = automatic

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
            return [optimizer], [_IncompatibleScheduler(optimizer)]

    trainer = h.trainer(spec, root, max_epochs=0, logger=False, enable_checkpointing=False)
    if automatic:
        with pytest.raises(MisconfigurationException, match="doesn't follow PyTorch's LRScheduler"):
            trainer.fit(Model())
    else:
        trainer.fit(Model())  # no error in manual optimization


@pytest.mark.parametrize("automatic", [True, False])
@pytest.mark.parametrize("spec", SPECS)
def test_manual_optimization_with_non_pytorch_scheduler(dist_pool, tmp_path, spec, automatic):
    on_ranks(dist_pool, _non_pytorch_scheduler, spec, str(tmp_path), automatic)


# --------------------------------------------------------------------------- test_optimizers.py


def _with_scheduling(spec: str, root: str) -> None:
    trainer = h.trainer(spec, root, max_epochs=1, limit_val_batches=0.1, limit_train_batches=0.2,
                        val_check_interval=0.5)
    trainer.fit(BoringModel())
    init_lr = 0.1
    adjusted_lr = [pg["lr"] for pg in trainer.optimizers[0].param_groups]
    assert len(trainer.lr_scheduler_configs) == 1
    assert all(a == adjusted_lr[0] for a in adjusted_lr)
    assert init_lr * 0.1 == adjusted_lr[0]


@pytest.mark.parametrize("spec", SPECS)
def test_optimizer_with_scheduling(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _with_scheduling, spec, str(tmp_path))


def _configured(case: str):
    """``configure_optimizers`` of the original's error and warning cases, by name."""

    def configure(self):
        if case == "plateau_no_monitor":
            optimizer = optim.Adam(self.parameters())
            return [optimizer], [optim.lr_scheduler.ReduceLROnPlateau(optimizer)]
        if case == "plateau_no_monitor_in_dict":
            optimizer = optim.Adam(self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": optim.lr_scheduler.ReduceLROnPlateau(optimizer)}}
        if case == "unknown":
            return 1
        if case == "unknown_interval":
            optimizer = optim.Adam(self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": optim.lr_scheduler.StepLR(optimizer, 1),
                                                              "interval": "incorrect_unknown_value"}}
        if case == "extra_scheduler_keys":
            optimizer = optim.Adam(self.parameters())
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": optim.lr_scheduler.StepLR(optimizer, 1), "foo": 1, "bar": 2}}
        if case == "no_scheduler":
            return {"optimizer": optim.Adam(self.parameters()), "lr_scheduler": {}}
        if case == "scheduler_of_another_optimizer":
            opt1 = optim.SGD(self.layer.parameters(), lr=0.1)
            opt2 = optim.SGD(self.layer.parameters(), lr=0.1)
            return [opt1], [optim.lr_scheduler.StepLR(opt2, step_size=1)]
        if case == "invalid_dict":
            return [{"optimizer": optim.Adam(self.parameters())}, optim.Adam(self.parameters())]
        if case == "from_dict":
            return {"optimizer": optim.SGD(params=self.parameters(), lr=1e-03)}
        if case == "none":
            return None
        raise AssertionError(case)

    return configure


RAISES = {
    "plateau_no_monitor": "`configure_optimizers` must include a monitor when a `ReduceLROnPlateau`",
    "plateau_no_monitor_in_dict": "must include a monitor when a `ReduceLROnPlateau`",
    "unknown": "Unknown configuration for model optimizers",
    "unknown_interval": r'The "interval" key in lr scheduler dict must be',
    "no_scheduler": 'The lr scheduler dict must have the key "scheduler"',
    "scheduler_of_another_optimizer": "attached with an optimizer that wasn't returned",
    "invalid_dict": "Unknown configuration for model optimizers",
}
WARNS = {
    "extra_scheduler_keys": (RuntimeWarning, r"Found unsupported keys in the lr scheduler dict: \{.+\}"),
    "none": (UserWarning, "will run with no optimizer"),
}


def _configure_case(spec: str, root: str, case: str) -> None:
    model = BoringModel()
    model.configure_optimizers = _configured(case).__get__(model)
    if case == "none":
        trainer = h.trainer(spec, root, max_epochs=1, limit_val_batches=0.1, limit_train_batches=0.2)
    else:
        trainer = h.trainer(spec, root, fast_dev_run=True)
    if case in RAISES:
        with pytest.raises(MisconfigurationException, match=RAISES[case]):
            trainer.fit(model)
    elif case in WARNS:
        with h.warns_on_rank_zero(*WARNS[case]):
            trainer.fit(model)
    else:
        trainer.fit(model)


ORIGINAL_OF = {
    "plateau_no_monitor": "test_reducelronplateau_with_no_monitor_raises",
    "plateau_no_monitor_in_dict": "test_reducelronplateau_with_no_monitor_in_lr_scheduler_dict_raises",
    "unknown": "test_unknown_configure_optimizers_raises",
    "unknown_interval": "test_lr_scheduler_with_unknown_interval_raises",
    "extra_scheduler_keys": "test_lr_scheduler_with_extra_keys_warns",
    "no_scheduler": "test_lr_scheduler_with_no_actual_scheduler_raises",
    "scheduler_of_another_optimizer": "test_invalid_optimizer_in_scheduler",
    "invalid_dict": "test_invalid_optimizer_dict_raises",
    "from_dict": "test_configure_optimizer_from_dict",
}


@pytest.mark.parametrize("original", sorted(ORIGINAL_OF.values()))
@pytest.mark.parametrize("spec", SPECS)
def test_configure_optimizers_cases(dist_pool, tmp_path, spec, original):
    """Nine cases of the original, one each: configure_optimizers' return value goes through the strategy's
    set-up, so its errors and warnings must come out unchanged (``original`` names the ported case)."""
    case = next(k for k, v in ORIGINAL_OF.items() if v == original)
    on_ranks(dist_pool, _configure_case, spec, str(tmp_path), case)


@pytest.mark.parametrize("spec", SPECS)
def test_none_optimizer(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _configure_case, spec, str(tmp_path), "none")


def _plateau_scheduling(spec: str, root: str) -> None:
    class TestModel(BoringModel):
        def training_step(self, batch, batch_idx):
            self.log("foo", batch_idx)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer = optim.Adam(self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": optim.lr_scheduler.ReduceLROnPlateau(optimizer),
                    "monitor": "foo"}

    trainer = h.trainer(spec, root, fast_dev_run=True)
    trainer.fit(TestModel())
    lr_scheduler = trainer.lr_scheduler_configs[0]
    assert lr_scheduler == LRSchedulerConfig(scheduler=lr_scheduler.scheduler, monitor="foo", interval="epoch",
                                             frequency=1, reduce_on_plateau=True, strict=True, name=None)


@pytest.mark.parametrize("spec", SPECS)
def test_reducelronplateau_scheduling(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _plateau_scheduling, spec, str(tmp_path))


def _no_optimizers_when_evaluating(spec: str, root: str, fn: str) -> tuple:
    class TestModel(BoringModel):
        def configure_optimizers(self):
            optimizer1 = optim.Adam(self.parameters(), lr=0.1)
            optimizer2 = optim.Adam(self.parameters(), lr=0.1)
            return [optimizer1, optimizer2], [optim.lr_scheduler.StepLR(optimizer1, step_size=1),
                                              optim.lr_scheduler.StepLR(optimizer2, step_size=1)]

    trainer = h.trainer(spec, root, fast_dev_run=2)
    getattr(trainer, fn)(TestModel(), datamodule=BoringDataModule(), ckpt_path=None)
    return len(trainer.lr_scheduler_configs), len(trainer.optimizers)


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
@pytest.mark.parametrize("spec", SPECS)
def test_init_optimizers_during_evaluation_and_prediction(dist_pool, tmp_path, spec, fn):
    for counts in on_ranks(dist_pool, _no_optimizers_when_evaluating, spec, str(tmp_path), fn):
        assert counts == (0, 0)


def _strict(spec: str, root: str, complete_epoch: bool) -> None:
    model = BoringModel()
    optimizer = optim.Adam(model.parameters())
    scheduler = optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    max_epochs = 1 if complete_epoch else None
    max_steps = -1 if complete_epoch else 1
    with mock.patch("torch.optim.lr_scheduler.ReduceLROnPlateau.step") as step_mock:
        trainer = h.trainer(spec, root, max_epochs=max_epochs, max_steps=max_steps)
        model.configure_optimizers = lambda: {"optimizer": optimizer,
                                              "lr_scheduler": {"scheduler": scheduler, "monitor": "giraffe", "strict": True}}
        if complete_epoch:
            with pytest.raises(MisconfigurationException,
                               match=r"ReduceLROnPlateau conditioned on metric .* which is not available\. Available metrics are:"):
                trainer.fit(model)
        else:
            trainer.fit(model)
        step_mock.assert_not_called()
        model.configure_optimizers = lambda: {"optimizer": optimizer,
                                              "lr_scheduler": {"scheduler": scheduler, "monitor": "giraffe", "strict": False}}
        if complete_epoch:
            trainer = h.trainer(spec, root, max_epochs=max_epochs, max_steps=max_steps)
            with h.warns_on_rank_zero(RuntimeWarning, r"ReduceLROnPlateau conditioned on metric .* which is not available but strict"):
                trainer.fit(model)
        step_mock.assert_not_called()


@pytest.mark.parametrize("complete_epoch", [True, False])
@pytest.mark.parametrize("spec", SPECS)
def test_lr_scheduler_strict(dist_pool, tmp_path, spec, complete_epoch):
    on_ranks(dist_pool, _strict, spec, str(tmp_path), complete_epoch)


def _state_on_device(spec: str, root: str) -> None:
    class TestModel(BoringModel):
        def configure_optimizers(self):
            return optim.Adagrad(self.parameters())  # makes its state when built, before the model moves

        def on_train_start(self, *args, **kwargs):
            _, state = next(iter(self.optimizers().state.items()))
            assert state["sum"].device == torch.device("cpu") == self.device  # upstream: cuda:<local rank>
            self.checked = True

    model = TestModel()
    h.trainer(spec, root, fast_dev_run=True, **{"enable_progress_bar": False, "enable_model_summary": False}).fit(model)
    assert model.checked


@pytest.mark.parametrize("spec", SPECS)
def test_optimizer_state_on_device(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _state_on_device, spec, str(tmp_path))


def _epoch_step_frequency(spec: str, root: str, check_val_every_n_epoch: int) -> int:
    with mock.patch("torch.optim.lr_scheduler.StepLR.step") as mocked_sched:
        trainer = h.trainer(spec, root, limit_train_batches=2, limit_val_batches=2,
                            check_val_every_n_epoch=check_val_every_n_epoch, max_epochs=4)
        trainer.fit(BoringModel())
    return mocked_sched.call_count


@pytest.mark.parametrize("check_val_every_n_epoch", [1, 2])
@pytest.mark.parametrize("spec", SPECS)
def test_lr_scheduler_epoch_step_frequency(dist_pool, tmp_path, spec, check_val_every_n_epoch):
    epochs = 4
    for count in on_ranks(dist_pool, _epoch_step_frequency, spec, str(tmp_path), check_val_every_n_epoch):
        assert count == epochs + 1  # once at init, then once per epoch


def _scheduler_state_before_saving(spec: str, root: str, every_n_train_steps, epoch_interval: bool) -> None:
    batches, max_epochs, lr, gamma = 2, 1, 1, 10
    trainer = h.trainer(spec, root, enable_progress_bar=False, logger=False, max_epochs=max_epochs,
                        limit_train_batches=batches, limit_val_batches=1,
                        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=every_n_train_steps)])

    class TestModel(BoringModel):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=lr)
            config = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)}
            if not epoch_interval:
                config["interval"] = "step"
            return [optimizer], [config]

        def on_save_checkpoint(self, checkpoint):
            config = checkpoint["lr_schedulers"][0]
            assert self.trainer.global_step == batches
            compare_to = max_epochs if epoch_interval else batches
            assert config["_step_count"] - 1 == compare_to  # the count starts at 1
            assert config["_last_lr"] == [lr * gamma**compare_to]
            self.on_save_checkpoint_called = True

    model = TestModel()
    trainer.fit(model)
    assert model.on_save_checkpoint_called


@pytest.mark.parametrize(("every_n_train_steps", "epoch_interval"), [(None, True), (2, False), (2, True)])
@pytest.mark.parametrize("spec", SPECS)
def test_lr_scheduler_state_updated_before_saving(dist_pool, tmp_path, spec, every_n_train_steps, epoch_interval):
    on_ranks(dist_pool, _scheduler_state_before_saving, spec, str(tmp_path), every_n_train_steps, epoch_interval)


def _plateau_after_saving(spec: str, root: str, save_on_train_epoch_end: bool) -> None:
    batches = 4
    trainer = h.trainer(spec, root, enable_progress_bar=False, logger=False, max_epochs=1,
                        limit_train_batches=batches, limit_val_batches=1,
                        callbacks=[ModelCheckpoint(dirpath=root, save_on_train_epoch_end=save_on_train_epoch_end)])

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            self.log("foo", batch_idx)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters())
            plateau = {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), "interval": "step",
                       "monitor": "foo"}
            step = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1), "interval": "step"}
            return [optimizer], [plateau, step]

        def on_save_checkpoint(self, checkpoint):
            assert checkpoint["lr_schedulers"][0]["last_epoch"] == batches - (not save_on_train_epoch_end)
            assert checkpoint["lr_schedulers"][1]["_step_count"] - 1 == batches
            self.on_save_checkpoint_called = True

    model = Model()
    trainer.fit(model)
    assert model.on_save_checkpoint_called


@pytest.mark.parametrize("save_on_train_epoch_end", [False, True])
@pytest.mark.parametrize("spec", SPECS)
def test_plateau_scheduler_lr_step_interval_updated_after_saving(dist_pool, tmp_path, spec, save_on_train_epoch_end):
    on_ranks(dist_pool, _plateau_after_saving, spec, str(tmp_path), save_on_train_epoch_end)


class _CustomEpochScheduler:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, epoch): ...

    def state_dict(self): ...

    def load_state_dict(self, state_dict): ...


def _step_hook(spec: str, root: str) -> tuple:
    class CustomBoringModel(BoringModel):
        def lr_scheduler_step(self, scheduler, metric):
            if isinstance(scheduler, torch.optim.lr_scheduler.StepLR):  # step level
                super().lr_scheduler_step(scheduler, metric)
            elif isinstance(scheduler, _CustomEpochScheduler):  # epoch level, a custom scheduler
                scheduler.step(epoch=self.current_epoch)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.layer.parameters(), lr=1e-2)
            step = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1), "interval": "step"}
            return [optimizer], [step, _CustomEpochScheduler(optimizer)]

    trainer = h.trainer(spec, root, enable_checkpointing=False, logger=False, max_epochs=3, limit_train_batches=2,
                        limit_val_batches=0)
    with (mock.patch.object(_CustomEpochScheduler, "step") as by_epoch,
          mock.patch.object(torch.optim.lr_scheduler.StepLR, "step") as by_step):
        trainer.fit(CustomBoringModel())
    assert by_epoch.mock_calls == [call(epoch=e) for e in range(3)]
    return by_step.call_count


@pytest.mark.parametrize("spec", SPECS)
def test_lr_scheduler_step_hook(dist_pool, tmp_path, spec):
    max_epochs, limit_train_batches = 3, 2
    for count in on_ranks(dist_pool, _step_hook, spec, str(tmp_path)):
        assert count == max_epochs * limit_train_batches + 1  # the first by torch's LRScheduler itself
