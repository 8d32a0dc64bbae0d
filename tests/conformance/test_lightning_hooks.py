"""Lightning's ``tests_pytorch/models/test_hooks.py`` (2.6.5), run against zeroq on 2 ranks.

The hook order and call counts Lightning promises must hold under the strategy exactly as under DDP:
the recorded sequences are compared whole (``called == expected``). On 2 ranks ``prepare_data`` runs on
local rank 0 only (Lightning's rule for every multi-process strategy), so rank 1 expects it absent;
nothing else differs from the original's single-device sequences.
"""

from __future__ import annotations

from functools import partial, update_wrapper
from inspect import getmembers, isfunction
from unittest import mock
from unittest.mock import ANY, PropertyMock

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, __version__
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel, RandomDataset
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.utils.data import DataLoader

from tests.conformance import harness as h
from tests.conformance.harness import SPECS, on_ranks

test_deselected = h.deselected({})  # every case of the file is ported


def _quiet(**kw):
    return {"enable_progress_bar": False, "enable_model_summary": False, **kw}


def _public_functions(cls) -> set[str]:
    return {name for name, _ in getmembers(cls, predicate=isfunction) if not name.startswith("_")}


def _record_calls(obj, names, called: list, prefix: str = "", train_args: bool = False) -> None:
    """Replace each method of ``obj`` in ``names`` by one that calls it, then appends ``{"name", "args",
    "kwargs"}`` (the last two only when given) to ``called``."""

    def recorded(hook, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        entry = {"name": prefix + hook}
        if args:
            entry["args"] = args
        elif train_args and hook == "train":
            entry["args"] = (True,)  # ``train()`` and ``train(True)`` alike
        if kwargs:
            entry["kwargs"] = kwargs
        called.append(entry)
        return out

    for name in names:
        fn = getattr(obj, name)
        wrapper = partial(recorded, name, fn)
        update_wrapper(wrapper, fn)
        setattr(obj, name, wrapper)


class HookedDataModule(BoringDataModule):
    def __init__(self, called: list) -> None:
        super().__init__()
        _record_calls(self, _public_functions(LightningDataModule), called)

    def prepare_data(self) -> None:  # overridden so that it is called
        ...


class HookedCallback(Callback):
    def __init__(self, called: list) -> None:
        _record_calls(self, _public_functions(Callback), called, prefix="Callback.")

    def state_dict(*args, **kwargs):
        return {"foo": True}


class HookedModel(BoringModel):
    def __init__(self, called: list) -> None:
        super().__init__()
        hooks = _public_functions(LightningModule) - {"optimizers", "log", "log_dict"}
        hooks -= _public_functions(torch.nn.Module) - {"forward", "zero_grad", "train"}
        _record_calls(self, hooks, called, train_args=True)

    # overridden so that they are called
    def configure_model(self) -> None: ...

    def on_validation_model_train(self) -> None: ...

    def on_test_model_train(self) -> None: ...

    def on_predict_model_train(self) -> None: ...

    def prepare_data(self) -> None: ...

    # ---------------------------------------------------------------- the expected sequences

    @staticmethod
    def _transfer(device) -> list:
        return [{"name": "on_before_batch_transfer", "args": (ANY, 0)},
                {"name": "transfer_batch_to_device", "args": (ANY, device, 0)},
                {"name": "on_after_batch_transfer", "args": (ANY, 0)}]

    @staticmethod
    def _backward(trainer, model) -> list:
        return [{"name": "Callback.on_before_backward", "args": (trainer, model, ANY)},
                {"name": "on_before_backward", "args": (ANY,)},
                {"name": "backward", "args": (ANY,)},
                {"name": "Callback.on_after_backward", "args": (trainer, model)},
                {"name": "on_after_backward"}]

    @staticmethod
    def _batch_end(trainer, model, i) -> list:
        return [{"name": "Callback.on_train_batch_end", "args": (trainer, model, {"loss": ANY}, ANY, i)},
                {"name": "on_train_batch_end", "args": ({"loss": ANY}, ANY, i)}]

    @classmethod
    def train_batches(cls, trainer, model, batches, device, current_epoch=0, current_batch=0) -> list:
        out = []
        for i in range(current_batch, batches):
            out += cls._transfer(device)
            out += [{"name": "Callback.on_train_batch_start", "args": (trainer, model, ANY, i)},
                    {"name": "on_train_batch_start", "args": (ANY, i)}]
            if model.automatic_optimization:
                out += [{"name": "forward", "args": (ANY,)},
                        {"name": "training_step", "args": (ANY, i)},
                        {"name": "Callback.on_before_zero_grad", "args": (trainer, model, ANY)},
                        {"name": "on_before_zero_grad", "args": (ANY,)},
                        {"name": "optimizer_zero_grad", "args": (current_epoch, i, ANY)},
                        *cls._backward(trainer, model),
                        {"name": "Callback.on_before_optimizer_step", "args": (trainer, model, ANY)},
                        {"name": "on_before_optimizer_step", "args": (ANY,)},
                        {"name": "clip_gradients", "args": (ANY,),
                         "kwargs": {"gradient_clip_val": None, "gradient_clip_algorithm": None}},
                        {"name": "configure_gradient_clipping", "args": (ANY,),
                         "kwargs": {"gradient_clip_val": None, "gradient_clip_algorithm": None}},
                        {"name": "optimizer_step", "args": (current_epoch, i, ANY, ANY)}]
                if i == trainer.num_training_batches - 1:
                    out.append({"name": "lr_scheduler_step", "args": (ANY, None)})
            else:
                out += [{"name": "forward", "args": (ANY,)},
                        *cls._backward(trainer, model),
                        {"name": "manual_backward", "args": (ANY,)},
                        {"name": "closure"},
                        {"name": "Callback.on_before_optimizer_step", "args": (trainer, model, ANY)},
                        {"name": "on_before_optimizer_step", "args": (ANY,)},
                        {"name": "training_step", "args": (ANY, i)}]
            out += cls._batch_end(trainer, model, i)
        return out

    @classmethod
    def eval_epoch(cls, fn, trainer, model, batches, key, device) -> list:
        out = [{"name": f"Callback.on_{fn}_epoch_start", "args": (trainer, model)}, {"name": f"on_{fn}_epoch_start"}]
        for i in range(batches):
            out += cls._transfer(device)
            out += [{"name": f"Callback.on_{fn}_batch_start", "args": (trainer, model, ANY, i)},
                    {"name": f"on_{fn}_batch_start", "args": (ANY, i)},
                    {"name": "forward", "args": (ANY,)},
                    {"name": f"{fn}_step", "args": (ANY, i)},
                    {"name": f"Callback.on_{fn}_batch_end", "args": (trainer, model, {key: ANY}, ANY, i)},
                    {"name": f"on_{fn}_batch_end", "args": ({key: ANY}, ANY, i)}]
        return out + [{"name": f"Callback.on_{fn}_epoch_end", "args": (trainer, model)}, {"name": f"on_{fn}_epoch_end"}]

    @classmethod
    def predict_batches(cls, trainer, model, batches, device) -> list:
        out = []
        for i in range(batches):
            out += cls._transfer(device)
            out += [{"name": "Callback.on_predict_batch_start", "args": (trainer, model, ANY, i)},
                    {"name": "on_predict_batch_start", "args": (ANY, i)},
                    {"name": "forward", "args": (ANY,)},
                    {"name": "predict_step", "args": (ANY, i)},
                    {"name": "Callback.on_predict_batch_end", "args": (trainer, model, ANY, ANY, i)},
                    {"name": "on_predict_batch_end", "args": (ANY, ANY, i)}]
        return out


def _prepared(trainer) -> list:
    """``prepare_data`` is called on local rank 0 only."""
    return [{"name": "prepare_data"}] if trainer.local_rank == 0 else []


def _ckpt(global_step: int, epoch: int = 0, **extra) -> dict:
    return {"callbacks": ANY, "epoch": epoch, "global_step": global_step, "lr_schedulers": ANY,
            "optimizer_states": ANY, "pytorch-lightning_version": __version__, "state_dict": ANY, "loops": ANY, **extra}


def _loaded(checkpoint: dict) -> dict:
    """What the load hooks receive: as with DeepSpeed (and FSDP's sharded checkpoints), the weights and
    the optimizer state go straight into the shards, so the hooks get the trainer state without
    ``state_dict`` and ``optimizer_states`` (docs, Checkpoints). Upstream's default strategy loads one
    file and hands over all of it."""
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}


