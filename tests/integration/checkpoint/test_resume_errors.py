"""What a resumed fit says, and what it does with checkpoints that are not its own: step numbers in
errors count from the checkpoint's global step; a DCP directory without ZeroQ's trainer state (e.g.
saved by FSDP2 with ``dcp.save``) resumes its weights and optimizer state in ``fit`` and loads in
``load_from_checkpoint``; a single file refused by ``weights_only=True`` names a way that works."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq  # noqa: F401
from tests.models import make_lit_module
from tests.integration.checkpoint.test_reshard import S2, _first, _fit, _strategy

STEPS_PER_EPOCH = 4


class Opaque:
    """An object a trusted checkpoint may hold, which ``weights_only=True`` refuses."""

    def __init__(self, value: int = 0) -> None:
        self.value = value


def _fit_nan_after_resume(ckpt: str) -> str:
    import lightning as L

    from tests.models import TokenDataset

    module = make_lit_module()
    step = module.training_step
    module.training_step = lambda batch, batch_idx: step(batch, batch_idx) * float("nan")
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=_strategy(S2), max_epochs=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = torch.utils.data.DataLoader(TokenDataset(8 * STEPS_PER_EPOCH), batch_size=8 // dist.get_world_size())
    try:
        trainer.fit(module, data, ckpt_path=ckpt)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_an_error_after_a_resume_names_the_global_step(dist_pool, tmp_path):
    ckpt = str(tmp_path / "epoch1.ckpt")
    dist_pool(2).run(_first, S2, ckpt)
    messages = dist_pool(2).run(_fit_nan_after_resume, ckpt)
    for message in messages:  # the checkpoint holds 4 steps: the first step of this fit is the 5th
        assert f"in optimizer step {STEPS_PER_EPOCH + 1} " in message, message


def _foreign_save(path: str) -> dict:
    """A DCP directory as FSDP2 code writes it: ``dcp.save`` of ``get_state_dict``, no trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.models import make_batch

    torch.manual_seed(3)
    module = make_lit_module()
    opt = module.configure_optimizers()  # the same param groups as the fit below
    module.model.loss(make_batch(0, 0, 0)).backward()
    opt.step()
    msd, osd = get_state_dict(module, opt)
    dcp.save({"state_dict": msd, "optimizer_0": osd}, checkpoint_id=path)
    return {k: v.clone() for k, v in module.state_dict().items()}


def _resume_foreign_adam(path: str) -> list[int]:
    import lightning as L

    from tests.models import TokenDataset

    strategy = _strategy(S2)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = torch.utils.data.DataLoader(TokenDataset(8 * STEPS_PER_EPOCH), batch_size=8 // dist.get_world_size())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(make_lit_module(), data, ckpt_path=path)
    assert any("without ZeroQ's trainer state" in str(w.message) for w in caught) or dist.get_rank() != 0
    return sorted({int(s["step"]) for s in strategy.engine.full_optimizer_state().values()})


def test_a_foreign_dcp_directory_resumes_in_fit_and_loads_in_load_from_checkpoint(dist_pool, tmp_path):
    path = str(tmp_path / "fsdp2")
    saved = dist_pool(2).run(_foreign_save, path)[0]
    # fit: the optimizer state goes on (AdamW's step count 1 + this epoch's 4 for the parameters the
    # saved step updated; a fresh optimizer would count 4 at most), the loops start at 0
    assert max(dist_pool(2).run(_resume_foreign_adam, path)[0]) == 1 + STEPS_PER_EPOCH
    # load_from_checkpoint, one process: the saved weights
    module = type(make_lit_module()).load_from_checkpoint(path)
    for name, value in module.state_dict().items():
        assert torch.equal(value, saved[name]), name


def _fit_single_file(path: str, allow: bool) -> str:
    from tests.integration.checkpoint.test_reshard import _second

    if allow:
        torch.serialization.add_safe_globals([Opaque])
    try:
        _second(S2, path)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def test_a_refused_single_file_names_a_way_that_works(dist_pool, tmp_path):
    from lightning_zeroq.cli.convert import main

    directory, single = tmp_path / "zeroq.ckpt", tmp_path / "trusted.ckpt"
    dist_pool(2).run(_first, S2, str(directory))
    assert main([str(directory), str(single), "--optimizer"]) == 0
    checkpoint = torch.load(single, weights_only=True)
    checkpoint["trusted_extra"] = Opaque(3)
    torch.save(checkpoint, single)
    refused = dist_pool(2).run(_fit_single_file, str(single), False)
    assert all("add_safe_globals" in m and m.startswith("CheckpointError") for m in refused), refused
    assert dist_pool(2).run(_fit_single_file, str(single), True) == ["ok", "ok"]


def _fit_with(optim: str, ckpt: str) -> str:
    import lightning as L

    from tests.models import TokenDataset

    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=_strategy(S2), max_epochs=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = torch.utils.data.DataLoader(TokenDataset(8 * STEPS_PER_EPOCH), batch_size=8 // dist.get_world_size())
    try:
        trainer.fit(make_lit_module(optim=optim), data, ckpt_path=ckpt)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _without_recorded_kind(ckpt: str) -> None:
    """The manifest as an earlier lightning_zeroq wrote it: no optimizer kind (re-signed)."""
    import json

    from lightning_zeroq.checkpoint.store import SELF_CHECKSUM, _self_checksum

    path = os.path.join(ckpt, "zeroq.json")
    with open(path) as f:
        manifest = json.load(f)
    assert manifest["extra"].pop("optimizer_class") == "torch.optim.adamw.AdamW"
    manifest.pop(SELF_CHECKSUM)
    manifest[SELF_CHECKSUM] = _self_checksum(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def test_a_checkpoint_of_another_optimizer_kind_is_refused_in_fit(dist_pool, tmp_path):
    ckpt = str(tmp_path / "adamw.ckpt")
    dist_pool(2).run(_first, S2, ckpt)  # configure_optimizers returned AdamW
    messages = dist_pool(2).run(_fit_with, "sgd", ckpt)
    assert len(set(messages)) == 1, messages
    message = messages[0]
    assert message.startswith("CheckpointError"), message
    for needle in ("torch.optim.adamw.AdamW", "torch.optim.sgd.SGD", "same optimizer", "weights only"):
        assert needle in message, message
    # a checkpoint that does not record the kind: its param groups' hyperparameters give it away
    _without_recorded_kind(ckpt)
    messages = dist_pool(2).run(_fit_with, "sgd", ckpt)
    assert messages[0] == messages[1] and messages[0].startswith("CheckpointError"), messages
    assert "['amsgrad', 'betas'" in messages[0] and "SGD" in messages[0], messages[0]
    assert dist_pool(2).run(_fit_with, "adamw", ckpt) == ["no error", "no error"]  # the same kind resumes
