"""Lightning's ``ModelCheckpoint`` tests (tests_pytorch/checkpointing/test_model_checkpoint.py, 2.6.5),
the cases where the strategy saves, removes or loads, run under zeroq on 2 gloo ranks.

Each case keeps the original's assertions; what changes is only what names the layout: a zeroq
checkpoint is a directory (as DeepSpeed's), so "is a file" reads "is a complete checkpoint directory"
(``is_checkpoint``) and the file is read with ``read`` in the pytest process. Batches per epoch are
per rank as the original's one process (see ``harness_fabric.Boring``). Cases that involve no
strategy (argument checks, helpers called on a mock Trainer) are listed in ``ORIGINAL`` with why.
"""

from __future__ import annotations

import math
from datetime import timedelta
import os
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from tests.conformance.harness_fabric import (
    PORTED,
    assert_ported_or_explained,
    STAGES,
    Boring,
    LogInTwoMethods,
    is_checkpoint,
    read,
    run,
    trainer,
)

NO_STRATEGY = "no strategy involved: "
ORIGINAL = {
    "test_model_checkpoint_state_key": NO_STRATEGY + "the callback's state key string",
    "test_model_checkpoint_score_and_ckpt": PORTED,
    "test_model_checkpoint_score_and_ckpt_val_check_interval": PORTED,
    "test_model_checkpoint_with_non_string_input": PORTED,
    "test_model_checkpoint_to_yaml": PORTED,
    "test_model_checkpoint_path": PORTED,
    "test_pickling": NO_STRATEGY + "pickling a callback object",
    "test_model_checkpoint_no_extraneous_invocations": PORTED,
    "test_model_checkpoint_format_checkpoint_name": NO_STRATEGY + "filename formatting",
    "test_model_checkpoint_file_extension": PORTED,
    "test_model_checkpoint_save_last": PORTED,
    "test_model_checkpoint_save_last_as_link_not_local": NO_STRATEGY + "argument check on a remote dirpath",
    "test_model_checkpoint_link_checkpoint": NO_STRATEGY + "a static helper called with a Mock trainer on touched files",
    "test_model_checkpoint_link_checkpoint_relative_path": NO_STRATEGY + "a static helper called with a Mock trainer",
    "test_invalid_top_k": NO_STRATEGY + "argument check",
    "test_none_monitor_top_k": NO_STRATEGY + "argument check",
    "test_none_monitor_not_alternating": PORTED,
    "test_invalid_every_n_epochs": NO_STRATEGY + "argument check",
    "test_invalid_every_n_train_steps": NO_STRATEGY + "argument check",
    "test_invalid_trigger_combination": NO_STRATEGY + "argument check",
    "test_none_every_n_train_steps_val_epochs": NO_STRATEGY + "default attribute values",
    "test_model_checkpoint_save_last_none_monitor": PORTED,
    "test_model_checkpoint_every_n_epochs": PORTED,
    "test_ckpt_every_n_train_steps": PORTED,
    "test_model_checkpoint_on_exception_run_condition_on_validation_start": PORTED,
    "test_model_checkpoint_on_exception_fast_dev_run_on_train_batch_start": PORTED,
    "test_model_checkpoint_on_exception_run_condition_on_train_batch_start": PORTED,
    "test_model_checkpoint_on_exception_parametrized": PORTED,
    "test_model_checkpoint_on_exception_in_other_callbacks": PORTED,
    "test_model_checkpoint_train_time_interval": PORTED,
    "test_model_checkpoint_topk_zero": PORTED,
    "test_model_checkpoint_topk_all": PORTED,
    "test_ckpt_metric_names": PORTED,
    "test_default_checkpoint_behavior": PORTED,
    "test_model_checkpoint_save_last_checkpoint_contents": PORTED,
    "test_checkpointing_with_nan_as_first": NO_STRATEGY + "trainer.save_checkpoint is replaced by a Mock",
    "test_checkpoint_repeated_strategy": PORTED,
    "test_checkpoint_repeated_strategy_extended": PORTED,
    "test_configure_model_checkpoint": NO_STRATEGY + "which callbacks a Trainer holds; nothing runs",
    "test_val_check_interval_checkpoint_files": PORTED,
    "test_current_score": PORTED,
    "test_current_score_when_nan": PORTED,
    "test_hparams_type": PORTED,
    "test_ckpt_version_after_rerun_new_trainer": PORTED,
    "test_ckpt_version_after_rerun_same_trainer": PORTED,
    "test_ckpt_version_counter_disabled_after_rerun_new_trainer": PORTED,
    "test_model_checkpoint_mode_options": NO_STRATEGY + "argument check",
    "test_check_val_every_n_epochs_top_k_integration": PORTED,
    "test_model_checkpoint_saveload_ckpt": NO_STRATEGY + "the callback's state_dict round trip on objects",
    "test_resume_training_preserves_old_ckpt_last": PORTED,
    "test_save_last_saves_correct_last_model_path": PORTED,
    "test_save_last_versioning": PORTED,
    "test_none_monitor_saves_correct_best_model_path": PORTED,
    "test_last_global_step_saved": NO_STRATEGY + "callback methods called with a Mock trainer",
    "test_save_last_every_n_epochs_interaction": NO_STRATEGY + "trainer.save_checkpoint is replaced by a Mock",
    "test_train_epoch_end_ckpt_with_no_validation": NO_STRATEGY + "a predicate on loop attributes",
    "test_resume_and_old_checkpoint_files_remain": PORTED,
    "test_find_last_checkpoints": NO_STRATEGY + "file-name matching on touched files",
    "test_expand_home": NO_STRATEGY + "path expansion",
    "test_save_last_cli": NO_STRATEGY + "argument parsing",
    "test_load_with_inf_data_loader": PORTED,
    "test_save_last_without_save_on_train_epoch_and_without_val": PORTED,
    "test_save_last_only_when_checkpoint_saved": PORTED,
}


def _key(monitor) -> str:
    return (f"ModelCheckpoint{{'monitor': {monitor!r}, 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1,"
            " 'train_time_interval': None}")


def _rank0() -> bool:
    return dist.get_rank() == 0


def _listdir(path) -> set[str]:
    return set(os.listdir(path))


def _spy_monitor(t) -> dict:
    calls = {}
    original = t.fit_loop.epoch_loop._get_monitor_value

    def spy(key):
        value = original(key)
        calls[t.current_epoch] = {key: value}
        return value

    t.fit_loop.epoch_loop._get_monitor_value = spy
    return calls


# --------------------------------------------------------------------------- score in name and content