# --------------------------------------------------------------------------- counts and metrics


def _zero_grad_count(spec: str, root: str, max_steps: int) -> None:
    class CurrentTestModel(BoringModel):
        on_before_zero_grad_called = 0

        def on_before_zero_grad(self, optimizer):
            self.on_before_zero_grad_called += 1

    model = CurrentTestModel()
    trainer = h.trainer(spec, root, max_steps=max_steps, max_epochs=2)
    assert model.on_before_zero_grad_called == 0
    trainer.fit(model)
    assert max_steps == model.on_before_zero_grad_called
    model.on_before_zero_grad_called = 0
    trainer.test(model)
    assert model.on_before_zero_grad_called == 0


@pytest.mark.parametrize("max_steps", [1, 2, 3])
@pytest.mark.parametrize("spec", SPECS)
def test_on_before_zero_grad_called(dist_pool, tmp_path, spec, max_steps):
    on_ranks(dist_pool, _zero_grad_count, spec, str(tmp_path), max_steps)


def _epoch_end_metrics(spec: str, root: str) -> None:
    num_epochs = 3

    class CurrentModel(BoringModel):
        def training_step(self, *args, **kwargs):
            output = super().training_step(*args, **kwargs)
            self.log_dict({"step_metric": torch.tensor(-1), "shared_metric": 100}, logger=False, prog_bar=True)
            return output

        def on_train_epoch_end(self):
            epoch = self.current_epoch
            self.log_dict({f"epoch_metric_{epoch}": torch.tensor(epoch), "shared_metric": 111}, logger=False,
                          prog_bar=True)

    model = CurrentModel()
    trainer = h.trainer(spec, root, max_epochs=num_epochs, overfit_batches=2)
    trainer.fit(model)
    assert trainer.state.finished, f"Training failed with {trainer.state}"
    metrics = trainer.progress_bar_callback.get_metrics(trainer, model)
    assert metrics["step_metric"] == -1  # unchanged by the epoch-end hook
    assert metrics["shared_metric"] == 111  # overwritten by it
    for i in range(num_epochs):
        assert metrics[f"epoch_metric_{i}"] == i


