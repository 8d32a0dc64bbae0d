"""Touching stage-3 parameters outside forward and backward: a clear error instead of a crash, and
``gathered_parameters`` to read and change them (with real transient units: threshold 0)."""

from __future__ import annotations

import gc
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq
from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.zero.unit import FreedParameter
from tests.models import RichModel, make_batch, param_groups

TRANSIENT = {"stage3_wrap_classes": ["Sequential", "Linear"], "stage3_param_persistence_threshold": 0}


def _engine() -> tuple[RichModel, ZeroEngine]:
    torch.manual_seed(0)
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(stage=3, **TRANSIENT))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    engine.backward(model.loss(make_batch(0, 0, dist.get_rank(), uniform=True)))
    engine.step()
    return model, engine


def _freed_body() -> list[str]:
    model, engine = _engine()
    weight = model.block[0].weight
    assert isinstance(weight, FreedParameter)
    assert weight.shape == (16, 16) and weight.numel() == 256 and weight.requires_grad  # metadata reads
    messages = []
    for touch in (lambda: weight.sum(), lambda: weight.clone(), lambda: model.state_dict(), lambda: weight + 1,
                  lambda: weight.data):
        with pytest.raises(RuntimeError) as info:
            touch()
        messages.append(str(info.value))
    return messages


def test_touching_a_freed_parameter_raises_naming_it_and_the_fix(dist_pool):
    # Before: weight.sum(), weight.clone() and model.state_dict()[k].clone() crashed the process (SIGSEGV).
    for messages in dist_pool(2).run(_freed_body):
        assert all("block.0.weight" in m and "gathered_parameters" in m for m in messages), messages


def _gathered_body() -> None:
    model, engine = _engine()
    full = engine.full_state_dict()
    with lightning_zeroq.gathered_parameters(model.block):
        weight = model.block[0].weight
        assert type(weight) is torch.nn.Parameter and weight.dtype == torch.float32
        assert torch.equal(weight.detach(), full["block.0.weight"])  # every rank reads the full values
    assert isinstance(model.block[0].weight, FreedParameter)  # sharded again outside
    with lightning_zeroq.gathered_parameters(model, writeback=True):
        with torch.no_grad():
            model.block[0].weight.fill_(0.25)
            model.norm.weight.mul_(2.0)  # a persistent unit's parameter
    after = engine.full_state_dict()
    assert torch.equal(after["block.0.weight"], torch.full((16, 16), 0.25))
    assert torch.equal(after["norm.weight"], full["norm.weight"] * 2)
    assert torch.equal(model.norm.weight.detach(), full["norm.weight"] * 2)  # working weights republished
    engine.backward(model.loss(make_batch(1, 0, dist.get_rank(), uniform=True)))  # and training goes on
    assert engine.step()


def test_gathered_parameters_reads_and_writes_back_full_parameters(dist_pool):
    dist_pool(3).run(_gathered_body)


def test_gathered_parameters_on_a_plain_module_is_a_no_op():
    model = RichModel()
    with lightning_zeroq.gathered_parameters(model):
        assert type(model.block[0].weight) is torch.nn.Parameter


def _dropped_nvme_engine_body(path: str) -> list[str]:
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(stage=3, offload_optimizer=True, offload_optimizer_device="nvme",
                                          offload_parameters=True, offload_params_device="nvme", nvme_path=path,
                                          **TRANSIENT))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    mine = f"*_rank{dist.get_rank():05d}_*/*.swp"
    assert list(pathlib.Path(path).glob(mine))
    del engine, model  # no close()
    gc.collect()
    return [str(p) for p in pathlib.Path(path).glob(mine)]


def test_an_engine_dropped_without_close_removes_its_swap_files(dist_pool, tmp_path):
    # Before: 1,101 swap files were left behind after one test run.
    assert dist_pool(2).run(_dropped_nvme_engine_body, str(tmp_path)) == [[], []]


def test_swap_files_are_removed_at_interpreter_exit(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from lightning_zeroq import ZeroConfig, ZeroEngine
        model = torch.nn.Linear(8, 8)
        engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True, offload_optimizer_device="nvme",
                                              nvme_path={str(tmp_path)!r}))
        engine.attach_optimizer(torch.optim.AdamW(model.parameters()))
        import pathlib
        assert list(pathlib.Path({str(tmp_path)!r}).glob("*/*.swp"))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert not list(tmp_path.glob("*/*.swp"))