def _score_body(tmp, arm, validation_step_none, val_dataloaders_none, monitor, plateau):
    seed_everything(0)  # every rank logs the same values, as the one process of the original
    epochs, train_batches, val_batches, lr, gamma = 3, 5, 7, 1e-1, 2

    class Model(Boring):
        def __init__(self):
            super().__init__()
            self.train_log_epochs = torch.randn(epochs, train_batches)
            self.val_logs = torch.randn(epochs, val_batches)
            self.scores = []

        def training_step(self, batch, batch_idx):
            self.log("train_log", self.train_log_epochs[self.current_epoch, batch_idx], on_epoch=True)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.log("val_log", self.val_logs[self.current_epoch, batch_idx])
            return super().validation_step(batch, batch_idx)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=lr)
            if plateau:
                sched = {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": monitor,
                         "strict": True}
            else:
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
            return [opt], [sched]

        def on_train_epoch_end(self):
            if "train" in monitor:
                self.scores.append(self.trainer.logged_metrics[monitor])

        def on_validation_epoch_end(self):
            if not self.trainer.sanity_checking and "val" in monitor:
                self.scores.append(self.trainer.logged_metrics[monitor])

    callback = ModelCheckpoint(dirpath=tmp, filename="{" + monitor + ":.4f}-{epoch}", monitor=monitor, save_top_k=-1)
    model = Model()
    if validation_step_none:
        model.validation_step = None
    if val_dataloaders_none:
        model.val_dataloaders = None
    t = trainer(arm, default_root_dir=tmp, callbacks=[callback], limit_train_batches=train_batches,
                limit_val_batches=val_batches, max_epochs=epochs)
    calls = _spy_monitor(t)
    t.fit(model)
    expected = [getattr(model, f"{monitor}s")[e].mean().item() for e in range(epochs)]
    return [float(s) for s in model.scores], expected, calls, callback.dirpath


_SCORE_CASES = [(False, False, "val_log"), (True, False, "train_log_epoch"), (False, True, "val_log")]


@pytest.mark.parametrize(  # the original's six cases; the stages rotate over them
    "validation_step_none, val_dataloaders_none, monitor, plateau, arm",
    [(*case, plateau, STAGES[(2 * i + plateau) % 3]) for i, case in enumerate(_SCORE_CASES) for plateau in (False, True)])
def test_model_checkpoint_score_and_ckpt(dist_pool, tmp_path, validation_step_none, val_dataloaders_none, monitor,
                                         plateau, arm):
    scores, expected, calls, dirpath = run(dist_pool(2), _score_body, str(tmp_path), arm, validation_step_none,
                                           val_dataloaders_none, monitor, plateau)[0]
    lr, gamma, epochs = 1e-1, 2, 3
    assert len(list(tmp_path.glob("*.ckpt"))) == len(scores) == epochs
    for epoch in range(epochs):
        score = scores[epoch]
        assert math.isclose(score, expected[epoch], abs_tol=1e-5)
        ckpt = read(tmp_path / f"{monitor}={score:.4f}-epoch={epoch}.ckpt")
        assert ckpt["epoch"] == epoch
        assert ckpt["global_step"] == 5 * (epoch + 1)
        state = ckpt["callbacks"][_key(monitor)]
        assert state["dirpath"] == dirpath
        assert state["monitor"] == monitor
        assert state["current_score"] == score
        if not plateau:
            assert ckpt["lr_schedulers"][0]["_step_count"] == epoch + 2
            assert ckpt["lr_schedulers"][0]["_last_lr"][0] == lr * gamma ** (epoch + 1)
        else:
            assert calls[epoch] == {monitor: score}


def _score_interval_body(tmp, arm, val_check_interval, plateau):
    seed_everything(0)
    epochs, train_batches, val_batches, lr, gamma, monitor = 3, 12, 7, 1e-1, 2, "val_log"
    per_val = int(train_batches * val_check_interval)
    checks_per_epoch, _ = divmod(train_batches, per_val)

    class Model(Boring):
        def __init__(self):
            super().__init__()
            self.val_logs = torch.randn(checks_per_epoch * epochs, val_batches)
            self.val_loop_count = 0
            self.scores = []

        def validation_step(self, batch, batch_idx):
            self.log("val_log", self.val_logs[self.val_loop_count, batch_idx])
            return super().validation_step(batch, batch_idx)

        def on_validation_epoch_end(self):
            self.val_loop_count += 1
            self.scores.append(self.trainer.logged_metrics[monitor])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=lr)
            if plateau:
                sched = {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": monitor,
                         "strict": True}
            else:
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
            return [opt], [sched]

    callback = ModelCheckpoint(dirpath=tmp, filename="{" + monitor + ":.4f}-{epoch}", monitor=monitor, save_top_k=-1)
    model = Model()
    t = trainer(arm, default_root_dir=tmp, callbacks=[callback], limit_train_batches=train_batches,
                limit_val_batches=val_batches, max_epochs=epochs, val_check_interval=val_check_interval,
                num_sanity_val_steps=0)
    calls = _spy_monitor(t)
    t.fit(model)
    expected = [model.val_logs[i].mean().item() for i in range(len(model.val_logs))]
    return [float(s) for s in model.scores], expected, calls, callback.dirpath


@pytest.mark.parametrize("val_check_interval, plateau, epoch_aligned, arm",
                         [(0.25, True, True, "zeroq_stage_1"), (0.25, False, True, "zeroq_stage_2"),
                          (0.42, False, False, "stage3_freed")])
def test_model_checkpoint_score_and_ckpt_val_check_interval(dist_pool, tmp_path, val_check_interval, plateau,
                                                            epoch_aligned, arm):
    scores, expected, calls, dirpath = run(dist_pool(2), _score_interval_body, str(tmp_path), arm, val_check_interval,
                                           plateau)[0]
    epochs, train_batches, lr, gamma, monitor = 3, 12, 1e-1, 2, "val_log"
    per_val = int(train_batches * val_check_interval)
    checks_per_epoch, leftover = divmod(train_batches, per_val)
    assert len(list(tmp_path.glob("*.ckpt"))) == len(scores) == checks_per_epoch * epochs
    for epoch in range(epochs):
        for i in range(checks_per_epoch):
            k = i + checks_per_epoch * epoch
            at_epoch_end = epoch_aligned and i == checks_per_epoch - 1
            score = scores[k]
            assert math.isclose(score, expected[k], rel_tol=1e-4)
            ckpt = read(tmp_path / f"{monitor}={score:.4f}-epoch={epoch}.ckpt")
            assert ckpt["epoch"] == epoch
            assert ckpt["global_step"] == per_val * (k + 1) + leftover * epoch
            state = ckpt["callbacks"][_key(monitor)]
            assert state["dirpath"] == dirpath
            assert state["monitor"] == monitor
            assert state["current_score"] == score
            if not plateau:
                assert ckpt["lr_schedulers"][0]["_step_count"] == epoch + 1 + at_epoch_end
                assert ckpt["lr_schedulers"][0]["_last_lr"][0] == lr * gamma ** (epoch + at_epoch_end)
        if plateau:
            assert calls[epoch] == {monitor: score}


# --------------------------------------------------------------------------- where and how many


def _non_string_body(tmp, arm, save_top_k):
    callback = ModelCheckpoint(monitor="early_stop_on", dirpath=None, filename="{epoch}", save_top_k=save_top_k)
    trainer(arm, default_root_dir=tmp, callbacks=[callback], overfit_batches=0.20, max_epochs=2,
            logger=False).fit(LogInTwoMethods())
    return callback.dirpath


@pytest.mark.parametrize("save_top_k, arm", [(-1, "zeroq_stage_1"), (0, "zeroq_stage_2"),
                                             (1, "stage3_freed"), (2, "zeroq_stage_3")])
