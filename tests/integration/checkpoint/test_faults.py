"""Damaged, foreign, mismatched and doctored checkpoints end every rank with one clear error within a
bounded time (no hang, no partial load, no code run); a saving process killed at any point leaves the
previous checkpoint loadable."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.checkpoint.agree import CheckpointError
from lightning_zeroq.checkpoint.engine_io import engine_state, load_engine, save_state
from lightning_zeroq.checkpoint.checkpointer import Checkpointer
from tests.dist_pool import REPO_ROOT
from tests.models import DIM, RichModel, make_batch, param_groups

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier

BOUND_S = 20.0


class Evil:
    """Unpickling it creates ``marker``: the test fails if any loader ran it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class OtherShape(RichModel):
    def __init__(self) -> None:
        super().__init__()
        self.never = nn.Linear(DIM, 4)


def _engine(model_cls=RichModel, stage: int = 2, seed: int = 0) -> ZeroEngine:
    torch.manual_seed(seed)
    model = model_cls()
    engine = ZeroEngine(model, ZeroConfig(stage=stage, reduce_bucket_size=500))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    return engine


def _train_and_save(path: str, steps: int = 2, evil_marker: str = "") -> None:
    engine = _engine()
    for step in range(steps):
        engine.backward(engine.parts.module.loss(make_batch(step, 0, dist.get_rank(), uniform=True)))
        engine.step()
    state = engine_state(engine, optimizer=True)
    if evil_marker:  # a non-tensor item that would run code if unpickled with weights_only=False
        state["optimizer_0"]["param_groups"][0]["lr"] = Evil(evil_marker)
    save_state(engine, Path(path), state, {"step": steps}, Checkpointer())


def _try_load(path: str, model: str = "rich", stage: int = 3) -> tuple[str, str, float]:
    engine = _engine(OtherShape if model == "other" else RichModel, stage=stage, seed=1)
    start = time.monotonic()
    try:
        load_engine(engine, Path(path))
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _expect_one_error(results: list, *needles: str) -> str:
    kinds = {r[0] for r in results}
    messages = {r[1] for r in results}
    assert kinds == {"CheckpointError"}, results
    assert len(messages) == 1, f"ranks disagree: {messages}"
    message = messages.pop()
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert max(r[2] for r in results) < BOUND_S
    return message


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    dist_pool(2).run(_train_and_save, str(root / "good"))
    dist_pool(2).run(_train_and_save, str(root / "other"), 3)
    return root


def _copy(saved: Path, name: str) -> Path:
    target = saved / name
    shutil.copytree(saved / "good", target)
    return target


def test_missing_data_file(dist_pool, saved):
    ckpt = _copy(saved, "missing")
    (ckpt / "__1_0.distcp").unlink()
    message = _expect_one_error(dist_pool(3).run(_try_load, str(ckpt)), "__1_0.distcp is missing", "rank 0", "rank 2")
    assert "failed on 3 of 3 rank(s)" in message


