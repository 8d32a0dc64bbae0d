"""The fault matrix: every kind of damage a checkpoint can suffer on disk, through every way of
loading it, at 2 and 3 ranks. Each cell ends every rank with the same clear ``CheckpointError`` (or,
for a one-process reader, one clear error) well under the collective timeout, or loads correctly (a
reader that never needed the damaged bytes gets exactly the undamaged weights). The checkpoints are
saved once per world size; each cell damages a copy.

Set ``ZEROQ_FAULT_MATRIX_OUT=FILE`` to get every cell's outcome, time and message as JSON lines
(one line per cell).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from tests.models import TokenDataset, make_lit_module

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier

CELL_TIMEOUT_S = 40.0
"""Each pool run's limit: well under the pool's 60 s collective timeout, so a hang fails the cell."""
WORLD_SIZES = (2, 3)
DAMAGES = ("flip_tensor_bytes", "scramble_middle", "truncate", "delete_shard", "swap_shards", "damage_metadata",
           "damage_manifest", "damage_non_tensor_item")
READERS = ("trainer_resume", "fabric_load", "load_from_checkpoint", "zeroq_convert")
ROWS: list[dict] = []


def _trainer(max_epochs: int):
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=ZeroQStrategy(stage=2),
                     max_epochs=max_epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)


def _data():
    return torch.utils.data.DataLoader(TokenDataset(2 * dist.get_world_size()), batch_size=2)


def _save(path: str, epochs: int) -> None:
    torch.manual_seed(epochs)
    trainer = _trainer(epochs)
    trainer.fit(make_lit_module(), _data())
    trainer.save_checkpoint(path)


def _timed(fn) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        fn()
    except BaseException as error:  # noqa: BLE001  (a cell reports whatever ends it)
        from lightning_zeroq.checkpoint.agree import CheckpointError

        kind = "CheckpointError" if isinstance(error, CheckpointError) else type(error).__name__
        return kind, str(error), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _resume(path: str) -> tuple[str, str, float]:
    return _timed(lambda: _trainer(2).fit(make_lit_module(), _data(), ckpt_path=path))


def _fabric_load(path: str) -> tuple[str, str, float]:
    import lightning as L

    from lightning_zeroq import ZeroQFabricStrategy
    from tests.models import param_groups

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ZeroQFabricStrategy(stage=2))
    fabric.launch()
    module = make_lit_module()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(param_groups(module.model)))
    return _timed(lambda: fabric.load(path, {"model": model, "optimizer": optimizer}))


# ---------------------------------------------------------------------- damages


def _items(ckpt: Path, file: str) -> list:
    from lightning_zeroq.checkpoint.safe import read_metadata

    metadata = read_metadata(ckpt)
    return sorted(((index.fqn, info) for index, info in metadata.storage_data.items() if info.relative_path == file),
                  key=lambda item: -item[1].length)


def _xor(file: Path, offset: int, count: int) -> None:
    data = bytearray(file.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xA5
    file.write_bytes(bytes(data))


def damage(ckpt: Path, kind: str, other: Path) -> None:
    shard = ckpt / "__0_0.distcp"
    if kind == "flip_tensor_bytes":  # 8 bytes in the middle of the largest weight's data
        fqn, info = next(i for i in _items(ckpt, shard.name) if i[0].startswith("state_dict."))
        _xor(shard, info.offset + info.length * 3 // 4, 8)
    elif kind == "scramble_middle":  # 4 KiB in the middle of a shard, size unchanged
        _xor(shard, shard.stat().st_size // 2 - 2048, 4096)
    elif kind == "truncate":
        data = (ckpt / "__1_0.distcp").read_bytes()
        (ckpt / "__1_0.distcp").write_bytes(data[: len(data) * 2 // 3])
    elif kind == "delete_shard":
        (ckpt / "__1_0.distcp").unlink()
    elif kind == "swap_shards":  # the same rank's file of another save of the same model
        shutil.copy(other / "__1_0.distcp", ckpt / "__1_0.distcp")
        shutil.copy(other / "__0_0.distcp", ckpt / "__0_0.distcp")
    elif kind == "damage_metadata":
        _xor(ckpt / ".metadata", (ckpt / ".metadata").stat().st_size // 2, 16)
    elif kind == "damage_manifest":  # still valid JSON: the global step edited
        text = (ckpt / "zeroq.json").read_text()
        assert '"global_step": 1' in text
        (ckpt / "zeroq.json").write_text(text.replace('"global_step": 1', '"global_step": 7', 1))
    elif kind == "damage_non_tensor_item":  # one byte of an optimizer hyperparameter (a pickled float)
        from lightning_zeroq.checkpoint.safe import read_metadata

        info = next(info for index, info in read_metadata(ckpt).storage_data.items()
                    if index.fqn == "optimizer_0.param_groups.0.lr")  # in the file of the rank DCP chose
        _xor(ckpt / info.relative_path, info.offset + info.length // 2, 1)
    else:
        raise AssertionError(kind)


# ---------------------------------------------------------------------- cells


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("fault_matrix")
    for world in WORLD_SIZES:
        dist_pool(world).run(_save, str(root / f"good{world}"), 1)
        dist_pool(world).run(_save, str(root / f"other{world}"), 2)
    return root


@pytest.fixture(scope="module")
def reference(saved):
    from lightning_zeroq.checkpoint.convert import lightning_checkpoint

    return {world: lightning_checkpoint(saved / f"good{world}")["state_dict"] for world in WORLD_SIZES}


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    out = os.environ.get("ZEROQ_FAULT_MATRIX_OUT")
    if out:
        with open(out, "a") as f:
            for row in ROWS:
                f.write(json.dumps(row) + "\n")


def _record(world, reader, kind, outcome, seconds, message) -> None:
    ROWS.append({"world_size": world, "reader": reader, "damage": kind, "outcome": outcome,
                 "seconds": round(seconds, 2), "message": message})


def _one_process(reader: str, ckpt: Path, out: Path) -> tuple[str, str, float, dict]:
    """load_from_checkpoint or zeroq-convert (one process, no process group)."""
    loaded: dict = {}
    if reader == "load_from_checkpoint":
        def run():
            module = type(make_lit_module()).load_from_checkpoint(str(ckpt))
            loaded.update({k: v.detach().clone() for k, v in module.state_dict().items()})
        kind, message, seconds = _timed(run)
        return kind, message, seconds, loaded
    import contextlib
    import io

    from lightning_zeroq.cli import convert

    stderr = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = convert.main([str(ckpt), str(out), "--optimizer"])
    seconds = time.monotonic() - start
    if code == 0:
        loaded.update(torch.load(out, weights_only=True)["state_dict"])
        return "ok", "", seconds, loaded
    return "exit 1", stderr.getvalue().strip(), seconds, loaded


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", DAMAGES)
def test_fault_matrix(dist_pool, saved, reference, tmp_path, world, reader, kind):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / f"good{world}", ckpt)
    damage(ckpt, kind, saved / f"other{world}")
    if reader in ("trainer_resume", "fabric_load"):
        fn = _resume if reader == "trainer_resume" else _fabric_load
        results = dist_pool(world).run_within(CELL_TIMEOUT_S, fn, str(ckpt))
        seconds = max(r[2] for r in results)
        kinds, messages = {r[0] for r in results}, {r[1] for r in results}
        assert kinds == {"CheckpointError"}, results
        assert len(messages) == 1, f"ranks disagree: {messages}"
        message = messages.pop()
        outcome = "CheckpointError on every rank"
    else:
        outcome, message, seconds, loaded = _one_process(reader, ckpt, tmp_path / "out.ckpt")
        if outcome == "ok":  # it never read the damaged bytes: the weights must be exactly the saved ones
            ref = reference[world]
            assert loaded.keys() == ref.keys() and all(torch.equal(loaded[k], ref[k]) for k in ref), kind
            outcome = "loads correctly"
        else:
            assert outcome in ("CheckpointError", "exit 1"), (outcome, message)
    assert seconds < CELL_TIMEOUT_S
    if outcome != "loads correctly":
        assert str(ckpt) in message, message  # names the checkpoint (and, below, the file or item)
        assert re.search(r"__\d+_0\.distcp|\.metadata|zeroq\.json", message), message  # the file
    _record(world, reader, kind, outcome, seconds, message)


# ---------------------------------------------------------------------- SIGKILL of one rank while saving

KILL_CHILD = """
import os, sys
from datetime import timedelta
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore("127.0.0.1", {port}, None, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
from lightning_zeroq.checkpoint import atomic
from lightning_zeroq.checkpoint.checkpointer import Checkpointer
from lightning_zeroq.checkpoint.engine_io import save_engine
from tests.models import make_batch
from tests.integration.checkpoint.test_faults import _engine
engine = _engine()
checkpointer = Checkpointer(async_save={asynchronous})
for steps in (1, 2):
    engine.backward(engine.parts.module.loss(make_batch(steps, 0, rank, uniform=True)))
    engine.step()
    if steps == 2 and rank == {victim}:
        os.environ[atomic.FAULT_ENV] = {fault!r}
    save_engine(engine, {path!r}, trainer_state={{"steps": steps}}, checkpointer=checkpointer)
    checkpointer.wait()
"""
KILL_LIMIT_S = 120.0
"""Start (two or three interpreters importing torch on a loaded machine) to the end of the last process."""
SURVIVOR_LIMIT_S = 30.0
"""From the victim's death to the last survivor's exit: well under the children's 60 s collective timeout."""


def _kill_one_rank(path: Path, world: int, victim: int, fault: str, asynchronous: bool) -> tuple[list, float]:
    """Every rank saves twice; ``victim`` is killed (SIGKILL) at ``fault`` of the second save. Returns
    the exit codes (None: still alive at the limit, then killed) and the seconds from the victim's
    death until every survivor had exited on its own."""
    from datetime import timedelta

    from tests.dist_pool import REPO_ROOT

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    code = KILL_CHILD.format(root=REPO_ROOT, port=store.port, asynchronous=asynchronous, victim=victim, fault=fault,
                             path=str(path))
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    env.pop("ZEROQ_CHECKPOINT_FAULT", None)
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(r)}, cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(world)]
    start, died = time.monotonic(), None
    try:
        while time.monotonic() - start < KILL_LIMIT_S and any(p.poll() is None for p in procs):
            if died is None and procs[victim].poll() is not None:
                died = time.monotonic()
            if died is not None and time.monotonic() - died > SURVIVOR_LIMIT_S:
                break
            time.sleep(0.05)
        codes = [p.poll() for p in procs]
        if died is None and procs[victim].poll() is not None:
            died = time.monotonic()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, (time.monotonic() - died) if died is not None else float("inf")