def test_model_checkpoint_with_non_string_input(dist_pool, tmp_path, save_top_k, arm):
    dirpath = run(dist_pool(2), _non_string_body, str(tmp_path), arm, save_top_k)[0]
    assert dirpath == str(tmp_path / "checkpoints")
    if save_top_k == -1:
        expected = [f"epoch={i}.ckpt" for i in range(2)]
        assert len(os.listdir(dirpath)) == len(expected) == 2
        assert _listdir(dirpath) == set(expected)


def _to_yaml_body(tmp, arm, save_top_k):
    import yaml

    callback = ModelCheckpoint(dirpath=tmp, monitor="early_stop_on", save_top_k=save_top_k)
    trainer(arm, default_root_dir=tmp, callbacks=[callback], overfit_batches=0.20, max_epochs=2).fit(LogInTwoMethods())
    if _rank0():
        path = Path(tmp) / "best_k_models.yaml"
        callback.to_yaml(path)
        with open(path) as f:
            assert yaml.full_load(f) == dict(callback.best_k_models.items())


@pytest.mark.parametrize("save_top_k, arm", [(-1, "stage3_freed"), (0, "zeroq_stage_1"),
                                             (1, "zeroq_stage_2"), (2, "stage3_freed")])
def test_model_checkpoint_to_yaml(dist_pool, tmp_path, save_top_k, arm):
    run(dist_pool(2), _to_yaml_body, str(tmp_path), arm, save_top_k)


def _path_body(tmp, arm, version):
    # CSVLogger where the original has TensorBoardLogger (not installed): the same version naming
    t = trainer(arm, default_root_dir=tmp, overfit_batches=0.2, max_epochs=2, logger=CSVLogger(tmp, version=version))
    t.fit(LogInTwoMethods())
    return Path(t.checkpoint_callback.dirpath).parent.name


@pytest.mark.parametrize("version, expected, arm", [(None, "version_0", "zeroq_stage_1"), (1, "version_1", "zeroq_stage_2"),
                                                    ("awesome", "awesome", "stage3_freed")])
def test_model_checkpoint_path(dist_pool, tmp_path, version, expected, arm):
    assert run(dist_pool(2), _path_body, str(tmp_path), arm, version) == [expected, expected]