@pytest.mark.parametrize("spec", SPECS)
def test_on_train_epoch_end_metrics_collection(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _epoch_end_metrics, spec, str(tmp_path))


# --------------------------------------------------------------------------- batch transfer


@mock.patch("lightning.pytorch.strategies.Strategy.lightning_module", new_callable=PropertyMock)
def test_apply_batch_transfer_handler(model_getter_mock, tmp_path):
    # upstream runs on a GPU or MPS device; the hooks' order is the same on the CPU device zeroq runs on
    from lightning.pytorch import Trainer

    expected_device = torch.device("cpu")

    class CustomBatch:
        def __init__(self, data):
            self.samples, self.targets = data

    class CurrentTestModel(BoringModel):
        rank = 0
        transfer_batch_to_device_hook_rank = None
        on_after_batch_transfer_hook_rank = None

        def on_after_batch_transfer(self, batch, dataloader_idx):
            assert dataloader_idx == 0
            assert batch.samples.device == batch.targets.device == expected_device
            self.on_after_batch_transfer_hook_rank = self.rank
            self.rank += 1
            batch.targets *= 2
            return batch

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            assert dataloader_idx == 0
            self.transfer_batch_to_device_hook_rank = self.rank
            self.rank += 1
            batch.samples = batch.samples.to(device)
            batch.targets = batch.targets.to(device)
            return batch

    model = CurrentTestModel()
    batch = CustomBatch((torch.zeros(5, 32), torch.ones(5, 1, dtype=torch.long)))
    trainer = Trainer(accelerator="cpu", devices=1, strategy=h.strategy("zeroq_stage_2"), default_root_dir=tmp_path)
    model_getter_mock.return_value = model
    moved = trainer.strategy.batch_to_device(batch, expected_device)
    assert model.transfer_batch_to_device_hook_rank == 0
    assert model.on_after_batch_transfer_hook_rank == 1
    assert moved.samples.device == moved.targets.device == expected_device
    assert torch.allclose(moved.samples.cpu(), torch.zeros(5, 32))
    assert torch.allclose(moved.targets.cpu(), torch.ones(5, 1, dtype=torch.long) * 2)


