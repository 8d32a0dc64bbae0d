"""The front door: ``ZeroConfig`` -> frozen policies, and the objects chosen once from them.

No process group: these check which policy and which object each setting chooses; the parity tests
check that training with them is unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero import accumulate, policies, step
from lightning_zeroq.zero.offload import optimizer_home
from lightning_zeroq.zero.offload.auto import AutoSplit
from lightning_zeroq.zero.offload.device import OptimizerHome
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.offload.host_worker import HostWorker
from lightning_zeroq.zero.offload.split import SplitOptimizer
from lightning_zeroq.zero.optim.binding import Binding
from lightning_zeroq.zero.policies import Auto, Buckets, Host, ModuleUnits, Nvme, OnDevice

CPU = torch.device("cpu")


@pytest.mark.parametrize("options, optimizer, parameters", [
    ({}, OnDevice(), OnDevice()),
    ({"offload_optimizer": True}, Host(1.0), OnDevice()),
    ({"offload_optimizer": True, "offload_optimizer_ratio": 0.25}, Host(0.25), OnDevice()),
    ({"offload_optimizer": True, "offload_optimizer_ratio": 0}, OnDevice(), OnDevice()),  # 0 offloads nothing
    ({"offload_optimizer": True, "offload_optimizer_ratio": "auto", "offload_memory_budget": "50%"},
     Auto("50%"), OnDevice()),
    ({"offload_optimizer_ratio": 0.5}, OnDevice(), OnDevice()),  # without offload_optimizer: no effect
    ({"stage": 3, "offload_parameters": True}, OnDevice(), Host()),
    ({"stage": 3, "offload_optimizer": True, "offload_optimizer_device": "nvme", "offload_parameters": True,
      "offload_params_device": "nvme", "nvme_path": "/swap"}, Nvme("/swap"), Nvme("/swap")),
])
def test_offload_policy(options, optimizer, parameters):
    offload = policies.from_config(ZeroConfig(**options), loss_scaling=False).offload
    assert (offload.optimizer, offload.parameters) == (optimizer, parameters)


def test_units_policy_follows_the_stage():
    assert policies.from_config(ZeroConfig(stage=1, reduce_bucket_size=123), loss_scaling=False).sharding.units \
        == Buckets(123)
    config = ZeroConfig(stage=3, stage3_wrap_classes=["Block"], stage3_param_persistence_threshold=0,
                        stage3_prefetch_depth=2, reshard_after_forward=False)
    assert policies.from_config(config, loss_scaling=False).sharding.units == ModuleUnits(
        wrap_classes=("Block",), unit_size=None, persistence_threshold=0, prefetch_depth=2,
        reshard_after_forward=False)
    no_prefetch = config.replace(stage3_prefetch=False)
    units = policies.from_config(no_prefetch, loss_scaling=False).sharding.units
    assert isinstance(units, ModuleUnits) and units.prefetch_depth == 0


def test_loss_scaling_and_quantization_policies():
    config = ZeroConfig(loss_scale=0, initial_scale_power=10, loss_scale_window=50, min_loss_scale=2,
                        quantized_gradients=True, quantized_weights_group_size=128, nonfinite_gradients="skip")
    made = policies.from_config(config, loss_scaling=True)
    assert made.numerics == policies.Numerics(policies.LossScaling(None, 1024.0, 50, 2.0), "skip")
    assert made.quantization.any and not made.quantization.weights and made.quantization.group_size == 128
    fixed = policies.from_config(config.replace(loss_scale=8), loss_scaling=True).numerics.loss_scaling
    assert fixed is not None and fixed.fixed_scale == 8.0
    without = policies.from_config(config, loss_scaling=False)
    assert without.numerics.loss_scaling is None
    assert any("initial_scale_power" in m for m in without.ineffective)  # warned about, as before
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.sharding.stage = 1  # type: ignore[misc]


@pytest.mark.parametrize("offload, placement", [
    (OnDevice(), OptimizerHome), (Host(1.0), HostOptimizer), (Host(0.5), SplitOptimizer), (Auto(None), AutoSplit),
])
def test_offload_policy_chooses_the_placement(offload, placement):
    from lightning_zeroq.zero.unit import plan_layouts
    from lightning_zeroq.zero.unit_plan import UnitSpec

    specs = [UnitSpec([torch.nn.Parameter(torch.zeros(n))], None, True) for n in (64, 32)]
    chosen = optimizer_home(offload, CPU, torch.bfloat16, 0, 1, plan_layouts(specs, 1, 8), HostWorker(threaded=False))
    assert type(chosen) is placement


@pytest.mark.parametrize("stage, managed, dtype, kind", [
    (2, True, torch.bfloat16, accumulate.EveryBackward), (3, False, torch.float32, accumulate.EveryBackward),
    (1, True, torch.float32, accumulate.InGrad), (1, False, torch.bfloat16, accumulate.Fp32Sum),
])
def test_accumulation_is_chosen_once(stage, managed, dtype, kind):
    sharding = policies.from_config(ZeroConfig(stage=stage, managed_gradient_accumulation=managed),
                                    loss_scaling=False).sharding
    chosen = accumulate.accumulation(sharding, [], dtype, CPU)
    assert type(chosen) is kind
    # A backward reduces always in stages 2/3; in stage 1 only at the end of a managed window.
    assert chosen.begin(boundary=True) is (stage >= 2 or managed)
    assert chosen.begin(boundary=False) is (stage >= 2)
    assert chosen.pending is (stage == 1)


def test_one_or_several_optimizers():
    everything = Binding(None, {}, frozenset(), frozenset(), [])  # type: ignore[arg-type]
    a, b = (Binding(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), {}, frozenset({i}), frozenset(), [])
            for i in range(2))
    assert step.attached([], everything).binding(None) is everything
    one = step.attached([a], everything)
    assert type(one) is step.OneOptimizer and one.binding(None) is a and one.binding(a.optimizer) is a
    several = step.attached([a, b], everything)
    assert type(several) is step.SeveralOptimizers and several.binding(None) is everything
    assert several.binding(b.optimizer) is b
    with pytest.raises(ValueError, match="SGD is not attached to this engine"):
        one.binding(b.optimizer)


@pytest.mark.parametrize("options, loss_scaling, expected", [
    ({"offload_speculative_step": True}, False, "without CPU optimizer offload"),
    ({"offload_optimizer": True, "offload_speculative_step": True}, True, "with fp16 loss scaling"),
    ({"offload_optimizer": True, "offload_speculative_step": True, "managed_gradient_accumulation": False}, False,
     "with managed_gradient_accumulation=False"),
    ({"offload_optimizer": True, "offload_optimizer_ratio": "auto", "offload_async_step": True}, False,
     "offload_async_step=True has no effect without CPU optimizer offload of a fixed share"),
    ({"offload_optimizer": True, "offload_optimizer_ratio": 0.0, "host_memory_budget": 10}, False,
     "host_memory_budget=10 has no effect"),
    ({"stage": 2, "stage3_prefetch_depth": 3}, False, "stage3_prefetch_depth=3 has no effect in stage 2"),
    ({"loss_scale_window": 50}, False, "loss_scale_window=50 only applies to precision='16-mixed'"),
])
def test_a_setting_the_policies_leave_out_is_named_with_why(options, loss_scaling, expected):
    """The sentence comes from the policy that decided: the setting is off in the policy exactly when it is named."""
    made = policies.from_config(ZeroConfig(**options), loss_scaling=loss_scaling)
    assert sum(expected in m for m in made.ineffective) == 1, made.ineffective
    assert not made.offload.speculative and not made.offload.asynchronous
    for on in ({"offload_optimizer": True, "offload_speculative_step": True, "offload_async_step": True},):
        assert policies.from_config(ZeroConfig(**on), loss_scaling=False).ineffective == ()