def test_truncated_data_file(dist_pool, saved):
    ckpt = _copy(saved, "truncated")
    data = (ckpt / "__0_0.distcp").read_bytes()
    (ckpt / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    _expect_one_error(dist_pool(2).run(_try_load, str(ckpt)), "__0_0.distcp has", "truncated")


def test_foreign_data_file(dist_pool, saved):
    ckpt = _copy(saved, "foreign")
    shutil.copy(saved / "other" / "__1_0.distcp", ckpt / "__1_0.distcp")
    _expect_one_error(dist_pool(2).run(_try_load, str(ckpt)), "__1_0.distcp", "another save")


def test_missing_manifest_is_an_incomplete_checkpoint(dist_pool, saved):
    ckpt = _copy(saved, "no_manifest")
    (ckpt / "zeroq.json").unlink()
    _expect_one_error(dist_pool(2).run(_try_load, str(ckpt)), "no zeroq.json", "incomplete")


def test_shape_mismatched_model(dist_pool, saved):
    message = _expect_one_error(dist_pool(2).run(_try_load, str(saved / "good"), "other"), "'never.weight'",
                                "(3, 16)", "(4, 16)")
    assert "never.bias" in message


def test_doctored_metadata_never_runs(dist_pool, saved, tmp_path):
    ckpt = _copy(saved, "evil_metadata")
    marker = tmp_path / "metadata_payload_ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil(str(marker))))
    _expect_one_error(dist_pool(2).run(_try_load, str(ckpt)), ".metadata is not the one this checkpoint was saved with")
    _reseal(ckpt, metadata_sha256=hashlib.sha256((ckpt / ".metadata").read_bytes()).hexdigest())  # as an attacker would
    _expect_one_error(dist_pool(2).run(_try_load, str(ckpt)), ".metadata refers to posix.mkdir")
    assert not marker.exists()


def test_doctored_non_tensor_item_never_runs(dist_pool, tmp_path):
    marker = tmp_path / "bytes_payload_ran"
    ckpt = tmp_path / "evil_bytes"
    dist_pool(2).run(_train_and_save, str(ckpt), 1, str(marker))
    assert not marker.exists()  # saving pickles the payload without running it
    _expect_one_error(dist_pool(2).run(_try_load, str(ckpt)), "optimizer_0.param_groups.0.lr", "not a plain value")
    assert not marker.exists()


def test_doctored_trainer_state_is_refused(dist_pool, saved):
    ckpt = _copy(saved, "evil_json")
    text = (ckpt / "zeroq.json").read_text().replace('"step": 2', '"step": {"__zeroq__": "type", "name": "os.system"}')
    (ckpt / "zeroq.json").write_text(text)
    _expect_one_error(dist_pool(2).run(_try_load, str(ckpt)), "zeroq.json does not match its own checksum")
    _reseal(ckpt)  # the manifest's checksum is against damage; one who edits it on purpose can recompute it
    _expect_one_error(dist_pool(2).run(_try_load, str(ckpt)), "trainer state cannot be read", "unknown tagged value")


def _reseal(ckpt: Path, **changes) -> None:
    import json

    from lightning_zeroq.checkpoint.store import SELF_CHECKSUM, _self_checksum

    data = json.loads((ckpt / "zeroq.json").read_text())
    data.pop(SELF_CHECKSUM)
    data.update(changes)
    data[SELF_CHECKSUM] = _self_checksum(data)
    (ckpt / "zeroq.json").write_text(json.dumps(data))


def test_a_directory_of_pickles_is_refused_and_never_unpickled(dist_pool, tmp_path):
    # No manifest, no .metadata: no checkpoint, whatever its files hold; a file in it is a single file,
    # which the engine's loader refuses (the Trainer reads it with weights_only=True: the test below).
    marker = tmp_path / "payload_ran"
    pickles = tmp_path / "old.ckpt"
    pickles.mkdir()
    torch.save({"state_dict": {}}, pickles / "meta.pt")
    (pickles / "zero_shard_rank00000.pt").write_bytes(pickle.dumps(Evil(str(marker))))
    _expect_one_error(dist_pool(2).run(_try_load, str(pickles)), "is a directory but no checkpoint",
                      "trainer.save_checkpoint() wrote")
    _expect_one_error(dist_pool(2).run(_try_load, str(pickles / "zero_shard_rank00000.pt")),
                      "is a single-file checkpoint, not a directory checkpoint")
    assert not marker.exists()


def test_paths_into_or_beside_a_checkpoint(dist_pool, saved):
    for inner in ("zeroq.json", ".metadata", "__0_0.distcp"):
        _expect_one_error(dist_pool(2).run(_try_load, str(saved / "good" / inner)), "the directory is the checkpoint",
                          f"ckpt_path={str(saved / 'good')!r}")
    _expect_one_error(dist_pool(2).run(_try_load, str(saved / "nope")), "nope does not exist")


# ---------------------------------------------------------------------- SIGKILL while saving

CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {root!r})
    from lightning_zeroq.checkpoint import atomic
    from lightning_zeroq.checkpoint.engine_io import save_engine
    from tests.integration.checkpoint.test_faults import _engine
    from tests.models import make_batch
    atomic.exchange_supported = None if {exchange} else False
    engine = _engine()
    for step in range({steps}):
        engine.backward(engine.parts.module.loss(make_batch(step, 0, 0, uniform=True)))
        engine.step()
    save_engine(engine, {path!r}, trainer_state={{"steps": {steps}}})