class _CustomBatch:
    def __init__(self, data):
        self.samples = data[0]

    def to(self, device, **kwargs):
        self.samples = self.samples.to(device, **kwargs)
        return self


def _collate(batch):
    return _CustomBatch(batch)


def _transfer_batch_ddp(spec: str, root: str) -> None:
    class TestModel(BoringModel):
        def training_step(self, batch, batch_idx):
            assert batch.samples.device == self.device
            assert isinstance(batch_idx, int)
            return super().training_step(torch.rand(1, 32, device=self.device), batch_idx)

        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 64), collate_fn=_collate)

    model = TestModel()
    model.validation_step = None
    trainer = h.trainer(spec, root, limit_train_batches=2, limit_val_batches=0, max_epochs=1, **_quiet())
    trainer.fit(model)


@pytest.mark.parametrize("spec", SPECS)
def test_transfer_batch_hook_ddp(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _transfer_batch_ddp, spec, str(tmp_path))


# --------------------------------------------------------------------------- the whole hook system


def _hook_system_fit(spec: str, root: str, automatic: bool, override_val_train: bool) -> None:
    called: list = []

    class TestModel(HookedModel):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.automatic_optimization = automatic

        def training_step(self, batch, batch_idx):
            if self.automatic_optimization:
                return super().training_step(batch, batch_idx)
            loss = self.step(batch[0])
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step(lambda: called.append({"name": "closure"}))
            return {"loss": loss}

    model = TestModel(called)
    if not override_val_train:
        model.on_validation_model_train = None
    assert is_overridden("on_validation_model_train", model) == override_val_train
    train_batches = val_batches = 2
    trainer = h.trainer(spec, root, max_epochs=1, limit_train_batches=train_batches, limit_val_batches=val_batches,
                        callbacks=[HookedCallback(called)], **_quiet())
    trainer.fit(model)
    saved_ckpt = _ckpt(train_batches)
    device = trainer.strategy.root_device

    def validation() -> list:
        return [{"name": "train", "args": (False,)},
                {"name": "on_validation_model_eval"},
                {"name": "Callback.on_validation_start", "args": (trainer, model)},
                {"name": "on_validation_start"},
                *model.eval_epoch("validation", trainer, model, val_batches, "x", device),
                {"name": "Callback.on_validation_end", "args": (trainer, model)},
                {"name": "on_validation_end"},
                *([{"name": "on_validation_model_train"}] if override_val_train else [])]

    expected = [
        {"name": "configure_callbacks"},
        *_prepared(trainer),
        {"name": "Callback.setup", "args": (trainer, model), "kwargs": {"stage": "fit"}},
        {"name": "setup", "kwargs": {"stage": "fit"}},
        {"name": "configure_model"},
        {"name": "configure_optimizers"},
        {"name": "Callback.on_fit_start", "args": (trainer, model)},
        {"name": "on_fit_start"},
        {"name": "zero_grad"},
        {"name": "Callback.on_sanity_check_start", "args": (trainer, model)},
        {"name": "val_dataloader"},
        *validation(),
        {"name": "Callback.on_sanity_check_end", "args": (trainer, model)},
        {"name": "train_dataloader"},
        {"name": "Callback.on_train_start", "args": (trainer, model)},
        {"name": "on_train_start"},
        {"name": "Callback.on_train_epoch_start", "args": (trainer, model)},
        {"name": "on_train_epoch_start"},
        *model.train_batches(trainer, model, train_batches, device),
        {"name": "zero_grad"},
        {"name": "on_validation_model_zero_grad"},
        *validation(),
        {"name": "Callback.on_train_epoch_end", "args": (trainer, model)},
        {"name": "on_train_epoch_end"},  # before ModelCheckpoint, a monitoring callback, saves
        {"name": "Callback.state_dict"},
        {"name": "Callback.on_save_checkpoint", "args": (trainer, model, saved_ckpt)},
        {"name": "on_save_checkpoint", "args": (saved_ckpt,)},
        {"name": "Callback.on_train_end", "args": (trainer, model)},
        {"name": "on_train_end"},
        {"name": "Callback.on_fit_end", "args": (trainer, model)},
        {"name": "on_fit_end"},
        {"name": "Callback.teardown", "args": (trainer, model), "kwargs": {"stage": "fit"}},
        {"name": "teardown", "kwargs": {"stage": "fit"}},
    ]
    assert called == expected