class _CountingCheckpoint(ModelCheckpoint):
    """Counts the callback's state_dict calls and the strategy's saves (the original counts
    ``torch.save`` on rank 0; a zeroq save is a collective every rank takes part in)."""

    def __init__(self, expected_count, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.expected_count, self.state_dict_count, self.saves = expected_count, 0, 0

    def on_train_start(self, trainer, pl_module):
        original = trainer.strategy.save_checkpoint

        def counted(*args, **kwargs):
            self.saves += 1
            return original(*args, **kwargs)

        trainer.strategy.save_checkpoint = counted

    def state_dict(self):
        super().state_dict()
        self.state_dict_count += 1

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        assert self.best_model_path
        assert self.best_model_score
        assert self.state_dict_count == self.expected_count
        assert self.saves == self.expected_count


def _invocations_body(tmp, arm):
    epochs = 4
    callback = _CountingCheckpoint(monitor="early_stop_on", expected_count=epochs, save_top_k=-1)
    t = trainer(arm, default_root_dir=tmp, callbacks=[callback], max_epochs=epochs)
    t.fit(LogInTwoMethods())
    assert t.state.finished, f"Training failed with {t.state}"


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_model_checkpoint_no_extraneous_invocations(dist_pool, tmp_path, arm):
    run(dist_pool(2), _invocations_body, str(tmp_path), arm)


class _Tpkc(ModelCheckpoint):
    FILE_EXTENSION = ".tpkc"


def _extension_body(tmp, arm):
    callback = _Tpkc(monitor="early_stop_on", dirpath=tmp, save_top_k=1, save_last=True)
    trainer(arm, default_root_dir=tmp, callbacks=[callback], max_steps=1, logger=False).fit(LogInTwoMethods())


@pytest.mark.parametrize("arm", ["stage3_freed"])
def test_model_checkpoint_file_extension(dist_pool, tmp_path, arm):
    run(dist_pool(2), _extension_body, str(tmp_path), arm)
    assert {"epoch=0-step=1.tpkc", "last.tpkc"} == _listdir(tmp_path)


def _save_last_body(tmp, arm, save_last):
    seed_everything()
    with mock.patch.object(ModelCheckpoint, "CHECKPOINT_NAME_LAST", "last-{epoch}"):
        callback = ModelCheckpoint(monitor="early_stop_on", dirpath=tmp, save_top_k=-1, save_last=save_last)
        t = trainer(arm, default_root_dir=tmp, callbacks=[callback], max_epochs=3, limit_train_batches=10,
                    limit_val_batches=10, logger=False)
        t.fit(LogInTwoMethods())
        last = callback._format_checkpoint_name(ModelCheckpoint.CHECKPOINT_NAME_LAST,
                                                {"epoch": t.current_epoch - 1}) + ".ckpt"
    return last, callback.last_model_path, callback._last_checkpoint_saved


@pytest.mark.parametrize("arm", [*STAGES, "zeroq_stage_3", "stage2_offload", "stage3_freed_offload_spec"])
@pytest.mark.parametrize("save_last", [True, "link"])
def test_model_checkpoint_save_last(dist_pool, tmp_path, save_last, arm):
    last, last_model_path, last_saved = run(dist_pool(2), _save_last_body, str(tmp_path), arm, save_last)[0]
    assert str(tmp_path / last) == last_model_path
    assert _listdir(tmp_path) == {f"epoch={i}-step={j}.ckpt" for i, j in zip(range(3), [10, 20, 30])} | {last}
    if save_last == "link":
        assert os.path.islink(tmp_path / last)
    else:
        assert is_checkpoint(tmp_path / last) and not os.path.islink(tmp_path / last)
    assert os.path.realpath(tmp_path / last) == last_saved


def _not_alternating_body(tmp, arm):
    class ListDir(Boring):
        def on_train_epoch_start(self):
            if self.current_epoch > 0:
                assert os.listdir(tmp) == ["model.ckpt"]

    callback = ModelCheckpoint(dirpath=tmp, monitor=None, save_top_k=1, filename="model")
    trainer(arm, callbacks=callback, limit_train_batches=1, limit_val_batches=0, max_epochs=3,
            logger=False).fit(ListDir())


@pytest.mark.parametrize("arm", STAGES)
def test_none_monitor_not_alternating(dist_pool, tmp_path, arm):
    run(dist_pool(2), _not_alternating_body, str(tmp_path), arm)


def _last_none_monitor_body(tmp, arm):
    seed_everything()
    callback = ModelCheckpoint(monitor=None, dirpath=tmp, save_top_k=-1, save_last=True)
    trainer(arm, default_root_dir=tmp, callbacks=[callback], limit_train_batches=10, limit_val_batches=10,
            max_epochs=2, logger=False).fit(LogInTwoMethods())
    assert callback.monitor is None
    assert callback.best_model_path == str(Path(tmp) / "epoch=1-step=20.ckpt")
    assert callback.last_model_path == str(Path(tmp) / "last.ckpt")
    assert callback.best_model_score is None
    assert callback.best_k_models == {}
    assert callback.kth_best_model_path == ""


@pytest.mark.parametrize("arm", ["zeroq_stage_1"])
def test_model_checkpoint_save_last_none_monitor(dist_pool, tmp_path, arm):
    run(dist_pool(2), _last_none_monitor_body, str(tmp_path), arm)
    assert _listdir(tmp_path) == {"epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "last.ckpt"}
    assert is_checkpoint(tmp_path / "last.ckpt")


def _every_n_epochs_body(tmp, arm, every_n_epochs):
    callback = ModelCheckpoint(dirpath=tmp, filename="{epoch}", save_top_k=-1, every_n_epochs=every_n_epochs)
    trainer(arm, default_root_dir=tmp, callbacks=[callback], max_epochs=5, limit_train_batches=1,
            limit_val_batches=1, logger=False).fit(LogInTwoMethods())


@pytest.mark.parametrize("every_n_epochs, arm", [(0, "zeroq_stage_1"), (1, "zeroq_stage_2"),
                                                 (2, "stage3_freed"), (3, "zeroq_stage_3")])
def test_model_checkpoint_every_n_epochs(dist_pool, tmp_path, every_n_epochs, arm):
    run(dist_pool(2), _every_n_epochs_body, str(tmp_path), arm, every_n_epochs)
    expected = {f"epoch={e}.ckpt" for e in range(5) if not (e + 1) % every_n_epochs} if every_n_epochs > 0 else set()
    assert _listdir(tmp_path) == expected


def _every_n_steps_body(tmp, arm):
    callback = ModelCheckpoint(filename="{step}", every_n_epochs=0, every_n_train_steps=16, dirpath=tmp,
                               save_top_k=-1, save_last=False)
    trainer(arm, default_root_dir=tmp, max_epochs=2, callbacks=[callback], logger=False).fit(LogInTwoMethods())


@pytest.mark.parametrize("arm", ["stage3_freed"])
def test_ckpt_every_n_train_steps(dist_pool, tmp_path, arm):
    run(dist_pool(2), _every_n_steps_body, str(tmp_path), arm)
    assert _listdir(tmp_path) == {f"step={i}.ckpt" for i in range(16, 2 * 64 + 1, 16)}


# --------------------------------------------------------------------------- saving on an exception


def _raise_when(flag: bool) -> None:
    if flag:
        raise RuntimeError("Trouble!")


def _sanity_check_body(tmp, arm):
    class Troubled(Boring):
        def on_validation_start(self):
            _raise_when(self.trainer.sanity_checking)

    callback = ModelCheckpoint(dirpath=tmp, filename="sanity_check", save_on_exception=True)
    t = trainer(arm, default_root_dir=tmp, num_sanity_val_steps=4, limit_train_batches=2, callbacks=[callback],
                max_epochs=2, logger=False)
    with pytest.raises(RuntimeError, match="Trouble!"):
        t.fit(Troubled())


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_model_checkpoint_on_exception_run_condition_on_validation_start(dist_pool, tmp_path, arm):
    run(dist_pool(2), _sanity_check_body, str(tmp_path), arm)
    assert not os.path.exists(tmp_path / "exception-sanity_check.ckpt")


def _fast_dev_run_body(tmp, arm):
    class Troubled(Boring):
        def on_train_batch_start(self, batch, batch_idx):
            _raise_when(bool(self.trainer.fast_dev_run) and batch_idx == 1)

    callback = ModelCheckpoint(dirpath=tmp, filename="fast_dev_run", save_on_exception=True)
    t = trainer(arm, default_root_dir=tmp, fast_dev_run=2, limit_train_batches=2, callbacks=[callback], max_epochs=2,
                logger=False)
    with pytest.raises(RuntimeError, match="Trouble!"):
        t.fit(Troubled())


@pytest.mark.parametrize("arm", ["stage3_freed"])
def test_model_checkpoint_on_exception_fast_dev_run_on_train_batch_start(dist_pool, tmp_path, arm):
    run(dist_pool(2), _fast_dev_run_body, str(tmp_path), arm)
    assert not os.path.exists(tmp_path / "exception-fast_dev_run.ckpt")


def _already_saved_body(tmp, arm):
    class Troubled(Boring):
        def on_train_batch_start(self, batch, batch_idx):
            _raise_when(self.trainer.global_step == 1)

    callback = ModelCheckpoint(dirpath=tmp, filename="already_saved", save_on_exception=True, every_n_train_steps=1)
    t = trainer(arm, default_root_dir=tmp, limit_train_batches=2, callbacks=[callback], max_epochs=2, logger=False)
    with pytest.raises(RuntimeError, match="Trouble!"):
        t.fit(Troubled())


@pytest.mark.parametrize("arm", ["zeroq_stage_1"])
def test_model_checkpoint_on_exception_run_condition_on_train_batch_start(dist_pool, tmp_path, arm):
    run(dist_pool(2), _already_saved_body, str(tmp_path), arm)
    assert not os.path.exists(tmp_path / "exception-already_saved.ckpt")
    assert is_checkpoint(tmp_path / "already_saved.ckpt")


# Where the original's troubled models and callbacks raise: the hook, and when (from its arguments).
def _epoch1(owner, *args):
    return _trainer_of(owner).current_epoch == 1


def _batch1(owner, *args):
    return _batch_idx(args) == 1


def _val_batch1(owner, *args):
    return not _trainer_of(owner).sanity_checking and _batch_idx(args) == 1


def _val_epoch1(owner, *args):
    return not _trainer_of(owner).sanity_checking and _trainer_of(owner).current_epoch == 1


def _not_sanity(owner, *args):
    return not _trainer_of(owner).sanity_checking


def _always(owner, *args):
    return True


def _trainer_of(owner):
    return owner if not hasattr(owner, "trainer") else owner.trainer


def _batch_idx(args):
    return args[-1]


TROUBLED_MODEL_HOOKS = {
    "training_step": _batch1, "validation_step": _val_batch1, "backward": _epoch1, "on_before_backward": _epoch1,
    "on_after_backward": _epoch1, "on_before_zero_grad": _epoch1, "on_fit_end": _always, "on_train_end": _always,
    "on_validation_start": _val_epoch1, "on_validation_end": _not_sanity, "on_train_batch_start": _batch1,
    "on_train_batch_end": _batch1, "on_train_epoch_start": _epoch1, "on_train_epoch_end": _epoch1,
    "on_validation_batch_start": _val_batch1, "on_validation_batch_end": _val_batch1,
    "on_validation_epoch_start": _val_epoch1, "on_validation_epoch_end": _val_epoch1,
    "on_validation_model_eval": _val_epoch1, "on_validation_model_train": _val_epoch1,
    "on_before_optimizer_step": _epoch1, "configure_gradient_clipping": _epoch1, "optimizer_step": _epoch1,
    "optimizer_zero_grad": _epoch1,
}
TROUBLED_CALLBACK_HOOKS = {
    "on_fit_end": _always, "on_train_batch_start": _batch1, "on_train_batch_end": _batch1,
    "on_train_epoch_start": _epoch1, "on_train_epoch_end": _epoch1, "on_validation_epoch_start": _val_epoch1,
    "on_validation_epoch_end": _val_epoch1, "on_validation_batch_start": _val_batch1,
    "on_validation_batch_end": _val_batch1, "on_train_end": _always, "on_validation_start": _not_sanity,
    "on_validation_end": _not_sanity, "on_before_backward": _epoch1, "on_after_backward": _epoch1,
    "on_before_optimizer_step": _epoch1, "on_before_zero_grad": _epoch1,
}


def _troubled_model(hook: str):
    when = TROUBLED_MODEL_HOOKS[hook]

    def troubled(self, *args, **kwargs):
        if hook == "optimizer_step":  # the original steps, then raises
            args[2].step(closure=args[3] if len(args) > 3 else kwargs.get("optimizer_closure"))
            _raise_when(when(self, *args))
            return None
        _raise_when(when(self, *args))
        if hook == "validation_step":
            return None
        # training_step: the original returns None on the other batch, which Lightning refuses on several
        # processes (under DDP too); the loss is returned instead
        return getattr(Boring, hook)(self, *args, **kwargs)

    return type(f"Troubled_{hook}", (Boring,), {hook: troubled})


def _troubled_callback(hook: str):
    when = TROUBLED_CALLBACK_HOOKS[hook]

    def troubled(self, trainer, pl_module, *args):
        _raise_when(when(trainer, *args))

    return type(f"Troubled_{hook}", (Callback,), {hook: troubled})()


def _on_exception_body(tmp, arm, model_hook, callback_hook):
    model = _troubled_model(model_hook)() if model_hook else Boring()
    callback = ModelCheckpoint(dirpath=tmp, filename="exception", save_on_exception=True, every_n_epochs=7)
    callbacks = [callback] + ([_troubled_callback(callback_hook)] if callback_hook else [])
    t = trainer(arm, default_root_dir=tmp, callbacks=callbacks, limit_train_batches=2, max_epochs=4, logger=False)
    with pytest.raises(RuntimeError, match="Trouble!"):
        t.fit(model)


def _check_exception_checkpoint(tmp_path):
    path = tmp_path / "exception.ckpt"
    assert is_checkpoint(path)
    ckpt = read(path)
    assert ckpt["state_dict"] is not None
    assert ckpt["state_dict"] != {}


@pytest.mark.parametrize("hook", list(TROUBLED_MODEL_HOOKS))
def test_model_checkpoint_on_exception_parametrized(dist_pool, tmp_path, hook):
    arm = STAGES[list(TROUBLED_MODEL_HOOKS).index(hook) % 3]
    run(dist_pool(2), _on_exception_body, str(tmp_path), arm, hook, None)
    _check_exception_checkpoint(tmp_path)


@pytest.mark.parametrize("hook", list(TROUBLED_CALLBACK_HOOKS))
def test_model_checkpoint_on_exception_in_other_callbacks(dist_pool, tmp_path, hook):
    arm = STAGES[list(TROUBLED_CALLBACK_HOOKS).index(hook) % 3]
    run(dist_pool(2), _on_exception_body, str(tmp_path), arm, None, hook)
    _check_exception_checkpoint(tmp_path)


# --------------------------------------------------------------------------- top-k, last, versions


def _time_interval_body(tmp, arm):
    import time

    start, per_batch = time.monotonic(), 7
    with mock.patch("lightning.pytorch.callbacks.model_checkpoint.time") as clock:
        clock.monotonic.side_effect = [start + per_batch * i for i in range(64 * 2 + 1)]
        callback = ModelCheckpoint(filename="{epoch}-{step}", dirpath=tmp, train_time_interval=timedelta(minutes=1),
                                   save_top_k=-1, save_last=False)
        trainer(arm, default_root_dir=tmp, min_epochs=2, max_epochs=2, callbacks=[callback],
                logger=False).fit(Boring())


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_model_checkpoint_train_time_interval(dist_pool, tmp_path, arm):
    # 7 s a batch, a checkpoint every minute, 2 x 64 batches: 14 checkpoints
    run(dist_pool(2), _time_interval_body, str(tmp_path), arm)
    assert len(os.listdir(tmp_path)) == 14


def _topk_zero_body(tmp, arm):
    callback = ModelCheckpoint(dirpath=tmp, save_top_k=0, save_last=True)
    trainer(arm, default_root_dir=tmp, callbacks=[callback], max_epochs=2, logger=False).fit(LogInTwoMethods())
    assert callback.monitor is None
    assert callback.best_model_path == ""
    assert callback.best_model_score is None
    assert callback.best_k_models == {}
    assert callback.kth_best_model_path == ""
    assert callback.last_model_path == str(Path(tmp) / "last.ckpt")
    assert not os.path.islink(callback.last_model_path)  # nothing to link to


@pytest.mark.parametrize("arm", ["stage3_freed"])
def test_model_checkpoint_topk_zero(dist_pool, tmp_path, arm):
    run(dist_pool(2), _topk_zero_body, str(tmp_path), arm)
    assert os.listdir(tmp_path) == ["last.ckpt"]


def _topk_all_body(tmp, arm):
    seed_everything(1000)
    callback = ModelCheckpoint(dirpath=tmp, filename="{epoch}", monitor="epoch", mode="max", save_top_k=-1)
    trainer(arm, default_root_dir=tmp, callbacks=[callback], max_epochs=3, logger=False,
            val_check_interval=1.0).fit(Boring())
    tmp = Path(tmp)
    assert callback.monitor == "epoch"
    assert callback.best_model_path == str(tmp / "epoch=2.ckpt")
    assert callback.best_model_score == 2
    assert len(callback.best_k_models) == 3
    assert set(callback.best_k_models) == {str(tmp / f"epoch={i}.ckpt") for i in range(3)}
    assert callback.kth_best_model_path == str(tmp / "epoch=0.ckpt")


@pytest.mark.parametrize("arm", [*STAGES, "zeroq_stage_3"])
def test_model_checkpoint_topk_all(dist_pool, tmp_path, arm):
    run(dist_pool(2), _topk_all_body, str(tmp_path), arm)
    assert len(os.listdir(tmp_path)) == 3


def _metric_names_body(tmp, arm):
    trainer(arm, default_root_dir=tmp, max_epochs=1, gradient_clip_val=1.0, overfit_batches=0.20,
            limit_train_batches=0.01, limit_val_batches=0.01,
            callbacks=[ModelCheckpoint(monitor="early_stop_on", dirpath=tmp, filename="{val_loss:.2f}")]
            ).fit(LogInTwoMethods())


@pytest.mark.parametrize("arm", ["zeroq_stage_1"])
def test_ckpt_metric_names(dist_pool, tmp_path, arm):
    run(dist_pool(2), _metric_names_body, str(tmp_path), arm)
    names = [x for x in os.listdir(tmp_path) if "val_loss" in x]
    assert len(names) == 1
    assert len(re.sub("[^0-9.]", "", names[0])) > 3


def _default_behavior_body(tmp, arm):
    from unittest.mock import call

    seed_everything(1234)
    t = trainer(arm, default_root_dir=tmp, max_epochs=3, limit_train_batches=5, limit_val_batches=5, logger=False)
    with mock.patch.object(t, "save_checkpoint", wraps=t.save_checkpoint) as save:
        t.fit(LogInTwoMethods())
        results = t.test()
    assert len(results) == 1
    where, weights_only = Path(tmp) / "checkpoints", t.checkpoint_callback.save_weights_only
    save.assert_has_calls([call(str(where / f"epoch={e}-step={s}.ckpt"), weights_only)
                           for e, s in [(0, 5), (1, 10), (2, 15)]])


@pytest.mark.parametrize("arm", STAGES)
def test_default_checkpoint_behavior(dist_pool, tmp_path, arm):
    # trainer.test() after fit loads the best checkpoint into the finished strategy
    run(dist_pool(2), _default_behavior_body, str(tmp_path), arm)
    assert os.listdir(tmp_path / "checkpoints") == ["epoch=2-step=15.ckpt"]


def _last_contents_body(tmp, arm):
    seed_everything(100)
    callback = ModelCheckpoint(monitor="early_stop_on", dirpath=tmp, filename="{epoch}", save_top_k=3, save_last=True)
    trainer(arm, default_root_dir=tmp, callbacks=[callback], max_epochs=3, limit_train_batches=2,
            limit_val_batches=2).fit(LogInTwoMethods())
    return callback.last_model_path


@pytest.mark.parametrize("arm", [*STAGES, "zeroq_stage_3", "stage2_offload", "stage3_freed_offload_spec"])
def test_model_checkpoint_save_last_checkpoint_contents(dist_pool, tmp_path, arm):
    last_model_path = run(dist_pool(2), _last_contents_body, str(tmp_path), arm)[0]
    at_last_epoch, last = tmp_path / "epoch=2.ckpt", tmp_path / "last.ckpt"
    assert str(last) == last_model_path
    assert is_checkpoint(at_last_epoch)
    assert is_checkpoint(last)
    a, b = read(at_last_epoch), read(last)
    assert a["epoch"] == b["epoch"]
    assert a["global_step"] == b["global_step"]
    assert b["callbacks"][_key("early_stop_on")] == a["callbacks"][_key("early_stop_on")]
    # loading the model objects, as the original does, in this process (no process group)
    m_epoch, m_last = LogInTwoMethods.load_from_checkpoint(at_last_epoch), LogInTwoMethods.load_from_checkpoint(last)
    for w0, w1 in zip(m_epoch.parameters(), m_last.parameters()):
        assert w0.eq(w1).all()


class _ValLoss(Boring):
    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val_loss", loss)
        return {"val_loss": loss}


def _repeated_body(tmp, arm):
    callback = ModelCheckpoint(monitor="val_loss", dirpath=tmp, filename="{epoch:02d}")
    kwargs = dict(max_epochs=1, limit_train_batches=2, limit_val_batches=2, limit_test_batches=2,
                  log_every_n_steps=1, default_root_dir=tmp, logger=CSVLogger(tmp))
    model = _ValLoss()
    trainer(arm, **kwargs, callbacks=[callback]).fit(model)
    assert _listdir(tmp) == {"epoch=00.ckpt", "lightning_logs"}
    for _ in range(4):
        t = trainer(arm, **kwargs)
        t.fit(model, ckpt_path=callback.best_model_path)
        t.test(ckpt_path=callback.best_model_path, verbose=False)
        assert _listdir(tmp) == {"epoch=00.ckpt", "lightning_logs"}
    assert _listdir(Path(tmp) / "lightning_logs") == {"version_0"}  # the resumed fits log nothing


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_checkpoint_repeated_strategy(dist_pool, tmp_path, arm):
    run(dist_pool(2), _repeated_body, str(tmp_path), arm)


def _repeated_extended_body(tmp, arm):
    epochs, batches, ckpt_dir, tmp = 2, 2, Path(tmp) / "checkpoints", Path(tmp)

    def at_start(t):
        assert t.global_step == 0
        assert t.current_epoch == 0

    def finished(t):
        assert t.global_step == epochs * batches
        assert t.current_epoch == epochs

    def newest():
        return str(sorted(ckpt_dir.iterdir())[-1])

    def log_dirs(idx):
        assert [d.name for d in sorted((tmp / "lightning_logs").iterdir())] == [f"version_{i}" for i in range(idx + 1)]
        assert len(list(ckpt_dir.iterdir())) == epochs

    config = dict(default_root_dir=tmp, max_epochs=epochs, limit_train_batches=batches, limit_val_batches=3,
                  limit_test_batches=4, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)])
    t = trainer(arm, **config, logger=CSVLogger(tmp))
    at_start(t)
    model = _ValLoss()
    t.fit(model)
    finished(t)
    log_dirs(0)
    dist.barrier()
    newest_paths = [newest()]
    t.validate(model)
    assert t.current_epoch == epochs
    t.test(model)
    assert t.current_epoch == epochs
    for idx in range(1, 5):
        chk = newest()
        newest_paths.append(chk)
        t = trainer(arm, **config, logger=CSVLogger(tmp))
        at_start(t)
        model = _ValLoss()
        t.test(model)
        at_start(t)
        t.fit(model, ckpt_path=chk)
        finished(t)
        assert t.fit_loop.epoch_progress.current.processed == epochs
        t.validate(model)
        finished(t)
        assert t.fit_loop.epoch_progress.current.processed == epochs
        t.fit(model)
        finished(t)
        assert t.fit_loop.epoch_progress.current.processed == epochs
        log_dirs(idx)
    return newest_paths