""")


def _child(path: Path, steps: int, fault: str = "", exchange: bool = True) -> int:
    env = {**os.environ, "ZEROQ_CHECKPOINT_FAULT": fault}
    code = CHILD.format(root=REPO_ROOT, path=str(path), steps=steps, exchange=exchange)
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=120, cwd=REPO_ROOT).returncode


def _load_steps(path: Path) -> int:
    engine = _engine(seed=3)
    return load_engine(engine, path)["steps"]


@pytest.fixture(scope="module")
def first_save(tmp_path_factory):
    path = tmp_path_factory.mktemp("sigkill") / "last.ckpt"
    assert _child(path, 1) == 0
    return path


@pytest.mark.parametrize("fault,exchange,survivor", [
    ("mid_data", True, 1), ("after_data", True, 1), ("after_manifest", True, 1), ("after_exchange", True, 2),
    ("between_renames", False, 1), ("after_publish", False, 2)])
def test_sigkill_while_saving_leaves_a_loadable_checkpoint(first_save, tmp_path, fault, exchange, survivor):
    path = tmp_path / "last.ckpt"
    shutil.copytree(first_save, path)
    assert _child(path, 2, fault, exchange) == -9  # killed where asked
    with pytest.warns(UserWarning, match="interrupted save") if fault == "between_renames" else _nothing():
        assert _load_steps(path) == survivor
    if fault == "between_renames":  # the next save puts a checkpoint in place and clears the leftovers
        assert _child(path, 3) == 0
        assert _load_steps(path) == 3
        assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------- through the Trainer


def _fit_catching(ckpt: str, weights_only) -> tuple[str, str, float]:
    from tests.integration.checkpoint.test_reshard import S2, _second

    start = time.monotonic()
    try:
        _second(S2, ckpt) if weights_only is None else _fit_weights_only(ckpt, weights_only)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _fit_weights_only(ckpt: str, weights_only: bool) -> None:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy
    from tests.models import TokenDataset, make_lit_module

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroQStrategy(), max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(make_lit_module(), torch.utils.data.DataLoader(TokenDataset(8), batch_size=2), ckpt_path=ckpt,
                weights_only=weights_only)


def test_trainer_resume_from_a_damaged_or_unsafe_checkpoint_fails_alike_on_every_rank(dist_pool, tmp_path):
    from tests.integration.checkpoint.test_reshard import S2, _first

    ckpt = tmp_path / "epoch1.ckpt"
    dist_pool(2).run(_first, S2, str(ckpt))
    (ckpt / "__1_0.distcp").unlink()
    _expect_one_error(dist_pool(2).run(_fit_catching, str(ckpt), None), "__1_0.distcp is missing")
    marker = tmp_path / "payload_ran"
    pickles = tmp_path / "old.ckpt"
    pickles.mkdir()
    (pickles / "meta.pt").write_bytes(pickle.dumps(Evil(str(marker))))
    (pickles / "zero_shard_rank00000.pt").write_bytes(pickle.dumps(Evil(str(marker))))
    _expect_one_error(dist_pool(2).run(_fit_catching, str(pickles), True), "is a directory but no checkpoint")
    _expect_one_error(dist_pool(2).run(_fit_catching, str(pickles / "meta.pt"), True), "could not be loaded safely")
    _expect_one_error(dist_pool(2).run(_fit_catching, str(ckpt / "zeroq.json"), True), "the directory is the checkpoint")
    single = tmp_path / "evil_single.ckpt"
    single.write_bytes(pickle.dumps(Evil(str(marker))))
    _expect_one_error(dist_pool(2).run(_fit_catching, str(single), None), "could not be loaded safely",
                      "weights_only=False")
    assert not marker.exists()


def _swap_row_chunks(ckpt: Path) -> str:
    """Doctor ``ckpt`` as one who edits it on purpose would: a 2-D parameter stored as two row chunks gets
    their sizes swapped in ``.metadata`` (12/4 rows become 4/12, each item keeping its bytes), and the
    manifest's sha256 of ``.metadata`` and its own checksum are recomputed, so every checksum passes.
    Returns the parameter's key."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from lightning_zeroq.checkpoint.safe import read_metadata

    metadata = read_metadata(ckpt)
    key, md = next((k, v) for k, v in metadata.state_dict_metadata.items()
                   if k.startswith("state_dict.") and getattr(v, "chunks", None) and len(v.size) == 2
                   and len(v.chunks) == 2 and v.chunks[0].sizes[0] != v.chunks[1].sizes[0])
    first, second = sorted(md.chunks, key=lambda c: c.offsets[0])
    rows = (second.sizes[0], first.sizes[0])
    md.chunks = [ChunkStorageMetadata(first.offsets, torch.Size((rows[0], *first.sizes[1:]))),
                 ChunkStorageMetadata(torch.Size((rows[0], *second.offsets[1:])), torch.Size((rows[1], *second.sizes[1:])))]
    metadata.storage_data = {
        (MetadataIndex(key, md.chunks[1].offsets, 1) if i.fqn == key and tuple(i.offset) == tuple(second.offsets) else i):
        info for i, info in metadata.storage_data.items()}
    raw = pickle.dumps(metadata)
    (ckpt / ".metadata").write_bytes(raw)
    _reseal(ckpt, metadata_sha256=hashlib.sha256(raw).hexdigest())
    return key


def test_chunk_metadata_that_disagrees_with_the_stored_items_is_refused_alike_by_every_reader(dist_pool, tmp_path,
                                                                                               capsys):
    from lightning_zeroq.checkpoint.convert import lightning_checkpoint
    from lightning_zeroq.cli.convert import main
    from tests.integration.checkpoint.test_reshard import S2, _first

    ckpt = tmp_path / "epoch1.ckpt"
    dist_pool(2).run(_first, S2, str(ckpt))
    key = _swap_row_chunks(ckpt)
    message = _expect_one_error(dist_pool(2).run(_fit_catching, str(ckpt), None), repr(key),
                                "do not match the items stored for them")
    lines = message.splitlines()[1:]
    problems = {line.split(": ", 1)[1].split(" Resume from")[0] for line in lines}
    assert len(lines) == 2 and len(problems) == 1, message  # every rank, the same problem in one line
    problem = problems.pop()
    assert main([str(ckpt), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and problem in err, err  # zeroq-convert says the same
    with pytest.raises(CheckpointError) as caught:  # what LightningModule.load_from_checkpoint(dir) reads through
        lightning_checkpoint(ckpt)
    assert problem in str(caught.value), caught.value