@pytest.mark.parametrize("automatic", [True, False])
@pytest.mark.parametrize("override_val_train", [True, False])
@pytest.mark.parametrize("spec", SPECS)
def test_trainer_model_hook_system_fit(dist_pool, tmp_path, spec, automatic, override_val_train):
    on_ranks(dist_pool, _hook_system_fit, spec, str(tmp_path), automatic, override_val_train)


def _hook_system_resume(spec: str, root: str, by: str) -> None:
    limits = {"max_epochs": 1, "limit_train_batches": 2} if by == "epochs" else {"max_steps": 1}
    first = h.trainer(spec, root, limit_val_batches=0, callbacks=[HookedCallback([])], **limits, **_quiet())
    first.fit(BoringModel())
    best_model_path = first.checkpoint_callback.best_model_path

    called: list = []
    model = HookedModel(called)
    if by == "epochs":  # 1 epoch of 2 steps done; resume and do 2 more
        limits = {"max_epochs": 2, "limit_train_batches": 2}
        loaded, saved = _loaded(_ckpt(2)), _ckpt(4, epoch=1)
    else:  # 1 step done; resume for 2 more
        limits = {"max_steps": 3}
        loaded, saved = _loaded(_ckpt(1)), _ckpt(3)
    trainer = h.trainer(spec, root, limit_val_batches=0, callbacks=[HookedCallback(called)], **limits, **_quiet())
    trainer.fit(model, ckpt_path=best_model_path)
    device = trainer.strategy.root_device
    if by == "epochs":
        batches = [{"name": "Callback.on_train_epoch_start", "args": (trainer, model)},
                   {"name": "on_train_epoch_start"},
                   *model.train_batches(trainer, model, 2, device, current_epoch=1, current_batch=0)]
    else:
        batches = model.train_batches(trainer, model, 3, device, current_batch=1)
    restore_and_configure = [
        {"name": "on_load_checkpoint", "args": (loaded,)},
        {"name": "Callback.on_load_checkpoint", "args": (trainer, model, loaded)},
        {"name": "Callback.load_state_dict", "args": ({"foo": True},)},
    ]
    fit_start = [{"name": "Callback.on_fit_start", "args": (trainer, model)}, {"name": "on_fit_start"}]
    # zeroq, as DeepSpeed, restores the checkpoint after its set-up (restore_checkpoint_after_setup): the
    # Trainer builds the optimizers in the strategy's setup, calls on_fit_start, then the load hooks
    # (Trainer._run); upstream's default strategy loads before the setup, so before both.
    if trainer.strategy.restore_checkpoint_after_setup:
        setup_to_fit_start = [{"name": "configure_optimizers"}, *fit_start, *restore_and_configure]
    else:
        setup_to_fit_start = [*restore_and_configure, {"name": "configure_optimizers"}, *fit_start]
    expected = [
        {"name": "configure_callbacks"},
        *_prepared(trainer),
        {"name": "Callback.setup", "args": (trainer, model), "kwargs": {"stage": "fit"}},
        {"name": "setup", "kwargs": {"stage": "fit"}},
        {"name": "configure_model"},
        *setup_to_fit_start,
        {"name": "zero_grad"},
        {"name": "train_dataloader"},
        {"name": "Callback.on_train_start", "args": (trainer, model)},
        {"name": "on_train_start"},
        *batches,
        {"name": "Callback.on_train_epoch_end", "args": (trainer, model)},
        {"name": "on_train_epoch_end"},
        {"name": "Callback.state_dict"},
        {"name": "Callback.on_save_checkpoint", "args": (trainer, model, saved)},
        {"name": "on_save_checkpoint", "args": (saved,)},
        {"name": "Callback.on_train_end", "args": (trainer, model)},
        {"name": "on_train_end"},
        {"name": "Callback.on_fit_end", "args": (trainer, model)},
        {"name": "on_fit_end"},
        {"name": "Callback.teardown", "args": (trainer, model), "kwargs": {"stage": "fit"}},
        {"name": "teardown", "kwargs": {"stage": "fit"}},
    ]
    assert called == expected, _first_difference(called, expected)