@pytest.mark.parametrize("arm", ["stage3_freed"])
def test_checkpoint_repeated_strategy_extended(dist_pool, tmp_path, arm):
    # the content of the newest checkpoint, read here after the run (the original reads it in the loop;
    # nothing in the loop writes a checkpoint: every resumed fit has finished already)
    for path in run(dist_pool(2), _repeated_extended_body, str(tmp_path), arm)[0]:
        ckpt = read(path)
        assert ckpt["epoch"] == 2 - 1  # saved at the end of the last epoch, before current_epoch advances
        assert ckpt["global_step"] == 4


def _val_interval_files_body(tmp, arm):
    callback = ModelCheckpoint(dirpath=tmp, save_top_k=-1, monitor="val_acc", mode="max")
    trainer(arm, default_root_dir=tmp, val_check_interval=0.2, max_epochs=1, limit_train_batches=10,
            callbacks=[callback], logger=False).fit(LogInTwoMethods())


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_val_check_interval_checkpoint_files(dist_pool, tmp_path, arm):
    run(dist_pool(2), _val_interval_files_body, str(tmp_path), arm)
    assert {p.name for p in tmp_path.iterdir()} == {f"epoch=0-step={s}.ckpt" for s in [2, 4, 6, 8, 10]}


def _current_score_body(tmp, arm):
    class Model(Boring):
        def training_step(self, *args):
            self.log("foo", (self.current_epoch + 1) / 10)
            return super().training_step(*args)

    callback = ModelCheckpoint(dirpath=tmp, save_top_k=3, monitor="foo", mode="min")
    trainer(arm, default_root_dir=tmp, max_epochs=3, limit_train_batches=1, limit_val_batches=1,
            callbacks=[callback], logger=False).fit(Model())
    assert callback.current_score == 0.3


