"""zeroq-convert writes its output atomically and says what went wrong in one line of its own: on any
failure (a damaged checkpoint, an error half-way through, Ctrl-C, SIGTERM) nothing is left at the
output path, an existing file there is kept, and no temporary file remains."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from lightning_zeroq.checkpoint import convert
from lightning_zeroq.cli.convert import main
from tests.integration.checkpoint.test_faults import _train_and_save


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("convert")
    dist_pool(2).run(_train_and_save, str(root / "good"))
    return root / "good"


def _entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeroq-convert: "), err
    return err


@pytest.mark.parametrize("suffix", [".ckpt", ".safetensors"])
def test_a_failure_half_way_leaves_nothing_and_keeps_an_existing_output(saved, tmp_path, monkeypatch, capsys,
                                                                        suffix):
    out = tmp_path / f"out{suffix}"
    out.write_bytes(b"previous")
    calls = []
    real = convert.read_entries

    def failing(reader, targets):
        calls.append(1)
        if len(calls) == 3:  # after two tensors are in the new file
            raise OSError(28, "No space left on device")
        real(reader, targets)

    monkeypatch.setattr(convert, "read_entries", failing)
    assert main([str(saved), str(out), "--optimizer"]) == 1
    err = _error(capsys)
    assert "No space left on device" in err and f"{out} was not written" in err, err
    assert out.read_bytes() == b"previous" and _entries(tmp_path) == ["out" + suffix]


@pytest.mark.parametrize("how", ["KeyboardInterrupt", "SIGTERM", "SIGHUP"])
def test_ctrl_c_or_a_signal_leaves_nothing(saved, tmp_path, monkeypatch, capsys, how):
    out = tmp_path / "out.ckpt"
    real = convert.read_entries

    def interrupted(reader, targets):
        real(reader, targets)
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        os.kill(os.getpid(), getattr(signal, how))

    monkeypatch.setattr(convert, "read_entries", interrupted)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    assert main([str(saved), str(out)]) == 130
    assert "interrupted" in _error(capsys) and _entries(tmp_path) == []
    assert {s: signal.getsignal(s) for s in before} == before  # main() put the handlers back


def test_a_damaged_shard_is_one_line_of_its_own_words_and_no_output(saved, tmp_path, capsys):
    import shutil

    ckpt = tmp_path / "damaged"
    shutil.copytree(saved, ckpt)
    shard = ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
    shard.write_bytes(bytes(data))
    out = tmp_path / "o.ckpt"
    assert main([str(ckpt), str(out), "--optimizer"]) == 1
    err = _error(capsys)
    assert "__1_0.distcp" in err or "damaged" in err or "corrupt" in err.lower(), err
    assert "FrameSummary" not in err and "(OSError(" not in err and "CheckpointException" not in err, err
    assert not out.exists() and _entries(tmp_path) == ["damaged"]


def test_inputs_that_are_no_checkpoint_directory(saved, tmp_path, capsys):
    ddp = tmp_path / "ddp.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "optimizer_states": []}, ddp)
    assert main([str(ddp), str(tmp_path / "o.pt")]) == 1
    err = _error(capsys)
    assert "single-file checkpoint" in err and "torch.load(" in err and "fit(ckpt_path=" in err, err
    assert main([str(tmp_path / "missing"), str(tmp_path / "o.pt")]) == 1
    err = _error(capsys)
    assert "missing does not exist" in err and "ckpt_path='last'" not in err, err
    assert main([str(ddp), str(tmp_path / "o.txt")]) == 1
    assert "suffix" in _error(capsys)
    assert main([str(saved), str(tmp_path / "nowhere" / "o.pt")]) == 1
    assert "nowhere does not exist" in _error(capsys)
    assert main([str(saved), str(tmp_path)]) == 1
    assert "is a directory" in _error(capsys)
    assert _entries(tmp_path) == ["ddp.ckpt"]


def test_a_file_that_is_no_checkpoint_is_named_for_what_it_is_not(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    assert main([str(notes), str(tmp_path / "o.pt")]) == 1
    err = _error(capsys)
    assert f"{notes} is neither a checkpoint directory" in err and "nor a torch or safetensors file" in err, err
    assert "single-file checkpoint" not in err and "torch.load(" not in err, err
    safetensors = pytest.importorskip("safetensors.torch")
    flat = tmp_path / "flat.safetensors"
    safetensors.save_file({"w": torch.ones(2)}, str(flat))
    assert main([str(flat), str(tmp_path / "o.pt")]) == 1
    err = _error(capsys)
    assert f"{flat} is a safetensors file" in err and "load_file(" in err and "torch.load(" not in err, err
    assert _entries(tmp_path) == ["flat.safetensors", "notes.txt"]


@pytest.mark.parametrize("name, named", [("out.bin", "the suffix .bin"), ("out", "it has no suffix")])
def test_an_output_suffix_that_names_no_format_is_refused(saved, tmp_path, capsys, name, named):
    assert main([str(saved), str(tmp_path / name)]) == 1
    err = _error(capsys)
    assert named in err and all(s in err for s in (".pt", ".pth", ".ckpt", ".safetensors")), err
    assert _entries(tmp_path) == []
    assert main([str(saved), str(tmp_path / "out.pth")]) == 0  # a torch file, as .pt and .ckpt
    assert "embed.weight" in torch.load(tmp_path / "out.pth", weights_only=True)


def _save_weights_only(path: str) -> None:
    from lightning_zeroq.checkpoint.checkpointer import Checkpointer
    from lightning_zeroq.checkpoint.engine_io import engine_state, save_state
    from tests.integration.checkpoint.test_faults import _engine

    engine = _engine()
    save_state(engine, Path(path), engine_state(engine, optimizer=False), {"step": 0}, Checkpointer())


def test_optimizer_and_lightning_where_they_cannot_take_effect_are_refused(dist_pool, saved, tmp_path, capsys):
    weights = tmp_path / "weights"
    dist_pool(2).run(_save_weights_only, str(weights))
    for flags in (["--optimizer"], ["--optimizer", "--lightning"]):
        assert main([str(weights), str(tmp_path / "o.ckpt"), *flags]) == 1  # no optimizer state to keep
        err = _error(capsys)
        assert f"{weights} holds no optimizer state" in err and "drop --optimizer" in err, err
    assert main([str(saved), str(tmp_path / "o.safetensors"), "--optimizer", "--lightning"]) == 1
    assert "--lightning needs a torch output" in _error(capsys)
    assert _entries(tmp_path) == ["weights"]
    # Together, on a torch output, both take effect: a Lightning checkpoint (its trainer state) with the
    # optimizer state, the file --optimizer alone writes.
    assert main([str(saved), str(tmp_path / "both.ckpt"), "--optimizer", "--lightning"]) == 0
    assert main([str(saved), str(tmp_path / "optimizer.ckpt"), "--optimizer"]) == 0
    both = torch.load(tmp_path / "both.ckpt", weights_only=True)
    alone = torch.load(tmp_path / "optimizer.ckpt", weights_only=True)
    assert both["step"] == 2 and "embed.weight" in both["state_dict"], sorted(both)
    assert len(both["optimizer_states"][0]["state"]) > 0 and len(both["optimizer_states"][0]["param_groups"]) == 2
    assert both.keys() == alone.keys() and torch.equal(both["state_dict"]["embed.weight"],
                                                       alone["state_dict"]["embed.weight"])


def test_the_output_replaces_an_existing_file_with_normal_permissions(saved, tmp_path):
    out = tmp_path / "model.pt"
    out.write_bytes(b"previous")
    assert main([str(saved), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert "embed.weight" in state and _entries(tmp_path) == ["model.pt"]
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask


def test_unwrap_takes_torchs_exception_out_of_its_pair():
    # DCP reports each rank's failure as (exception, traceback.StackSummary) (torch 2.11-2.13), or as an
    # object with .exception; the message users read is the exception's own, never the pair's repr.
    from types import SimpleNamespace

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from lightning_zeroq.checkpoint.agree import describe
    from lightning_zeroq.checkpoint.safe import unwrap

    try:
        raise OSError(28, "No space left on device")
    except OSError as error:
        pair = _wrap_exception(error)
    assert isinstance(pair, tuple)
    for failures in ({1: pair, 0: pair}, {0: SimpleNamespace(exception=pair[0])}, {0: pair[0]}):
        inner = unwrap(CheckpointException("save failed", failures))
        assert isinstance(inner, OSError) and describe(inner) == "[Errno 28] No space left on device", failures
    nested = CheckpointException("outer", {0: _wrap_exception(CheckpointException("inner", {0: pair}))})
    assert describe(unwrap(nested)) == "[Errno 28] No space left on device"
    assert str(unwrap(CheckpointException("x", {0: "text only"}))) == "text only"


def test_safetensors_output_holds_the_torch_outputs_tensors_bitwise(saved, tmp_path):
    safetensors = pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    assert main([str(saved), str(tmp_path / "model.pt")]) == 0
    assert main([str(saved), str(tmp_path / "full.ckpt"), "--optimizer"]) == 0
    assert main([str(saved), str(tmp_path / "model.safetensors"), "--optimizer"]) == 0
    assert _entries(tmp_path) == ["full.ckpt", "model.pt", "model.safetensors"]  # the staged file is gone
    flat = load_file(str(tmp_path / "model.safetensors"))
    model = torch.load(tmp_path / "model.pt", weights_only=True)
    for name, value in model.items():
        assert flat[name].dtype == value.dtype and torch.equal(flat[name], value), name
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    groups = json.loads(meta["optimizer_param_groups"])
    optim = torch.load(tmp_path / "full.ckpt", weights_only=True)["optimizer_states"][0]
    names = [name for group in groups for name in group["params"]]
    assert [i for g in optim["param_groups"] for i in g["params"]] == list(range(len(names)))
    checked = 0
    for index, state in optim["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(flat[f"optimizer.state.{names[index]}.{key}"], value), (names[index], key)
                checked += 1
    assert checked >= len(model) and len(flat) == len(model) + checked


def test_safetensors_output_without_the_package_is_one_line_naming_the_extra(saved, tmp_path, monkeypatch, capsys):
    reads = []
    monkeypatch.setattr(convert, "read_entries", lambda reader, targets: reads.append(1))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    out = tmp_path / "model.safetensors"
    assert main([str(saved), str(out)]) == 1
    err = _error(capsys)
    assert "pip install safetensors" in err and f"{out} was not written" in err, err
    assert reads == [] and _entries(tmp_path) == []  # said before any work


# ---------------------------------------------------------------------- hyperparameters as Hydra saves them

HYDRA_CFG = {"model": {"dim": 16, "blocks": [1, {"kind": "mlp", "sizes": [4, 8]}]},
             "optim": {"lr": 0.01, "betas": [0.9, 0.99]}, "name": "run", "lr_again": "${optim.lr}"}


def _hydra_lit_module(cfg):
    import lightning as L

    from tests.models import RichModel, param_groups

    class HydraLit(L.LightningModule):
        def __init__(self, cfg) -> None:
            super().__init__()
            self.save_hyperparameters(cfg)  # a DictConfig: Lightning keeps it as one
            self.model = RichModel()

        def training_step(self, batch, batch_idx):
            return self.model.loss((batch[0], batch[1], False))

        def configure_optimizers(self):
            return torch.optim.AdamW(param_groups(self.model), lr=self.hparams.optim.lr)

    return HydraLit(cfg)


def _fit_with_dictconfig_hparams(path: str) -> None:
    import lightning as L
    from omegaconf import OmegaConf

    from lightning_zeroq import ZeroQStrategy
    from tests.models import TokenDataset

    module = _hydra_lit_module(OmegaConf.create(HYDRA_CFG))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroQStrategy(stage=2), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(TokenDataset(16), batch_size=4))
    trainer.save_checkpoint(path)


@pytest.mark.parametrize("flag", ["--optimizer", "--lightning"])
def test_dictconfig_hyperparameters_are_converted_as_saved(dist_pool, tmp_path_factory, tmp_path, flag):
    omegaconf = pytest.importorskip("omegaconf")
    ckpt = tmp_path_factory.getbasetemp() / "hydra.ckpt"
    if not ckpt.exists():
        dist_pool(2).run(_fit_with_dictconfig_hparams, str(ckpt))
    out = tmp_path / "out.ckpt"
    assert main([str(ckpt), str(out), flag]) == 0
    converted = torch.load(out, weights_only=False)  # OmegaConf's classes: a file this test wrote
    hparams = converted["hyper_parameters"]
    assert isinstance(hparams, omegaconf.DictConfig) and converted["hparams_type"] is omegaconf.DictConfig
    # A save stores OmegaConf values resolved (as Lightning's hparams.yaml): no interpolation is left to resolve.
    resolved = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.create(HYDRA_CFG), resolve=True)
    assert omegaconf.OmegaConf.to_container(hparams, resolve=False) == resolved
    assert hparams.model.blocks[1].sizes == [4, 8]
    assert ("optimizer_states" in converted) == (flag == "--optimizer")
    module = type(_hydra_lit_module(hparams)).load_from_checkpoint(out, weights_only=False)
    assert omegaconf.OmegaConf.to_container(module.hparams, resolve=False) == resolved
    assert _entries(tmp_path) == ["out.ckpt"]


# ---------------------------------------------------------------------- a signal in the middle of the read

_HELD_READ = """
import signal, sys
# The dispositions a process starts with: a suite started in the background by a shell hands its children
# SIGINT ignored (and under nohup SIGHUP), and an ignored signal is rightly left alone.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
from lightning_zeroq.checkpoint.files import Files
from lightning_zeroq.cli.convert import main