@pytest.mark.parametrize("spec", SPECS)
def test_trainer_model_hook_system_fit_no_val_and_resume_max_epochs(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _hook_system_resume, spec, str(tmp_path), "epochs")


@pytest.mark.parametrize("spec", SPECS)
def test_trainer_model_hook_system_fit_no_val_and_resume_max_steps(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _hook_system_resume, spec, str(tmp_path), "steps")


def _hook_system_eval(spec, root, override_train, batches, verb, noun, dataloader, key) -> None:
    called: list = []
    model = HookedModel(called)
    if not override_train:
        setattr(model, f"on_{noun}_model_train", None)
    assert is_overridden(f"on_{noun}_model_train", model) == override_train
    trainer = h.trainer(spec, root, max_epochs=1, limit_val_batches=batches, limit_test_batches=batches,
                        callbacks=[HookedCallback(called)], **_quiet())
    getattr(trainer, verb)(model, verbose=False)
    hooks = [
        {"name": f"{dataloader}_dataloader"},
        {"name": "train", "args": (False,)},
        {"name": f"on_{noun}_model_eval"},
        {"name": f"Callback.on_{noun}_start", "args": (trainer, model)},
        {"name": f"on_{noun}_start"},
        *model.eval_epoch(noun, trainer, model, batches, key, trainer.strategy.root_device),
        {"name": f"Callback.on_{noun}_end", "args": (trainer, model)},
        {"name": f"on_{noun}_end"},
        *([{"name": f"on_{noun}_model_train"}] if override_train else []),
    ]
    expected = [
        {"name": "configure_callbacks"},
        *_prepared(trainer),
        {"name": "Callback.setup", "args": (trainer, model), "kwargs": {"stage": verb}},
        {"name": "setup", "kwargs": {"stage": verb}},
        {"name": "configure_model"},
        {"name": "zero_grad"},
        *(hooks if batches else []),
        {"name": "Callback.teardown", "args": (trainer, model), "kwargs": {"stage": verb}},
        {"name": "teardown", "kwargs": {"stage": verb}},
    ]
    assert called == expected


@pytest.mark.parametrize("batches", [0, 2])
@pytest.mark.parametrize(("verb", "noun", "dataloader", "key"),
                         [("validate", "validation", "val", "x"), ("test", "test", "test", "y")])
@pytest.mark.parametrize("override_train", [True, False])
@pytest.mark.parametrize("spec", SPECS)
def test_trainer_model_hook_system_eval(dist_pool, tmp_path, spec, override_train, batches, verb, noun, dataloader,
                                        key):
    on_ranks(dist_pool, _hook_system_eval, spec, str(tmp_path), override_train, batches, verb, noun, dataloader, key)


