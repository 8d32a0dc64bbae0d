"""Bad arguments to the strategies and helpers: one error at construction (or at the call) that names the
value and the fix, never a traceback from deep inside a fit."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import lightning_zeroq
from lightning_zeroq import ZeroConfig, ZeroQFabricStrategy, ZeroQStrategy, register_elementwise_optimizer

STRATEGIES = [ZeroQStrategy, ZeroQFabricStrategy]


@pytest.mark.parametrize("strategy_cls", STRATEGIES)
@pytest.mark.parametrize("timeout, seconds", [(60, 60.0), (2.5, 2.5), (timedelta(minutes=3), 180.0)])
def test_timeout_takes_seconds_or_a_timedelta(strategy_cls, timeout, seconds):
    assert strategy_cls(timeout=timeout)._timeout == timedelta(seconds=seconds)


@pytest.mark.parametrize("strategy_cls", STRATEGIES)
@pytest.mark.parametrize("timeout, says", [
    (timedelta(seconds=-5), "must be positive"),
    (timedelta(0), "must be positive"),
    (0, "must be positive"),
    (-1.0, "must be positive"),
    (float("inf"), "must be positive"),
    ("60", "is not a duration"),
    (True, "is not a duration"),
])
def test_bad_timeouts_are_refused_at_construction(strategy_cls, timeout, says):
    with pytest.raises(ValueError, match=rf"{strategy_cls.__name__}\(timeout=.*\) {says}.*timedelta\(minutes=30\)"):
        strategy_cls(timeout=timeout)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_async_checkpoint_must_be_a_bool(value):
    with pytest.raises(ValueError, match=rf"ZeroQStrategy.async_checkpoint={value!r} must be true or false"):
        ZeroQStrategy(async_checkpoint=value)


@pytest.mark.parametrize("strategy_cls", STRATEGIES)
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_exclude_frozen_parameters_must_be_a_bool(strategy_cls, value):
    name = strategy_cls.__name__
    with pytest.raises(ValueError, match=rf"{name}.exclude_frozen_parameters={value!r} must be true or false"):
        strategy_cls(exclude_frozen_parameters=value)
    assert strategy_cls(exclude_frozen_parameters=True).exclude_frozen_parameters is True
    assert strategy_cls().exclude_frozen_parameters is False


@pytest.mark.parametrize("stage", [2.0, "2", True])
def test_stage_must_be_an_int(stage):
    with pytest.raises(ValueError, match=r"ZeroConfig.stage=.* is not a ZeRO stage; use 1, 2 or 3"):
        ZeroConfig(stage=stage)


@pytest.mark.parametrize("path", ["s3://bucket", "gs://b/swap", "file:///tmp/x", 3])
def test_nvme_path_must_be_a_local_directory(path):
    with pytest.raises(ValueError, match=r"ZeroConfig.nvme_path=.*(remote file system|local directory)"):
        ZeroConfig(offload_optimizer=True, offload_optimizer_device="nvme", nvme_path=path)


@pytest.mark.parametrize("value, got", [(int, "the class int"), ("Adam", "an object of type str"),
                                        (torch.optim.Adam([torch.zeros(1, requires_grad=True)]), "an object of type Adam")])
def test_register_elementwise_optimizer_takes_an_optimizer_class(value, got):
    before = list(lightning_zeroq.zero.optim.binding.ELEMENTWISE_OPTIMIZERS)
    with pytest.raises(TypeError, match=rf"register_elementwise_optimizer\(\) takes an optimizer class .*got {got}\.$"):
        register_elementwise_optimizer(value)
    assert lightning_zeroq.zero.optim.binding.ELEMENTWISE_OPTIMIZERS == before


def test_gathered_parameters_takes_a_module():
    with pytest.raises(TypeError, match=r"gathered_parameters\(module\) takes the nn.Module .* got str 'x'"):
        lightning_zeroq.gathered_parameters("x")
    with pytest.raises(TypeError, match=r"ZeroQStrategy.gathered_parameters\(module\) takes the nn.Module"):
        ZeroQStrategy().gathered_parameters("x")


def test_fabric_refuses_a_checkpoint_io_it_would_ignore():
    with pytest.raises(ValueError, match=r"ZeroQFabricStrategy does not use a CheckpointIO plugin \(got "
                                         r"TorchCheckpointIO\).*Remove checkpoint_io"):
        ZeroQFabricStrategy(checkpoint_io=TorchCheckpointIO())
    strategy = ZeroQFabricStrategy()
    with pytest.raises(ValueError, match=r"does not use a CheckpointIO plugin"):
        strategy.checkpoint_io = TorchCheckpointIO()  # what Fabric(plugins=[...]) does


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_pretrained_options_are_validated_at_construction(strategy, tmp_path):
    name = strategy.__name__
    with pytest.raises(ValueError, match=rf"^{name}\(pretrained=\.\.\.\): .*nowhere does not exist; pass the path"):
        strategy(pretrained=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=rf"^{name}\(pretrained=\.\.\.\): 's3://b/m' names a remote file system"):
        strategy(pretrained="s3://b/m")
    with pytest.raises(ValueError, match=rf"^{name}\(pretrained_name_map=\.\.\.\): 'loras' is no name map"):
        strategy(pretrained=str(tmp_path), pretrained_name_map="loras")
    with pytest.raises(ValueError, match=rf"^{name}\(pretrained_allow_missing=\.\.\.\): 3 is neither glob"):
        strategy(pretrained=str(tmp_path), pretrained_allow_missing=3)
    with pytest.raises(ValueError, match=rf"^{name}\(pretrained_allow_unexpected=\.\.\.\): 'adapters' names"):
        strategy(pretrained=str(tmp_path), pretrained_allow_unexpected="adapters")
    with pytest.raises(ValueError, match=rf"^{name}\(pretrained_name_map=\.\.\.\) has nothing to map without pretrained"):
        strategy(pretrained_name_map={"model.": ""})
    strategy(pretrained=str(tmp_path), pretrained_name_map="peft", pretrained_allow_missing="adapters",
             pretrained_allow_unexpected=["*.inv_freq"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_pretrained_option_errors_are_one_line_and_the_same_for_both(strategy, tmp_path):
    other = ZeroQStrategy if strategy is ZeroQFabricStrategy else ZeroQFabricStrategy
    for kwargs in ({"pretrained": str(tmp_path / "nowhere")}, {"pretrained_allow_missing": "x"}):
        with pytest.raises(ValueError) as mine:
            strategy(**kwargs)
        with pytest.raises(ValueError) as theirs:
            other(**kwargs)
        assert len(str(mine.value).splitlines()) == 1
        assert str(mine.value).replace(strategy.__name__, "S") == str(theirs.value).replace(other.__name__, "S")