@pytest.mark.parametrize("arm", ["stage3_freed", "zeroq_stage_1"])
def test_current_score(dist_pool, tmp_path, arm):
    run(dist_pool(2), _current_score_body, str(tmp_path), arm)
    key = ("ModelCheckpoint{'monitor': 'foo', 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1,"
           " 'train_time_interval': None}")
    scores = sorted(read(p)["callbacks"][key]["current_score"] for p in tmp_path.iterdir())
    assert scores == [0.1, 0.2, 0.3]


def _nan_score_body(tmp, arm, mode):
    class Model(Boring):
        def training_step(self, *args):
            self.log("foo", float("nan"))
            return super().training_step(*args)

    callback = ModelCheckpoint(dirpath=tmp, save_top_k=1, monitor="foo", mode=mode)
    trainer(arm, default_root_dir=tmp, max_epochs=1, limit_train_batches=1, limit_val_batches=1,
            callbacks=[callback], logger=False).fit(Model())
    expected = float("inf" if mode == "min" else "-inf")
    assert callback.best_model_score == expected
    assert callback.current_score == expected


@pytest.mark.parametrize("mode, arm", [("min", "zeroq_stage_2"), ("max", "stage3_freed")])
def test_current_score_when_nan(dist_pool, tmp_path, mode, arm):
    run(dist_pool(2), _nan_score_body, str(tmp_path), arm, mode)


