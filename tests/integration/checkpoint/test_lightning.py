"""Lightning conventions with ZeroQ checkpoints: ModelCheckpoint (top-k, save_last="link", every n
steps, sync and async), fit(ckpt_path="last"), remove_checkpoint, the caller's dict left alone,
weights-only files built on rank 0, load_from_checkpoint on a directory, zeroq-convert, and resuming
across strategies (DDP single file -> ZeroQ and back), each against DDP step by step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq  # noqa: F401
from lightning_zeroq.checkpoint.store import Manifest, classify
from lightning_zeroq.checkpoint.writer import StagingRing
from tests.dist_pool import REPO_ROOT
from tests.models import RichModel, make_lit_module
from tests.integration.checkpoint.test_reshard import S2, _ddp, _first, _fit, _second, _strategy, assert_runs_match

STEPS_PER_EPOCH = 4


def _conventions_body(tmp: str, async_checkpoint: bool) -> dict:

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zeroq import ZeroQStrategy

    dirpath = os.path.join(tmp, "ckpts")

    def callback():
        return ModelCheckpoint(dirpath=dirpath, monitor="loss", mode="min", save_top_k=2, save_last="link",
                               every_n_train_steps=1)

    strategy = ZeroQStrategy(stage=3, async_checkpoint=async_checkpoint)
    ring = strategy.checkpointer.staging = StagingRing(1 << 16, pin=False, cpu_sources=True)  # as with CUDA
    first = _fit(strategy, 1, callbacks=[callback()])
    # teardown waited for the save in flight and freed the pinned staging; the saves below allocate again
    assert strategy.checkpointer._executor is None and not strategy.checkpointer._staging
    assert ring.buffer is None and (ring.peak > 0) != async_checkpoint, (ring.peak, async_checkpoint)
    strategy.wait_for_checkpoint()
    entries = sorted(os.listdir(dirpath))
    out = {"entries": entries, "last_is_link": os.path.islink(os.path.join(dirpath, "last.ckpt")),
           "kinds": {e: classify(Path(dirpath) / e).kind.name for e in entries}, "first": first,
           "async_blocked": strategy.checkpointer.last.blocked_s, "async_total": strategy.checkpointer.last.total_s}
    # the caller's dict is never changed, and saving it twice writes two complete checkpoints
    trainer = strategy.lightning_module.trainer
    ckpt = trainer._checkpoint_connector.dump_checkpoint()
    keys = set(ckpt)
    for name in ("twice_a", "twice_b"):
        strategy.save_checkpoint(ckpt, os.path.join(tmp, name))
        strategy.wait_for_checkpoint()
    out["dict_unchanged"] = set(ckpt) == keys and len(ckpt["optimizer_states"]) == 1
    out["twice_optimizer"] = [Manifest.read(Path(tmp) / n).optimizer for n in ("twice_a", "twice_b")]
    # rank0_only: the full model on rank 0 only; weights-only: one consolidated file
    full, mine = strategy.full_state_dict(), strategy.full_state_dict(rank0_only=True)
    out["rank0_only_ok"] = mine.keys() == full.keys() and all(torch.equal(mine[k], full[k]) for k in full) \
        if dist.get_rank() == 0 else mine == {}
    weights = os.path.join(tmp, "weights.ckpt")
    trainer.save_checkpoint(weights, weights_only=True)
    if dist.get_rank() == 0:
        saved = torch.load(weights, weights_only=True)
        out["weights_only_ok"] = "optimizer_states" not in saved and all(
            torch.equal(saved["state_dict"][k], full[k]) for k in full)
    out["full"] = full
    # remove_checkpoint: a directory, and a link without its target
    target = os.path.realpath(os.path.join(dirpath, "last.ckpt"))
    strategy.remove_checkpoint(os.path.join(tmp, "twice_a"))
    strategy.remove_checkpoint(os.path.join(dirpath, "last.ckpt"))
    dist.barrier()
    out["removed"] = not os.path.exists(os.path.join(tmp, "twice_a")) and os.path.isdir(target)
    # resume from the newest top-k checkpoint by way of a fresh link ("last")
    if dist.get_rank() == 0:
        os.symlink(os.path.relpath(target, dirpath), os.path.join(dirpath, "last.ckpt"))
    dist.barrier()
    second_strategy = ZeroQStrategy(stage=2, async_checkpoint=async_checkpoint)
    out["second"] = _fit(second_strategy, 2, ckpt_path="last", callbacks=[callback()])
    second_strategy.wait_for_checkpoint()
    engine = second_strategy.engine
    out["adam_steps"] = sorted({int(s["step"]) for s in engine.full_optimizer_state().values()})
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def conventions(request, dist_pool, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conventions")
    return dist_pool(2).run(_conventions_body, str(tmp), request.param)[0], tmp


def test_model_checkpoint_top_k_last_link_every_n_steps(conventions):
    out, tmp = conventions
    dirs = [e for e in out["entries"] if e != "last.ckpt"]
    assert len(dirs) == 2 and out["last_is_link"], out["entries"]  # top 2, plus the link
    assert all(out["kinds"][e] == "ZEROQ" for e in out["entries"]), out["kinds"]
    assert out["dict_unchanged"] and out["twice_optimizer"] == [True, True]
    assert out["rank0_only_ok"] and out["weights_only_ok"] and out["removed"]


def test_resume_from_last_continues_steps_and_adam(conventions):
    out, _ = conventions
    steps = [s["step"] for s in out["second"]]
    assert steps == list(range(steps[0], 2 * STEPS_PER_EPOCH + 1)) and steps[0] > 1
    assert out["adam_steps"][-1] == 2 * STEPS_PER_EPOCH  # Adam's count went on from the checkpoint


def test_async_blocks_less_than_it_takes(conventions):
    out, _ = conventions
    assert 0 < out["async_blocked"] <= out["async_total"] or out["async_total"] == out["async_blocked"]


def test_load_from_checkpoint_on_a_directory_without_a_process_group(conventions):
    out, tmp = conventions
    assert not dist.is_initialized()
    ckpt = tmp / "twice_b"
    module = type(make_lit_module()).load_from_checkpoint(ckpt)
    got = dict(module.named_parameters(remove_duplicate=False))
    for name, value in out["full"].items():
        assert torch.equal(got[name].detach(), value), name


# ---------------------------------------------------------------------- zeroq-convert


def _engine_save(path: str) -> dict:
    from lightning_zeroq import ZeroConfig, ZeroEngine
    from lightning_zeroq.checkpoint.engine_io import save_engine
    from tests.models import make_batch, param_groups

    torch.manual_seed(0)
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(stage=3, stage3_wrap_classes=["Sequential"], stage3_param_persistence_threshold=20))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    for step in range(2):
        engine.backward(model.loss(make_batch(step, 0, dist.get_rank(), uniform=True)))
        engine.step()
    save_engine(engine, path)
    return {"full": engine.full_state_dict(), "gain": model.gain.clone()}


def test_zeroq_convert_round_trip_bit_for_bit(dist_pool, tmp_path):
    ckpt = tmp_path / "engine.ckpt"
    saved = dist_pool(3).run(_engine_save, str(ckpt))[0]
    out = tmp_path / "model.pt"
    run = subprocess.run([sys.executable, "-m", "lightning_zeroq.cli.convert", str(ckpt), str(out)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    state = torch.load(out, weights_only=True)
    model = RichModel()
    model.load_state_dict(state, strict=True)
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(param.detach(), saved["full"][name]), name
    assert torch.equal(model.gain, saved["gain"])
    from lightning_zeroq.cli.convert import main

    assert main([str(ckpt), str(tmp_path / "model.safetensors"), "--optimizer"]) == 0
    safetensors = pytest.importorskip("safetensors.torch")
    flat = safetensors.load_file(str(tmp_path / "model.safetensors"))
    for name, value in state.items():
        assert torch.equal(flat[name], value), name
    assert flat["optimizer.state.embed.weight.exp_avg"].shape == state["embed.weight"].shape


def test_zeroq_convert_errors_name_the_path(tmp_path, capsys):
    from lightning_zeroq.cli.convert import main

    assert main([str(tmp_path / "missing"), str(tmp_path / "out.pt")]) == 1
    assert "missing does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------- across strategies


def _ddp_first(ckpt: str) -> list[dict]:
    return _fit("ddp_find_unused_parameters_true", 1, save_to=ckpt)


def _ddp_second(ckpt: str) -> list[dict]:
    return _fit("ddp_find_unused_parameters_true", 2, ckpt_path=ckpt)


def test_ddp_single_file_resumes_in_zeroq_and_zeroq_exports_one_ddp_resumes(dist_pool, tmp_path):
    reference = dist_pool(2).run(_ddp)[0]
    ddp_file = str(tmp_path / "ddp.ckpt")
    first = dist_pool(2).run(_ddp_first, ddp_file)[0]
    second = dist_pool(2).run(_second, {"stage": 3}, ddp_file)[0]
    assert_runs_match(first + second, reference)
    zeroq_dir = tmp_path / "zeroq.ckpt"
    first = dist_pool(2).run(_first, S2, str(zeroq_dir))[0]
    exported = tmp_path / "exported.ckpt"
    from lightning_zeroq.cli.convert import main

    assert main([str(zeroq_dir), str(exported), "--optimizer"]) == 0
    second = dist_pool(2).run(_ddp_second, str(exported))[0]
    assert_runs_match(first + second, reference)


NVME = {"stage": 2, "offload_optimizer": True, "offload_optimizer_device": "nvme"}


def test_nvme_offload_saves_after_fit_with_its_optimizer_state(dist_pool, tmp_path):
    ckpt = str(tmp_path / "nvme.ckpt")
    first = dist_pool(2).run(_first, {**NVME, "nvme_path": str(tmp_path)}, ckpt)[0]
    second = dist_pool(2).run(_second, S2, ckpt)[0]
    reference = dist_pool(2).run(_ddp)[0]
    assert_runs_match(first + second, reference)


def test_strategy_strings_still_resolve():
    assert _strategy(S2).config.stage == 2


def _nvme_during_fit(kind: dict, dirpath: str) -> list[dict]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0, save_on_train_epoch_end=True)
    return _fit(_strategy(kind), 1, callbacks=[callback])


def test_nvme_offload_saves_during_fit_one_unit_at_a_time_and_resumes_elsewhere(dist_pool, tmp_path):
    from tests.integration.checkpoint.test_reshard import S3_OFFLOAD

    reference = dist_pool(3).run(_ddp)[0]
    kind = {**NVME, "nvme_path": str(tmp_path), "reduce_bucket_size": 300}
    first = dist_pool(2).run(_nvme_during_fit, kind, str(tmp_path / "ckpts"))[0]
    second = dist_pool(3).run(_second, S3_OFFLOAD, str(tmp_path / "ckpts" / "last.ckpt"))[0]
    assert_runs_match(first + second, reference)


def _torch_format_state() -> tuple:
    """An engine (one process) and what ``strategy="ddp"`` would save for the same model: its
    ``state_dict`` and a stepped AdamW's torch-format state."""
    import copy

    from lightning_zeroq import ZeroConfig, ZeroEngine
    from tests.models import make_batch, param_groups

    torch.manual_seed(0)
    model = RichModel()
    ref = copy.deepcopy(model)
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=300))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    opt = torch.optim.AdamW(param_groups(ref))
    ref.loss(make_batch(0, 0, 0)).backward()
    opt.step()
    return engine, {k: v.clone() for k, v in ref.state_dict().items()}, opt.state_dict()