def _hook_system_predict(spec: str, root: str) -> None:
    called: list = []
    model = HookedModel(called)
    batches = 2
    trainer = h.trainer(spec, root, limit_predict_batches=batches, enable_progress_bar=False,
                        callbacks=[HookedCallback(called)])
    trainer.predict(model)
    expected = [
        {"name": "configure_callbacks"},
        *_prepared(trainer),
        {"name": "Callback.setup", "args": (trainer, model), "kwargs": {"stage": "predict"}},
        {"name": "setup", "kwargs": {"stage": "predict"}},
        {"name": "configure_model"},
        {"name": "zero_grad"},
        {"name": "predict_dataloader"},
        {"name": "train", "args": (False,)},
        {"name": "on_predict_model_eval"},
        {"name": "Callback.on_predict_start", "args": (trainer, model)},
        {"name": "on_predict_start"},
        {"name": "Callback.on_predict_epoch_start", "args": (trainer, model)},
        {"name": "on_predict_epoch_start"},
        *model.predict_batches(trainer, model, batches, trainer.strategy.root_device),
        {"name": "Callback.on_predict_epoch_end", "args": (trainer, model)},
        {"name": "on_predict_epoch_end"},
        {"name": "Callback.on_predict_end", "args": (trainer, model)},
        {"name": "on_predict_end"},
        {"name": "Callback.teardown", "args": (trainer, model), "kwargs": {"stage": "predict"}},
        {"name": "teardown", "kwargs": {"stage": "predict"}},
    ]
    assert called == expected


@pytest.mark.parametrize("spec", SPECS)
def test_trainer_model_hook_system_predict(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _hook_system_predict, spec, str(tmp_path))


def _argument_names(spec: str, root: str) -> list:
    class CustomBoringModel(BoringModel):
        def assert_args(self, x, batch_nb):
            assert isinstance(x, Tensor)
            assert x.size() == (1, 32)
            assert isinstance(batch_nb, int)

        def training_step(self, x1, batch_nb1):
            self.assert_args(x1, batch_nb1)
            return super().training_step(x1, batch_nb1)

        def validation_step(self, x2, batch_nb2):
            self.assert_args(x2, batch_nb2)
            return super().validation_step(x2, batch_nb2)

        def test_step(self, x3, batch_nb3, dataloader_idx):  # dataloader_idx keeps its name
            self.assert_args(x3, batch_nb3)
            assert isinstance(dataloader_idx, int)
            return super().test_step(x3, batch_nb3)

        def predict_step(self, x4, batch_nb4, dataloader_idx):
            self.assert_args(x4, batch_nb4)
            assert isinstance(dataloader_idx, int)
            return super().predict_step(x4, batch_nb4, dataloader_idx)

        def test_dataloader(self):
            return [DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))]

        def predict_dataloader(self):
            return [DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))]

    model = CustomBoringModel()
    trainer = h.trainer(spec, root, fast_dev_run=5)
    trainer.fit(model)
    trainer.test(model)
    preds = trainer.predict(model)
    return [len(x) for x in preds]


@pytest.mark.parametrize("spec", SPECS)
def test_hooks_with_different_argument_names(dist_pool, tmp_path, spec):
    for lengths in on_ranks(dist_pool, _argument_names, spec, str(tmp_path)):
        assert len(lengths) == 2
        assert all(n == 5 for n in lengths)


def _datamodule_hooks(spec: str, root: str) -> None:
    model = BoringModel()
    batches = 2
    trainer = h.trainer(spec, root, max_epochs=1, limit_train_batches=batches, limit_val_batches=batches,
                        limit_test_batches=batches, limit_predict_batches=batches,
                        reload_dataloaders_every_n_epochs=1, **_quiet())
    prepared = _prepared(trainer)
    for verb, loaders in (("fit", ["val_dataloader", "train_dataloader", "state_dict"]), ("validate", ["val_dataloader"]),
                          ("test", ["test_dataloader"]), ("predict", ["predict_dataloader"])):
        called: list = []
        dm = HookedDataModule(called)
        kwargs = {} if verb in ("fit", "predict") else {"verbose": False}
        getattr(trainer, verb)(model, datamodule=dm, **kwargs)
        expected = [*prepared, {"name": "setup", "kwargs": {"stage": verb}}, *[{"name": n} for n in loaders],
                    {"name": "teardown", "kwargs": {"stage": verb}}]
        assert called == expected, verb