def _hparams_body(tmp, arm, use_omegaconf):
    from argparse import Namespace

    class Model(Boring):
        def __init__(self, hparams):
            super().__init__()
            self.save_hyperparameters(hparams)

    t = trainer(arm, max_epochs=1, default_root_dir=tmp, limit_train_batches=1, limit_val_batches=1,
                callbacks=[ModelCheckpoint(dirpath=tmp, save_top_k=1)], logger=False)
    hp = {"test_hp_0": 1, "test_hp_1": 2}
    if use_omegaconf:
        from omegaconf import OmegaConf

        hp = OmegaConf.create(hp)
    else:
        hp = Namespace(**hp)
    model = Model(hp)
    t.fit(model)
    ckpt = t._checkpoint_connector.dump_checkpoint()
    if use_omegaconf:
        from omegaconf import Container

        assert isinstance(ckpt[model.CHECKPOINT_HYPER_PARAMS_KEY], Container)
    else:
        assert type(ckpt[model.CHECKPOINT_HYPER_PARAMS_KEY]) is dict  # not an AttributeDict


@pytest.mark.parametrize("use_omegaconf, arm", [(False, "zeroq_stage_1"), (True, "stage3_freed")])
def test_hparams_type(dist_pool, tmp_path, use_omegaconf, arm):
    run(dist_pool(2), _hparams_body, str(tmp_path), arm, use_omegaconf)


def _short(arm, tmp, **kwargs):
    return trainer(arm, limit_train_batches=1, limit_val_batches=1, default_root_dir=tmp, logger=False, **kwargs)


def _rerun_new_trainer_body(tmp, arm):
    for i in range(2):
        mc = ModelCheckpoint(dirpath=tmp, save_top_k=-1, monitor="epoch", filename="{epoch}")
        _short(arm, tmp, max_epochs=2, callbacks=[mc]).fit(Boring())
        expected = {"epoch=0-v1.ckpt", "epoch=1-v1.ckpt"} if i else {"epoch=0.ckpt", "epoch=1.ckpt"}
        assert {Path(f).name for f in mc.best_k_models} == expected


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_ckpt_version_after_rerun_new_trainer(dist_pool, tmp_path, arm):
    run(dist_pool(2), _rerun_new_trainer_body, str(tmp_path), arm)
    assert _listdir(tmp_path) == {"epoch=0.ckpt", "epoch=1.ckpt", "epoch=0-v1.ckpt", "epoch=1-v1.ckpt"}


def _rerun_same_trainer_body(tmp, arm):
    mc = ModelCheckpoint(dirpath=tmp, save_top_k=-1, monitor="epoch", filename="test")
    mc.STARTING_VERSION = 9
    t = _short(arm, tmp, max_epochs=2, callbacks=[mc])
    t.fit(Boring())
    t.fit_loop.max_epochs = 4
    t.fit(Boring())
    expected = {"test.ckpt", *(f"test-v{i}.ckpt" for i in range(9, t.max_epochs + 9 - 1))}
    assert {Path(f).name for f in mc.best_k_models} == expected
    return sorted(expected)


@pytest.mark.parametrize("arm", ["stage3_freed"])
def test_ckpt_version_after_rerun_same_trainer(dist_pool, tmp_path, arm):
    expected = run(dist_pool(2), _rerun_same_trainer_body, str(tmp_path), arm)[0]
    assert _listdir(tmp_path) == set(expected)


def _counter_disabled_body(tmp, arm):
    for _ in range(2):
        mc = ModelCheckpoint(dirpath=tmp, save_top_k=-1, save_last=True, monitor="epoch", filename="{epoch}",
                             enable_version_counter=False)
        _short(arm, tmp, max_epochs=2, callbacks=[mc]).fit(Boring())
        assert {Path(f).name for f in mc.best_k_models} == {"epoch=0.ckpt", "epoch=1.ckpt"}
        assert Path(mc.last_model_path).name == "last.ckpt"


@pytest.mark.parametrize("arm", ["zeroq_stage_1", "stage3_freed"])
def test_ckpt_version_counter_disabled_after_rerun_new_trainer(dist_pool, tmp_path, arm):
    # the same names written again: a zeroq save replaces an existing checkpoint directory
    run(dist_pool(2), _counter_disabled_body, str(tmp_path), arm)
    assert _listdir(tmp_path) == {"epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"}


def _val_every_n_body(tmp, arm):
    mc = ModelCheckpoint(dirpath=tmp, monitor="epoch", save_top_k=-1, filename="{epoch}")
    _short(arm, tmp, num_sanity_val_steps=0, max_epochs=5, check_val_every_n_epoch=2, callbacks=mc).fit(Boring())


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_check_val_every_n_epochs_top_k_integration(dist_pool, tmp_path, arm):
    run(dist_pool(2), _val_every_n_body, str(tmp_path), arm)
    assert _listdir(tmp_path) == {"epoch=1.ckpt", "epoch=3.ckpt"}


# --------------------------------------------------------------------------- resuming


def _preserves_last_body(tmp, arm):
    tmp = Path(tmp)
    model = Boring()
    kwargs = dict(default_root_dir=tmp, max_epochs=1, limit_train_batches=3, limit_val_batches=0, logger=False)
    mc = dict(filename="{step}", monitor="step", mode="max", save_last=True, save_top_k=2, every_n_train_steps=1)
    trainer(arm, **kwargs, callbacks=ModelCheckpoint(**mc)).fit(model)
    assert _listdir(tmp / "checkpoints") == {"last.ckpt", "step=2.ckpt", "step=3.ckpt"}
    dist.barrier()
    kwargs["max_epochs"] += 1
    trainer(arm, **kwargs, callbacks=ModelCheckpoint(**mc, dirpath=tmp / "new")).fit(
        model, ckpt_path=tmp / "checkpoints" / "step=2.ckpt")


@pytest.mark.parametrize("arm", STAGES)
def test_resume_training_preserves_old_ckpt_last(dist_pool, tmp_path, arm):
    run(dist_pool(2), _preserves_last_body, str(tmp_path), arm)
    assert is_checkpoint(tmp_path / "checkpoints" / "last.ckpt")


def _last_path_body(tmp, arm):
    mc = ModelCheckpoint(dirpath=tmp, save_last=True)
    mc.CHECKPOINT_NAME_LAST = "{foo}-last"
    t = trainer(arm, callbacks=mc, max_steps=0, limit_val_batches=0, logger=False)
    t.fit(Boring())  # the original only connects the model: a zeroq save needs the strategy set up
    mc._save_last_checkpoint(t, {"foo": torch.tensor(1)})
    return mc.state_key