@pytest.mark.parametrize("fault", ["bigger", "transposed", "missing"])
def test_a_torch_format_optimizer_state_is_loaded_only_with_a_matching_model(fault):
    # The DDP single-file path (Trainer and Fabric) loads weights and optimizer state in one pass:
    # a wrong shape (5x larger, or transposed: both hold enough elements to be misread) or a missing
    # key under strict is refused on every rank before anything changes, as nn.Module would.
    from lightning_zeroq.checkpoint.api import CheckpointError, load_torch_optimizer_state
    from lightning_zeroq.ranks import LOCAL

    engine, model, optimizer = _torch_format_state()
    name = "block.0.weight"
    if fault == "bigger":
        model[name] = torch.randn(5 * model[name].shape[0], model[name].shape[1])
    elif fault == "transposed":
        model[name] = torch.randn(model[name].shape[1] * 2, model[name].shape[0] // 2)
    else:
        del model[name]
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match="size mismatch for block.0.weight" if fault != "missing"
                       else r"missing keys \['block.0.weight'\]"):
        load_torch_optimizer_state(engine, model, optimizer, LOCAL)
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    assert not engine.optimizer.state
    if fault == "missing":  # lenient: the rest loads
        load_torch_optimizer_state(engine, model, optimizer, LOCAL, strict=False)
        full = engine.full_state_dict()
        assert torch.equal(full["embed.weight"], model["embed.weight"])
        assert torch.equal(full[name], before[name])  # absent from the checkpoint: kept