@pytest.mark.parametrize("world,victim,fault,asynchronous,survivor", [
    (2, 1, "mid_data", False, 1), (2, 0, "after_manifest", False, 1), (2, 0, "after_exchange", False, 2),
    (2, 1, "mid_data", True, 1), (3, 2, "after_data", False, 1)])
def test_sigkill_of_one_rank_while_saving(tmp_path, world, victim, fault, asynchronous, survivor):
    from lightning_zeroq.checkpoint import atomic
    from lightning_zeroq.checkpoint.agree import CheckpointError
    from lightning_zeroq.checkpoint.engine_io import load_engine
    from tests.integration.checkpoint.test_faults import _engine

    path = tmp_path / "last.ckpt"
    codes, seconds = _kill_one_rank(path, world, victim, fault, asynchronous)
    assert codes[victim] == -9, codes  # killed where asked
    assert None not in codes and seconds < SURVIVOR_LIMIT_S, f"a rank outlived the victim by {seconds:.1f} s: {codes}"
    assert all(c != 0 for c in codes), codes  # the survivors fail too (no rank reports a save that did not happen)
    start = time.monotonic()
    assert load_engine(_engine(seed=3), path)["steps"] == survivor  # the checkpoint in place loads whole
    message = ""
    for leftover in atomic.leftovers(path):  # the interrupted save's directory is refused, or complete
        try:
            steps = load_engine(_engine(seed=3), leftover)["steps"]  # complete: the new one, or the old one
            assert fault in ("after_manifest", "after_exchange") and steps in (1, 2), (leftover, steps)
        except CheckpointError as error:
            message = str(error)
            assert any(s in message for s in ("incomplete", "missing", "no checkpoint")), message
    _record(world, f"SIGKILL rank {victim} ({'async' if asynchronous else 'sync'} save)", fault,
            f"step {survivor} loads; the partial save " + ("is refused" if message else "is complete or absent"),
            seconds + time.monotonic() - start, message)