@pytest.mark.parametrize("arm", ["zeroq_stage_1"])
def test_save_last_saves_correct_last_model_path(dist_pool, tmp_path, arm):
    state_key = run(dist_pool(2), _last_path_body, str(tmp_path), arm)[0]
    expected = "foo=1-last.ckpt"
    assert os.listdir(tmp_path) == [expected]
    assert read(tmp_path / expected)["callbacks"][state_key]["last_model_path"] == str(tmp_path / expected)


def _last_versioning_body(tmp, arm):
    model = Boring()
    for _ in range(2):
        mc = ModelCheckpoint(dirpath=tmp, save_top_k=0, save_last=True)
        trainer(arm, max_epochs=2, callbacks=mc, limit_train_batches=1, limit_val_batches=0, logger=False).fit(model)


@pytest.mark.parametrize("arm", ["stage3_freed"])
def test_save_last_versioning(dist_pool, tmp_path, arm):
    run(dist_pool(2), _last_versioning_body, str(tmp_path), arm)
    assert {"last.ckpt", "last-v1.ckpt"} == _listdir(tmp_path)
    assert all(not os.path.islink(tmp_path / path) for path in os.listdir(tmp_path))


def _none_monitor_best_body(tmp, arm):
    mc = ModelCheckpoint(dirpath=tmp, monitor=None)
    t = trainer(arm, callbacks=mc, max_steps=0, limit_val_batches=0, logger=False)
    t.fit(Boring())  # the original only connects the model: a zeroq save needs the strategy set up
    mc._save_none_monitor_checkpoint(t, {})
    return mc.state_key


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_none_monitor_saves_correct_best_model_path(dist_pool, tmp_path, arm):
    state_key = run(dist_pool(2), _none_monitor_best_body, str(tmp_path), arm)[0]
    expected = "epoch=0-step=0.ckpt"
    assert os.listdir(tmp_path) == [expected]
    assert read(tmp_path / expected)["callbacks"][state_key]["best_model_path"] == str(tmp_path / expected)


def _old_files_remain_body(tmp, arm, same_folder):
    tmp = Path(tmp)
    model = Boring()
    kwargs = dict(default_root_dir=tmp, limit_train_batches=10, limit_val_batches=0, logger=False)
    first, second = tmp / "first", tmp / "second"
    mc = dict(monitor="step", mode="max", save_top_k=2, every_n_train_steps=2)
    trainer(arm, callbacks=ModelCheckpoint(dirpath=first, **mc), max_steps=5, **kwargs).fit(model)
    assert _listdir(first) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"}
    dist.barrier()
    trainer(arm, callbacks=ModelCheckpoint(dirpath=first if same_folder else second, **mc), max_steps=8,
            **kwargs).fit(model, ckpt_path=str(first / "epoch=0-step=4.ckpt"))


@pytest.mark.parametrize("same_folder, arm", [(True, "zeroq_stage_1"), (False, "stage3_freed"),
                                              (True, "zeroq_stage_3")])
def test_resume_and_old_checkpoint_files_remain(dist_pool, tmp_path, same_folder, arm):
    run(dist_pool(2), _old_files_remain_body, str(tmp_path), arm, same_folder)
    first, second = tmp_path / "first", tmp_path / "second"
    if same_folder:  # the one resumed from stays
        assert _listdir(first) == {"epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"}
    else:
        assert _listdir(first) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"}
        assert _listdir(second) == {"epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"}


def _inf_loader_body(tmp, arm):
    from lightning.pytorch.demos.boring_classes import RandomIterableDataset
    from torch.utils.data import DataLoader

    dataset = RandomIterableDataset(size=32, count=10)

    class Model(Boring):
        def train_dataloader(self):
            return DataLoader(dataset)

        def val_dataloader(self):
            return DataLoader(dataset)

    model = Model()
    with pytest.raises(TypeError):
        len(model.train_dataloader())
    kwargs = dict(default_root_dir=tmp, max_epochs=2, limit_train_batches=2, limit_val_batches=None,
                  check_val_every_n_epoch=1, logger=False)
    mc = dict(save_last=True, every_n_train_steps=1)
    trainer(arm, **kwargs, callbacks=ModelCheckpoint(**mc)).fit(model)
    path = Path(tmp) / "checkpoints" / "epoch=1-step=4.ckpt"
    assert path.name in os.listdir(Path(tmp) / "checkpoints")
    dist.barrier()
    kwargs["max_epochs"] = 4
    trainer(arm, **kwargs, callbacks=ModelCheckpoint(**mc)).fit(model, ckpt_path=path)


@pytest.mark.parametrize("arm", ["zeroq_stage_2"])
def test_load_with_inf_data_loader(dist_pool, tmp_path, arm):
    run(dist_pool(2), _inf_loader_body, str(tmp_path), arm)


def _last_without_val_body(tmp, arm):
    model = Boring()
    model.validation_step = None
    model.val_dataloader = None
    mc = ModelCheckpoint(dirpath=tmp, save_last=True, save_on_train_epoch_end=False)
    trainer(arm, max_epochs=2, callbacks=[mc], logger=False).fit(model)


@pytest.mark.parametrize("arm", ["stage3_freed"])
def test_save_last_without_save_on_train_epoch_and_without_val(dist_pool, tmp_path, arm):
    run(dist_pool(2), _last_without_val_body, str(tmp_path), arm)
    assert (tmp_path / "last.ckpt").exists()


def _last_only_when_saved_body(tmp, arm):
    class Selective(Boring):
        def __init__(self):
            super().__init__()
            self.outputs = []

        def validation_step(self, batch, batch_idx):
            out = super().validation_step(batch, batch_idx)
            epoch = self.trainer.current_epoch
            out["val_loss"] = torch.tensor(1.0 - epoch * 0.1) if epoch % 2 == 0 else torch.tensor(1.0 + epoch * 0.1)
            self.outputs.append(out)
            return out

        def on_validation_epoch_end(self):
            if self.outputs:
                self.log("val_loss", torch.stack([x["val_loss"] for x in self.outputs]).mean())
                self.outputs.clear()

    mc = ModelCheckpoint(dirpath=tmp, filename="best-{epoch}-{val_loss:.2f}", monitor="val_loss", save_last=True,
                         save_top_k=1, mode="min", every_n_epochs=1, save_on_train_epoch_end=False)
    trainer(arm, max_epochs=4, callbacks=[mc], logger=False, limit_train_batches=2, limit_val_batches=2,
            enable_checkpointing=True).fit(Selective())


@pytest.mark.parametrize("arm", ["zeroq_stage_1"])
def test_save_last_only_when_checkpoint_saved(dist_pool, tmp_path, arm):
    run(dist_pool(2), _last_only_when_saved_body, str(tmp_path), arm)
    names = [f.name for f in tmp_path.glob("*.ckpt")]
    assert "last.ckpt" in names, "last.ckpt should exist since checkpoints were saved"
    assert len(names) == 2, names  # the best checkpoint and last.ckpt


def test_every_original_case_is_ported_or_has_a_reason():
    assert_ported_or_explained(ORIGINAL, globals())
