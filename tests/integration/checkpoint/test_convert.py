"""zeroq-convert writes its output atomically and says what went wrong in one line of its own: on any
failure (a damaged checkpoint, an error half-way through, Ctrl-C, SIGTERM) nothing is left at the
output path, an existing file there is kept, and no temporary file remains."""

from __future__ import annotations

import json
import os
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
