"""Paths a checkpoint load or save touches: names in ``.metadata`` stay inside the checkpoint
directory, temporary files are created exclusively (never through a planted link), cleanup stays
inside the ``ModelCheckpoint`` directory, and a reader that opened a checkpoint keeps reading that
one while a save replaces it. One process each, no process group."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import types
from pathlib import Path

import pytest
import torch

from lightning_zeroq.checkpoint.agree import CheckpointError
from lightning_zeroq.checkpoint.checkpointer import open_checkpoint
from lightning_zeroq.checkpoint.convert import iter_named_tensors, lightning_checkpoint
from lightning_zeroq.checkpoint.engine_io import save_engine
from lightning_zeroq.checkpoint.store import SELF_CHECKSUM, _self_checksum
from lightning_zeroq.ranks import LOCAL
from tests.models import make_batch
from tests.integration.checkpoint.test_faults import _engine


def _trained(seed: int, steps: int = 1):
    engine = _engine(seed=seed)
    for step in range(steps):
        engine.backward(engine.parts.module.loss(make_batch(step, 0, 0, uniform=True)))
        engine.step()
    return engine


def _model_weights(engine) -> dict:
    full = {**engine.parts.module.state_dict(), **engine.full_state_dict()}  # buffers and the fp32 parameters
    return {k: v.detach().clone() for k, v in full.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    engine = _trained(0)
    save_engine(engine, root / "good", trainer_state={"steps": 1})
    return root, _model_weights(engine)


@pytest.mark.parametrize("how", ["parent", "absolute"])
def test_data_file_names_in_metadata_must_stay_inside_the_directory(saved, tmp_path, how):
    root, _ = saved
    ckpt, beside = tmp_path / "ckpt", tmp_path / "beside"
    shutil.copytree(root / "good", ckpt)
    shutil.copytree(root / "good", beside)  # the same save: everything would check out if read there
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    rename = {}
    for info in metadata.storage_data.values():
        rename[info.relative_path] = (f"../beside/{info.relative_path}" if how == "parent"
                                      else str(beside / info.relative_path))
        info.relative_path = rename[info.relative_path]
    raw = pickle.dumps(metadata)
    (ckpt / ".metadata").write_bytes(raw)
    manifest = json.loads((ckpt / "zeroq.json").read_text())  # made consistent, as an attacker would
    manifest.pop(SELF_CHECKSUM)
    manifest["metadata_sha256"] = __import__("hashlib").sha256(raw).hexdigest()
    manifest["files"] = {rename.get(k, k): v for k, v in manifest["files"].items()}
    manifest["checksums"]["items"] = {rename.get(k, k): v for k, v in manifest["checksums"]["items"].items()}
    manifest[SELF_CHECKSUM] = _self_checksum(manifest)
    (ckpt / "zeroq.json").write_text(json.dumps(manifest))
    for name in list(rename):
        (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=r"refers to the data file .*beside.*which is not a file inside"):
        lightning_checkpoint(ckpt)


def test_a_data_file_that_is_a_link_is_not_followed(saved, tmp_path):
    root, _ = saved
    ckpt, beside = tmp_path / "ckpt", tmp_path / "beside"
    shutil.copytree(root / "good", ckpt)
    shutil.copytree(root / "good", beside)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(beside / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        lightning_checkpoint(ckpt)


def test_a_planted_temp_link_is_not_written_through(tmp_path):
    from lightning_zeroq.checkpoint.checkpointer import Checkpointer
    from lightning_zeroq.lightning.checkpoint import save_single_file

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "weights.ckpt"
    (tmp_path / f".{path.name}.zeroq-tmp").symlink_to(victim)  # the name the save used to write through
    module = torch.nn.Linear(2, 2)
    strategy = types.SimpleNamespace(engine=None, is_global_zero=True, lightning_module=module)
    save_single_file(strategy, {"state_dict": module.state_dict(), "epoch": 1}, path, Checkpointer())
    assert victim.read_text() == "precious"
    assert path.is_file() and not path.is_symlink()
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["weight"], module.weight.detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{path.name}.zeroq-tmp", "victim.txt", "weights.ckpt"]


def test_remove_checkpoint_stays_inside_the_checkpoint_directory(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zeroq import ZeroQStrategy
    from tests.models import make_lit_module

    dirpath = tmp_path / "run" / "checkpoints"
    (dirpath / "epoch=0.ckpt").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("precious")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroQStrategy(), logger=False,
                        callbacks=[ModelCheckpoint(dirpath=dirpath)], enable_progress_bar=False)
    module = make_lit_module()
    module.trainer = trainer
    trainer.strategy._lightning_module = module
    with pytest.warns(UserWarning, match="Not removing .*resolves to a place outside it"):
        trainer.strategy.remove_checkpoint(f"{dirpath}/../../victim")  # a last_model_path from an edited state
    assert (victim / "data").read_text() == "precious"
    (dirpath / "link").symlink_to(victim)
    trainer.strategy.remove_checkpoint(dirpath / "link")  # inside: the link goes, never its target
    (dirpath / "sub").symlink_to(victim)  # a linked subdirectory leads outside too
    with pytest.warns(UserWarning, match="Not removing"):
        trainer.strategy.remove_checkpoint(dirpath / "sub" / "data")
    assert (victim / "data").read_text() == "precious"
    (dirpath / "sub").unlink()
    trainer.strategy.remove_checkpoint(dirpath / "epoch=0.ckpt")
    assert list(dirpath.iterdir()) == [] and (victim / "data").exists()
    elsewhere = tmp_path / "saved_by_hand.ckpt"  # a path the user names, not inside dirpath: theirs to remove
    elsewhere.mkdir()
    trainer.strategy.remove_checkpoint(elsewhere)
    assert not elsewhere.exists()


def test_a_reader_keeps_the_checkpoint_it_opened_while_a_save_replaces_it(saved, tmp_path):
    root, first = saved
    path = tmp_path / "last.ckpt"
    shutil.copytree(root / "good", path)
    opened = open_checkpoint(path, LOCAL)  # an evaluation job opens last.ckpt ...
    second = _trained(5, steps=2)
    save_engine(second, path, trainer_state={"steps": 2})  # ... while training saves the next one over it
    read = dict(iter_named_tensors(opened, optimizer=False))
    opened.close()
    assert len(read) > 4 and read.keys() == first.keys()
    assert all(torch.equal(v, first[k]) for k, v in read.items()), "the reader mixed two checkpoints"
    now = lightning_checkpoint(path)["state_dict"]  # a new reader sees the new one, whole
    expected = _model_weights(second)
    assert now.keys() == read.keys() and all(torch.equal(v, expected[k]) for k, v in now.items())
    assert any(not torch.equal(v, first[k]) for k, v in now.items())


def test_a_checkpoint_without_checksums_loads_with_a_warning(saved, tmp_path):
    from lightning_zeroq.checkpoint.checkpointer import Checkpointer

    _, first = saved
    engine = _trained(0)
    save_engine(engine, tmp_path / "bare", checkpointer=Checkpointer(checksums=False))
    manifest = json.loads((tmp_path / "bare" / "zeroq.json").read_text())
    assert "checksums" not in manifest and manifest["version"] == 1  # the format version without checksums
    with pytest.warns(UserWarning, match="saved without checksums .* damage to its data cannot be detected"):
        state = lightning_checkpoint(tmp_path / "bare")["state_dict"]
    assert all(torch.equal(state[k], first[k]) for k in state)
    with pytest.raises(ValueError, match=r"Checkpointer\(checksums='no'\): pass True"):
        Checkpointer(checksums="no")


def _flip_an_exponent_bit(ckpt: Path, weights: dict) -> str:
    """Sets bit 30 of one stored float32 weight (0.05 becomes about 1e37); returns its name."""
    from lightning_zeroq.checkpoint.safe import read_metadata

    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    for index, info in read_metadata(ckpt).storage_data.items():
        name = index.fqn.removeprefix("state_dict.")
        if info.relative_path != shard.name or weights.get(name) is None or weights[name].dtype != torch.float32:
            continue
        for value in weights[name].reshape(-1)[:8].tolist():
            pattern = torch.tensor([value]).numpy().tobytes()
            at = data.find(pattern, info.offset, info.offset + info.length)
            if value != 0 and at >= 0:
                data[at + 3] ^= 0x40
                shard.write_bytes(bytes(data))
                return name
    raise AssertionError("no float32 weight found to damage")


def test_a_checkpoint_saved_with_checksums_is_refused_when_they_are_stripped(saved, tmp_path):
    root, weights = saved
    ckpt = tmp_path / "stripped"
    shutil.copytree(root / "good", ckpt)
    name = _flip_an_exponent_bit(ckpt, weights)
    manifest = json.loads((ckpt / "zeroq.json").read_text())
    assert manifest["version"] >= 2  # a version that is always saved with checksums
    del manifest["checksums"], manifest[SELF_CHECKSUM]  # the damage would fail them: they are removed
    (ckpt / "zeroq.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"zeroq\.json .*format version 2.*checksums .*missing.*earlier "
                                              r"checkpoint"):
        state = lightning_checkpoint(ckpt)["state_dict"]
        assert torch.equal(state[name], weights[name]), f"{name} loaded damaged: {state[name].abs().max()}"
    manifest["version"] = 2
    manifest.pop("version")  # no version at all: not a manifest any save wrote
    (ckpt / "zeroq.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"zeroq\.json .*no format version"):
        lightning_checkpoint(ckpt)


def test_an_interpolation_in_a_resigned_manifest_never_resolves(saved, tmp_path, monkeypatch):
    from omegaconf import DictConfig, ListConfig, OmegaConf

    import lightning_zeroq.lightning.checkpoint  # noqa: F401  (registers OmegaConf's containers)

    calls: list = []
    monkeypatch.setenv("ZEROQ_TEST_SECRET", "hunter2-secret")
    OmegaConf.register_new_resolver("zeroq_probe", lambda *args: calls.append(args) or "ran", replace=True)
    try:
        root, _ = saved
        hparams = OmegaConf.create({"model": {"dim": 8, "widths": [8, "${model.dim}"]}, "name": "run-${model.dim}"})
        engine = _trained(0)
        save_engine(engine, tmp_path / "legit", trainer_state={"hyper_parameters": hparams, "hparams_type": DictConfig})
        back = lightning_checkpoint(tmp_path / "legit")
        assert back["hparams_type"] is DictConfig and isinstance(back["hyper_parameters"].model.widths, ListConfig)
        assert OmegaConf.to_container(back["hyper_parameters"]) == {"model": {"dim": 8, "widths": [8, 8]},
                                                                   "name": "run-8"}
        for attack in ("${oc.env:ZEROQ_TEST_SECRET}", "${zeroq_probe:1}"):
            ckpt = tmp_path / f"crafted{len(calls)}{attack[2:4]}"
            shutil.copytree(tmp_path / "legit", ckpt)
            manifest = json.loads((ckpt / "zeroq.json").read_text())
            manifest["trainer_state"]["hyper_parameters"]["value"]["model"]["widths"][1] = attack
            manifest.pop(SELF_CHECKSUM)
            manifest[SELF_CHECKSUM] = _self_checksum(manifest)  # re-signed: only the interpolation is the attack
            (ckpt / "zeroq.json").write_text(json.dumps(manifest))
            for load in (lambda: lightning_checkpoint(ckpt), lambda: open_checkpoint(ckpt, LOCAL).trainer_state()):
                try:
                    outcome = str(OmegaConf.to_container(load()["hyper_parameters"], resolve=True))
                except CheckpointError as error:
                    outcome = str(error)
                assert calls == [] and "hunter2-secret" not in outcome, outcome
                assert (f"checkpoint['hyper_parameters'] holds the OmegaConf interpolation {attack!r} at "
                        "model.widths[1]") in outcome, outcome
    finally:
        OmegaConf.clear_resolver("zeroq_probe")