@pytest.mark.parametrize("spec", SPECS)
def test_trainer_datamodule_hook_system(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _datamodule_hooks, spec, str(tmp_path))


class CustomHookedDataModule(HookedDataModule):
    def state_dict(self):
        return {"foo": "bar"}


def _load_from_checkpoint_hooks(spec: str, root: str, override_configure_model: bool) -> None:
    class CustomHookedModel(HookedModel):
        pass

    if not override_configure_model:
        CustomHookedModel.configure_model = None
    lm_called, ldm_called = [], []
    model = CustomHookedModel(lm_called)
    assert is_overridden("configure_model", model) == override_configure_model
    datamodule = CustomHookedDataModule(ldm_called)
    trainer = h.trainer(spec, root)
    trainer.strategy.connect(model)
    trainer._data_connector.attach_data(model, datamodule=datamodule)
    ckpt_path = trainer.strategy.broadcast(f"{root}/file.ckpt")
    trainer.save_checkpoint(ckpt_path)
    key = datamodule.__class__.__qualname__
    saved_ckpt = _ckpt(0, **{key: {"foo": "bar"}})
    assert lm_called == [{"name": "on_save_checkpoint", "args": (saved_ckpt,)}]
    assert ldm_called == [{"name": "state_dict"}]

    lm_called, ldm_called = [], []
    CustomHookedModel.load_from_checkpoint(ckpt_path, called=lm_called)
    CustomHookedDataModule.load_from_checkpoint(ckpt_path, called=ldm_called)
    expected_lm_called = [{"name": "configure_model"}] if override_configure_model else []
    expected_lm_called += [{"name": "on_load_checkpoint", "args": ({**saved_ckpt, "hyper_parameters": ANY},)}]
    assert lm_called == expected_lm_called
    assert ldm_called == [{"name": "load_state_dict", "args": (saved_ckpt[key],)}]


@pytest.mark.parametrize("override_configure_model", [True, False])
@pytest.mark.parametrize("spec", SPECS)
def test_load_from_checkpoint_hook_calls(dist_pool, tmp_path, spec, override_configure_model):
    on_ranks(dist_pool, _load_from_checkpoint_hooks, spec, str(tmp_path), override_configure_model)


def _train_eval_mode(spec: str, root: str) -> None:
    class MixedTrainModeModule(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = torch.nn.Linear(2, 2)  # a frozen submodule keeps its mode
            self.frozen.eval()
            self.frozen.requires_grad_(False)

        def _check(self, training: bool) -> None:
            assert self.layer.weight.requires_grad
            assert self.layer.training == training
            assert not self.frozen.training
            assert not self.frozen.weight.requires_grad

        def training_step(self, *args, **kwargs):
            self._check(True)
            return super().training_step(*args, **kwargs)

        def validation_step(self, *args, **kwargs):
            self._check(False)
            return super().validation_step(*args, **kwargs)

        def test_step(self, *args, **kwargs):
            self._check(False)
            return super().test_step(*args, **kwargs)

        def predict_step(self, *args, **kwargs):
            self._check(False)
            return super().predict_step(*args, **kwargs)

    model = MixedTrainModeModule()
    trainer = h.trainer(spec, root, max_epochs=1, val_check_interval=1, limit_train_batches=3, limit_val_batches=2,
                        limit_test_batches=2, limit_predict_batches=2, enable_checkpointing=False, **_quiet())
    trainer.fit(model)
    trainer.validate(model)
    trainer.test(model)
    trainer.predict(model)


@pytest.mark.parametrize("spec", SPECS)
def test_train_eval_mode_restored(dist_pool, tmp_path, spec):
    on_ranks(dist_pool, _train_eval_mode, spec, str(tmp_path))


def _first_difference(called: list, expected: list) -> str:
    """Where the recorded hooks leave the expected ones (an assertion message, not a check)."""
    for i, (a, b) in enumerate(zip(called, expected)):
        if a != b:
            return f"hook {i}: called {a}, expected {b}"
    return f"{len(called)} hooks called, {len(expected)} expected"
