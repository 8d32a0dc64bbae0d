"""Bad input gives a clear error naming the value; registration is side-effect free (the lean import:
``tests/test_import.py``)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_zeroq import ZeroConfig, ZeroEngine, ZeroQStrategy, register_elementwise_optimizer
from lightning_zeroq.zero.policies import ineffective


@pytest.mark.parametrize(
    "options, match",
    [
        ({"stage": 4}, r"stage=4"),
        ({"stage": 0}, r"stage=0"),
        ({"reduce_bucket_size": 0}, r"reduce_bucket_size=0"),
        ({"reduce_bucket_size": -5}, r"reduce_bucket_size=-5"),
        ({"allgather_bucket_size": -1}, r"allgather_bucket_size=-1"),
        ({"allgather_bucket_size": 2.5}, r"allgather_bucket_size=2.5"),
        ({"overlap_comm": "yes"}, r"overlap_comm='yes'"),
        ({"offload_optimizer_device": "disk"}, r"offload_optimizer_device='disk'"),
        ({"offload_parameters": True, "stage": 2}, r"offload_parameters=True needs stage=3"),
        ({"offload_optimizer": True, "offload_optimizer_device": "nvme"}, r"nvme_path=None"),
        ({"loss_scale": -1.0}, r"loss_scale=-1.0"),
        ({"stage3_param_persistence_threshold": -1}, r"stage3_param_persistence_threshold=-1"),
        ({"stage3_unit_size": 0}, r"stage3_unit_size=0"),
        ({"stage3_wrap_classes": "Block"}, r"stage3_wrap_classes='Block' must be a list"),
        ({"stage3_wrap_classes": ["Block"], "stage3_unit_size": 10}, r"not both"),
        ({"quantized_weights_group_size": 12}, r"quantized_weights_group_size=12 must be a positive multiple of 8"),
        ({"quantized_weights_group_size": 0}, r"quantized_weights_group_size=0"),
        ({"quantized_weights_group_size": -8}, r"quantized_weights_group_size=-8"),
        ({"quantized_weights": True, "allgather_bucket_size": 32}, r"allgather_bucket_size=32 is smaller than one"),
        ({"quantized_weights_exact_numel": -1}, r"quantized_weights_exact_numel=-1"),
        ({"initial_scale_power": -2}, r"initial_scale_power=-2"),
        ({"loss_scale_window": 0}, r"loss_scale_window=0"),
        ({"min_loss_scale": 0}, r"min_loss_scale=0"),
        ({"offload_optimizer_ratio": 1.5}, r"offload_optimizer_ratio=1.5 must be a number from 0 to 1"),
        ({"offload_optimizer_ratio": -0.25}, r"offload_optimizer_ratio=-0.25 must be a number from 0 to 1"),
        ({"offload_optimizer_ratio": "half"}, r"offload_optimizer_ratio='half' must be a number from 0 to 1"),
        ({"offload_optimizer_ratio": True}, r"offload_optimizer_ratio=True must be a number from 0 to 1"),
        ({"offload_optimizer_ratio": float("nan")}, r"offload_optimizer_ratio=nan must be a number from 0 to 1"),
        ({"offload_optimizer": True, "offload_optimizer_device": "nvme", "nvme_path": "/tmp",
          "offload_optimizer_ratio": 0.5}, r"offload_optimizer_ratio=0.5: partial .* offload_optimizer_device='cpu'"),
        ({"offload_optimizer_nvme_ratio": 0}, r"offload_optimizer_nvme_ratio=0 must be a number above 0 .*='cpu'"),
        ({"offload_optimizer_nvme_ratio": 1.5}, r"offload_optimizer_nvme_ratio=1.5 must be a number above 0"),
        ({"offload_optimizer_nvme_ratio": "some"}, r"offload_optimizer_nvme_ratio='some' must be a number"),
        ({"offload_optimizer_nvme_ratio": True}, r"offload_optimizer_nvme_ratio=True must be a number"),
    ],
)
def test_config_rejects_bad_values(options, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**options)
    with pytest.raises(ValueError, match=match):
        ZeroQStrategy(**options)


def test_float_bucket_sizes_are_accepted_as_integers():
    assert ZeroConfig(reduce_bucket_size=2e8).reduce_bucket_size == 200_000_000


def test_offload_optimizer_ratio_accepts_the_closed_unit_interval():
    for ratio in (0, 0.0, 0.25, 1, 1.0):
        config = ZeroConfig(offload_optimizer=True, offload_optimizer_ratio=ratio)
        assert config.offload_optimizer_ratio == float(ratio) and isinstance(config.offload_optimizer_ratio, float)
        assert not ineffective(config, loss_scaling=False)
    # NVMe with the whole optimizer offloaded (the default ratio) stays valid.
    ZeroConfig(offload_optimizer=True, offload_optimizer_device="nvme", nvme_path="/tmp", offload_optimizer_ratio=1)


@pytest.mark.parametrize(
    "options, loss_scaling, says",
    [
        ({"allgather_bucket_size": 4096}, False, "allgather_bucket_size=4096 has no effect without quantized_weights"),
        ({"quantized_weights_group_size": 128}, False, "quantized_weights_group_size=128 has no effect"),
        ({"stage": 2, "stage3_unit_size": 10}, False, "stage3_unit_size=10 has no effect in stage 2"),
        ({"stage": 3, "reduce_bucket_size": 1000}, False, "reduce_bucket_size=1000 has no effect in stage 3"),
        ({"loss_scale": 128.0}, False, "loss_scale=128.0 only applies to precision='16-mixed'"),
        ({"offload_params_device": "nvme"}, False, "offload_params_device='nvme' has no effect"),
        ({"nvme_path": "/tmp"}, False, "nvme_path='/tmp' has no effect"),
        ({"offload_optimizer_ratio": 0.5}, False, "offload_optimizer_ratio=0.5 has no effect without offload_optimizer"),
        ({"offload_optimizer": True, "offload_optimizer_nvme_ratio": 0.5}, False,
         "offload_optimizer_nvme_ratio=0.5 has no effect without offload_optimizer=True and offload_optimizer_device"),
    ],
)
def test_settings_that_cannot_take_effect_warn_once_at_engine_build(options, loss_scaling, says):
    import warnings

    from lightning_zeroq import ZeroEngine

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZeroEngine(torch.nn.Linear(4, 4), ZeroConfig(**options), loss_scaling=loss_scaling)
    messages = [str(w.message) for w in caught if "ZeroConfig" in str(w.message)]
    assert len(messages) == 1 and says in messages[0], messages


def test_effective_settings_do_not_warn():
    import warnings

    from lightning_zeroq import ZeroEngine

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroEngine(torch.nn.Linear(4, 4), ZeroConfig(stage=3, quantized_weights=True, allgather_bucket_size=4096,
                                                     stage3_unit_size=10, loss_scale=64.0), loss_scaling=True)


@pytest.mark.parametrize(
    "name, stage, params",
    [("zeroq_stage_2_offload", 2, False), ("zeroq_stage_3_offload", 3, True)],
)
def test_offload_presets(name, stage, params):
    import lightning as L

    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1)
    config = trainer.strategy.config
    assert (config.stage, config.offload_optimizer, config.offload_parameters) == (stage, True, params)


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match=r"stagee"):
        ZeroQStrategy(stagee=2)


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision_is_named(precision):
    import lightning as L

    with pytest.raises(ValueError, match=f"precision='{precision}'"):
        L.Trainer(strategy="zeroq", accelerator="cpu", devices=1, precision=precision)


def test_non_elementwise_optimizer_is_rejected_by_name():
    model = torch.nn.Linear(4, 4)
    engine = ZeroEngine(model, ZeroConfig())
    with pytest.raises(ValueError, match=r"LBFGS"):
        engine.attach_optimizer(torch.optim.LBFGS(model.parameters()))
    if hasattr(torch.optim, "Adafactor"):  # refused with its own reason
        with pytest.raises(ValueError, match=r"Adafactor: its second moment of each matrix is factored .*Muon"):
            engine.attach_optimizer(torch.optim.Adafactor(model.parameters()))

    @register_elementwise_optimizer
    class MySGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    engine.attach_optimizer(MySGD(model.parameters()))  # declared elementwise: accepted


def test_presets_registered_and_idempotent():
    from lightning.pytorch.strategies import StrategyRegistry

    ZeroQStrategy.register_strategies(StrategyRegistry)  # a second registration is a no-op
    for name, stage in [("zeroq", 2), ("zeroq_stage_1", 1), ("zeroq_stage_2", 2), ("zeroq_stage_3", 3)]:
        assert StrategyRegistry.get(name).config.stage == stage


def test_stage3_unknown_wrap_class_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no module of class \['Blok'\].*Linear"):
        ZeroEngine(model, ZeroConfig(stage=3, stage3_wrap_classes=["Blok"]))


@pytest.mark.parametrize("stage", [2, 3])
def test_parameters_on_meta_beside_real_ones_are_materialized(stage):
    # Stage 3's construction contexts put only parameters on meta; the rest of a module is real.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].to("meta")
    ZeroEngine(model, ZeroConfig(stage=stage))
    assert not any(p.is_meta for p in model.parameters())


def test_stage3_rejects_the_spawn_launcher():
    with pytest.raises(ValueError, match="start_method='spawn'"):
        ZeroQStrategy(stage=3, start_method="spawn")
    assert ZeroQStrategy(stage=2, start_method="spawn").config.stage == 2


# Every option users can set, frozen: a new option (or a renamed one) is a decision, made here, in
# docs/options.md (tests/test_readme.py checks it) and, where DeepSpeed or FSDP has the same knob, under
# its name there (docs/migrating.md).
FROZEN_OPTIONS = (
    "stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "managed_gradient_accumulation",
    "offload", "offload_optimizer", "offload_optimizer_device", "offload_optimizer_ratio", "offload_optimizer_nvme_ratio",
    "offload_memory_budget", "host_memory_budget", "offload_speculative_step", "offload_async_step",
    "offload_parameters", "offload_params_device", "nvme_path", "quantized_weights", "quantized_weights_group_size",
    "quantized_weights_exact_numel", "stage3_wrap_classes", "stage3_unit_size", "stage3_param_persistence_threshold",
    "frozen_dtype", "stage3_prefetch", "stage3_prefetch_depth", "reshard_after_forward", "activation_checkpointing_policy",
    "activation_offloading_policy", "activation_offloading_min_bytes",
    "quantized_gradients", "shard_group_size",
    "quantize_cross_group_only", "nonfinite_gradients", "loss_scale", "initial_scale_power", "loss_scale_window",
    "min_loss_scale",
)


def test_the_options_are_the_frozen_list():
    import dataclasses

    names = tuple(f.name for f in dataclasses.fields(ZeroConfig))
    added, removed = sorted(set(names) - set(FROZEN_OPTIONS)), sorted(set(FROZEN_OPTIONS) - set(names))
    assert names == FROZEN_OPTIONS, (
        f"ZeroConfig's options changed (added {added}, removed {removed}, or reordered): a new or renamed option is a "
        "decision; update FROZEN_OPTIONS, docs/options.md and, for a DeepSpeed or FSDP knob, docs/migrating.md")


def test_plan_forward_must_be_a_function():
    from lightning_zeroq import ZeroQFabricStrategy

    for cls in (ZeroQStrategy, ZeroQFabricStrategy):
        with pytest.raises(ValueError, match=r"plan_forward=3\) is not a function; pass a function of the model"):
            cls(offload="auto", plan_forward=3)


def test_offload_auto_refuses_what_it_would_decide():
    with pytest.raises(ValueError, match=r"offload='bogus'.*'auto'"):
        ZeroConfig(offload="bogus")
    with pytest.raises(ValueError, match=r"offload='auto' decides what offload_optimizer=True, offload_parameters=True"):
        ZeroConfig(stage=3, offload="auto", offload_optimizer=True, offload_parameters=True)
    assert ZeroConfig(offload="auto", activation_checkpointing_policy="auto").activation_checkpointing_policy == "auto"
    with pytest.raises(ValueError, match="decided from a plan"):  # the engine takes only a decided config
        from lightning_zeroq.zero.policies import from_config

        from_config(ZeroConfig(offload="auto"), loss_scaling=False)


@pytest.mark.parametrize("name", ["offload_memory_budget", "host_memory_budget"])
def test_both_memory_budgets_read_the_same_forms_with_the_same_messages(name):
    """GiB as a number (or a string of one), a size with its unit, or a share: one reading for both budgets."""
    from lightning_zeroq.config import budget_form, host_budget, memory_budget

    read = host_budget if name == "host_memory_budget" else lambda value: budget_form(name, value, "")
    for value, gib in ((60, 60.0), ("60", 60.0), ("1e30", 1e30), (" 60 GiB", 60.0), ("500MiB", 500 / 1024),
                       ("2TB", 2e12 / 2**30), ("1.5gib", 1.5)):
        ZeroConfig(**{name: value})
        assert read(value) == (pytest.approx(gib), False), value
    assert read("80%") == (80.0, True)
    for value, says in (("-1", "must be above 0"), (-1, "must be above 0"), ("0GiB", "must be above 0"),
                        ("inf", "must be above 0 and finite"), ("nan", "must be above 0"), ("150%", r"must be above 0 and finite \(a share at most 100%\)"),
                        ("80%%", "is not a number"), ("lots", "is not a number"), ("60 parsecs", "is not a number"),
                        (True, "is not a number"), ([60], "is not a number")):
        with pytest.raises(ValueError, match=rf"ZeroConfig\.{name}={re.escape(repr(value))} {says}.*a size with its "
                                             r"unit \(e\.g\. '60GiB'"):
            ZeroConfig(**{name: value})
    assert memory_budget("40GiB", 80 * 2**30) == 40 * 2**30 and memory_budget("50%", 80 * 2**30) == 40 * 2**30


@pytest.mark.parametrize("options, fix", [
    ({"offload_async_step": True}, "set offload_optimizer=True."),
    ({"offload_async_step": True, "offload_optimizer": True, "offload_optimizer_ratio": 0.0},
     "set offload_optimizer_ratio above 0 and not 'auto' (it is 0.0)."),
    ({"offload_async_step": True, "offload_optimizer": True, "offload_optimizer_device": "nvme", "nvme_path": "/tmp"},
     "set offload_optimizer_device='cpu' (it is 'nvme')."),
])
def test_async_step_without_its_offload_names_the_setting_to_change(options, fix):
    said = [m for m in ineffective(ZeroConfig(**options), loss_scaling=False) if "offload_async_step" in m]
    assert said == [f"offload_async_step=True has no effect without CPU optimizer offload of a fixed share: {fix}"]