real = Files.read_into

def held(self, name, offset, buffer):  # the first read of a tensor's bytes waits until the test signals
    print("reading", flush=True)
    sys.stdin.buffer.read(1)
    return real(self, name, offset, buffer)

Files.read_into = held
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_read_is_an_interruption_with_status_130(saved, tmp_path, how):
    import subprocess

    from tests.dist_pool import REPO_ROOT

    out = tmp_path / "out.ckpt"
    with subprocess.Popen([sys.executable, "-c", _HELD_READ, str(saved), str(out), "--optimizer"], cwd=REPO_ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline() == "reading\n"  # inside DCP's read of the first item
        proc.send_signal(getattr(signal, how))
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr == f"zeroq-convert: interrupted ({how}); {out} was not written.\n", stderr
    assert _entries(tmp_path) == []


# ---------------------------------------------------------------------- damage: advice that fits the reader


def _damaged(saved: Path, tmp_path: Path, how: str) -> Path:
    import shutil

    ckpt = tmp_path / f"damaged_{how}"
    shutil.copytree(saved, ckpt)
    shard = ckpt / "__1_0.distcp"
    if how == "missing":
        shard.unlink()
    else:  # one bit of a model tensor's bytes (what every reader reads)
        from lightning_zeroq.checkpoint.safe import read_metadata
        from lightning_zeroq.checkpoint.store import MODEL_KEY

        info = next(i for index, i in sorted(read_metadata(ckpt).storage_data.items(), key=lambda kv: kv[1].offset)
                    if index.fqn.startswith(MODEL_KEY + ".") and i.relative_path == shard.name)
        data = bytearray(shard.read_bytes())
        data[info.offset + info.length // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    return ckpt


@pytest.mark.parametrize("how", ["flipped", "missing"])
def test_damage_advice_fits_the_reader(saved, tmp_path, capsys, how):
    from lightning_zeroq.checkpoint.agree import CheckpointError

    ckpt = _damaged(saved, tmp_path, how)
    assert main([str(ckpt), str(tmp_path / "o.pt")]) == 1
    err = _error(capsys)
    assert "__1_0.distcp" in err and "Convert an earlier checkpoint" in err and "Resume" not in err, err
    with pytest.raises(CheckpointError) as caught:  # what LightningModule.load_from_checkpoint(dir) reads through
        convert.lightning_checkpoint(ckpt)
    assert "Load an earlier checkpoint" in str(caught.value) and "Resume" not in str(caught.value), caught.value


# ---------------------------------------------------------------------- no room for the output


def test_no_space_for_the_output_is_one_line_with_the_sizes_and_no_file_left(saved, tmp_path, monkeypatch, capsys):
    import errno

    assert main([str(saved), str(tmp_path / "fits.ckpt"), "--optimizer"]) == 0
    capsys.readouterr()
    size = (tmp_path / "fits.ckpt").stat().st_size

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    out = tmp_path / "out.ckpt"
    assert main([str(saved), str(out), "--optimizer"]) == 1
    err = _error(capsys)
    assert f"needs {size} bytes" in err and re.search(r"has \d+ bytes \(.*\) free", err) and str(tmp_path) in err, err
    assert "No space left on device" in err and "free space" in err and f"{out} was not written" in err, err
    assert _entries(tmp_path) == ["fits.ckpt"]


_LIMITED = """
import resource, sys
from lightning_zeroq.cli.convert import main

limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("suffix", [".ckpt", ".safetensors"])
def test_a_file_size_limit_is_named_as_the_reason(saved, tmp_path, suffix):
    import subprocess

    from tests.dist_pool import REPO_ROOT

    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    out = tmp_path / f"out{suffix}"
    # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG instead of ending the process
    run = subprocess.run([sys.executable, "-c", _LIMITED, "8192", str(saved), str(out), "--optimizer"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("zeroq-convert: error: "), run.stderr
    assert "could not grow" in run.stderr and "8192 bytes" in run.stderr and "ulimit -f" in run.stderr, run.stderr
    assert "unexpected pos" not in run.stderr and f"{out} was not written" in run.stderr, run.stderr
    assert _entries(tmp_path) == []
