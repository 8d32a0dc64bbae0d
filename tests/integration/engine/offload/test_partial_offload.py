"""Partial optimizer offload (``offload_optimizer_ratio``): which units go to the host, where their
masters live, and that a partial-offload engine's sharded state loads into another ratio.
Parity with DDP and checkpoints across world sizes: ``test_engine_parity.py``, ``test_checkpoint_engine.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.zero.layout import UnitLayout, make_layout
from lightning_zeroq.zero.offload import OptimizerHome, SplitOptimizer, host_units
from lightning_zeroq.zero.offload.stores import MasterAlias
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.policies import ineffective
from tests.models import RichModel, make_batch, param_groups

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


@pytest.mark.parametrize("world_size", [1, 2, 7])
def test_host_units_are_the_largest_first_until_the_ratio_is_reached(world_size: int) -> None:
    layouts = [make_layout(numels, world_size) for numels in ([10], [30, 10], [40], [5], [5])]  # 100 elements
    chosen = {ratio: sorted(host_units(layouts, ratio)) for ratio in (0.0, 0.25, 0.4, 0.41, 0.8, 0.81, 0.95, 1.0)}
    assert chosen == {
        0.0: [],
        0.25: [1],  # units 1 and 2 tie at 40: the lower index first
        0.4: [1],  # 40 of 100 reaches 0.4
        0.41: [1, 2],
        0.8: [1, 2],
        0.81: [0, 1, 2],
        0.95: [0, 1, 2, 3],
        1.0: [0, 1, 2, 3, 4],
    }


def test_with_overlapping_host_steps_the_last_units_go_to_the_host_first() -> None:
    """Speculative or asynchronous host steps: the units landed first (the last ones) go to the host, the
    first units (an embedding: needed first by the next forward, landed last) stay on the device."""
    layouts = [make_layout(numels, 1) for numels in ([10], [30, 10], [40], [5], [5])]  # 100 elements
    chosen = {ratio: sorted(host_units(layouts, ratio, last_first=True)) for ratio in (0.0, 0.1, 0.11, 0.5, 0.51, 1.0)}
    assert chosen == {0.0: [], 0.1: [3, 4], 0.11: [2, 3, 4], 0.5: [2, 3, 4], 0.51: [1, 2, 3, 4], 1.0: [0, 1, 2, 3, 4]}
    for options in ({"offload_speculative_step": True}, {"offload_async_step": True}, {}):
        engine = _engine(0.5, **options)
        layouts = [u.layout for u in engine.parts.units]
        split = engine.parts.placement
        assert isinstance(split, SplitOptimizer)
        assert split.host_units == host_units(layouts, 0.5, last_first=bool(options))
        if options:
            assert len(engine.parts.units) - 1 in split.host_units and 0 not in split.host_units
        engine.close()


def _engine(ratio: float, stage: int = 1, seed: int = 0, **options) -> ZeroEngine:
    torch.manual_seed(seed)
    model = RichModel().to(DEVICE)
    extra = dict(stage3_wrap_classes=["Sequential", "Linear"], stage3_param_persistence_threshold=20) if stage == 3 \
        else dict(reduce_bucket_size=300)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, offload_optimizer=True, offload_optimizer_ratio=ratio,
                                          **extra, **options))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    return engine


# RichModel in stage 1 with reduce_bucket_size=300: units of 512, 272, 272 and 83 elements.
@pytest.mark.parametrize("ratio, expected", [(0.25, {0}), (0.45, {0, 1}), (0.5, {0, 1}), (0.75, {0, 1, 2})])
def test_engine_offloads_the_documented_units(ratio: float, expected: set[int]) -> None:
    engine = _engine(ratio)
    assert [u.layout.numel for u in engine.parts.units] == [512, 272, 272, 83]
    placement = engine.parts.placement
    assert isinstance(placement, SplitOptimizer) and placement.host_units == expected
    assert set(placement.host.landing.numels) == expected  # only host units have host gradient buffers
    for unit in engine.parts.units:
        on_host = unit.index in expected
        assert unit.master.device == (torch.device("cpu") if on_host else engine.parts.device), unit.index
        assert (placement.step_grad(unit) is not unit.grad) == on_host
        assert placement.device_master(unit).device == engine.parts.device
        if not on_host:
            assert placement.device_master(unit) is unit.master
    batches = [[u.index for u in batch] for batch in placement.step_batches(engine.parts.units)]
    # the device units at once, then the host units in the order their gradients leave the device
    assert batches == [sorted(set(range(4)) - expected)] + [[i] for i in sorted(expected, reverse=True)]
    # Steps, and only the optimizer's state of device units lives on the device.
    engine.backward(engine.parts.module.loss(_batch(0)))
    assert engine.step()
    for unit in engine.parts.units:
        for view, _ in engine._binding(engine.optimizer).optimized[unit.index]:
            for value in engine.optimizer.state[view].values():
                if value.numel() > 1:
                    assert value.device == unit.master.device


def test_ratio_0_and_1_are_no_offload_and_full_offload() -> None:
    assert type(_engine(0.0).parts.placement) is OptimizerHome
    assert type(_engine(1.0).parts.placement) is HostOptimizer
    assert isinstance(_engine(0.0, stage=3).parts.gatherer.store, MasterAlias)  # as without offload
    assert not isinstance(_engine(0.5, stage=3).parts.gatherer.store, MasterAlias)


def _batch(step: int):
    tokens, targets, use = make_batch(step, 0, 0)
    return tokens.to(DEVICE), targets.to(DEVICE), use


def _train(engine: ZeroEngine, steps: range) -> None:
    for step in steps:
        engine.backward(engine.parts.module.loss(_batch(step)))
        engine.clip_grad_norm_(1.0)
        engine.step()


def _optimizer_state(engine: ZeroEngine) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().cpu() for k, v in engine.optimizer.state[view].items()}
            for unit in engine.parts.units for view, _ in engine._binding(engine.optimizer).optimized[unit.index]]


@pytest.mark.parametrize("saved, loaded", [(0.5, 0.25), (0.25, 1.0), (0.75, 0.0), (0.5, 0.5)])
def test_sharded_state_loads_into_another_ratio(saved: float, loaded: float, tmp_path) -> None:
    from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine

    source = _engine(saved)
    _train(source, range(3))
    save_engine(source, tmp_path / "ckpt")
    target = _engine(loaded, seed=1)
    load_engine(target, tmp_path / "ckpt")
    target.parts.module.frozen.load_state_dict(source.parts.module.frozen.state_dict())  # not the engine's: not in the state
    assert all(torch.equal(a, b) for a, b in zip(source.full_state_dict().values(), target.full_state_dict().values()))
    for a, b in zip(_optimizer_state(source), _optimizer_state(target)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _train(source, range(3, 5))
    _train(target, range(3, 5))
    for name, value in source.full_state_dict().items():
        assert (value - target.full_state_dict()[name]).abs().max() <= 1e-6, name


def test_a_load_keeps_this_runs_kernel_choices(tmp_path) -> None:
    # A checkpoint from full offload (its host step runs torch's fused CPU kernel) loads into a run
    # without offload: the values and hyperparameters come from the checkpoint, the kernel choice
    # (fused/foreach) stays this run's.
    from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine

    source = _engine(1.0)
    _train(source, range(2))
    assert all(g.get("fused") for g in source.optimizer.param_groups)
    save_engine(source, tmp_path / "ckpt")
    torch.manual_seed(1)
    model = RichModel().to(DEVICE)
    target = ZeroEngine(model, ZeroConfig(stage=1, reduce_bucket_size=300))
    target.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=5e-3))
    kernels = [(g.get("fused"), g.get("foreach")) for g in target.optimizer.param_groups]
    assert not any(fused for fused, _ in kernels)
    load_engine(target, tmp_path / "ckpt")
    assert [(g.get("fused"), g.get("foreach")) for g in target.optimizer.param_groups] == kernels
    assert [g["lr"] for g in target.optimizer.param_groups] == [g["lr"] for g in source.optimizer.param_groups]
    _train(source, range(2, 4))
    _train(target, range(2, 4))
    # Source and target step with different kernels (fused CPU AdamW, foreach): the same update up to the
    # last bits of fp32 (6e-8 measured here, weights up to 4 in magnitude), so 1e-6 leaves room on any CPU.
    for name, value in source.full_state_dict().items():
        assert (value - target.full_state_dict()[name]).abs().max() <= 1e-6, name


def test_a_save_says_what_it_wrote(tmp_path, caplog) -> None:
    import logging

    from lightning_zeroq.checkpoint.engine_io import save_engine

    engine = _engine(0.5)
    _train(engine, range(1))
    with caplog.at_level(logging.INFO, logger="lightning_zeroq"):
        save_engine(engine, tmp_path / "ckpt")
    files = [f for f in (tmp_path / "ckpt").iterdir() if f.suffix == ".distcp"]
    written = sum(f.stat().st_size for f in files) / 2**30
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Saved checkpoint")]
    assert len(lines) == 1 and str(tmp_path / "ckpt") in lines[0], lines
    assert f"{written:.2f} GiB from 1 rank(s), in " in lines[0], (lines[0], written)


@pytest.mark.parametrize("budget, message", [(-1, "must be above 0"), ("lots", "is not a number"), ("150%", "at most 100%"),
                                             (0, "must be above 0"), (True, "is not a number")])
def test_a_bad_memory_budget_is_one_line_naming_value_and_fix(budget, message) -> None:
    with pytest.raises(ValueError, match=message) as error:
        ZeroConfig(offload_optimizer=True, offload_optimizer_ratio="auto", offload_memory_budget=budget)
    assert "\n" not in str(error.value) and repr(budget) in str(error.value) and "'50%'" in str(error.value)


def test_a_budget_over_the_device_is_an_error_and_forms_convert() -> None:
    from lightning_zeroq.config import memory_budget

    with pytest.raises(ValueError, match=r"offload_memory_budget=200 \(200.00 GiB\) is more than the device has \(80.00"):
        memory_budget(200, 80 * 2**30)
    assert memory_budget("50%", 80 * 2**30) == 40 * 2**30 and memory_budget("12.5", 80 * 2**30) == int(12.5 * 2**30)
    assert any("no effect without offload_optimizer_ratio='auto'" in m
               for m in ineffective(ZeroConfig(offload_optimizer=True, offload_memory_budget=10), loss_scaling=False))


def test_auto_on_a_cpu_device_warns_and_offloads_every_unit() -> None:
    if DEVICE.type != "cpu":
        pytest.skip("the CPU's answer")
    engine = _engine("auto")
    engine.backward(engine.parts.module.loss(_batch(0)))
    with pytest.warns(UserWarning, match="no device memory to fill"):
        engine.step()
    assert engine.parts.placement.host_units == frozenset(range(len(engine.parts.units)))
    engine.backward(engine.parts.module.loss(_batch(1)))
    assert engine.step()  # decided once: no second warning, still stepping


def test_auto_keeps_the_largest_units_that_fit_and_never_exceeds_the_budget(caplog) -> None:
    import logging

    engine = _engine("auto")
    engine.parts.placement.measure = lambda: (1000, 0, 20_000)  # a stand-in device: peak 1000 of 20000 bytes
    engine.parts.placement.budget = "65%"  # 13000 bytes: 12000 to fill
    engine.backward(engine.parts.module.loss(_batch(0)))
    with caplog.at_level(logging.INFO, logger="lightning_zeroq"):
        engine.step()
    decision = engine.parts.placement.decision
    # Units of 512, 272, 272 and 83 elements in 1, 2, 2 and 4 segments: the fp32 master and, per segment,
    # AdamW's two moments and its step count, each in whole 512-byte blocks: 6656, 5632, 5632, 3584 bytes.
    # Largest first: 6656 fits, neither 5632 does after it, 3584 does.
    assert decision["device_units"] == [0, 3] and decision["host_units"] == [1, 2], decision
    assert decision["device_bytes"] == 6656 + 3584 and 1000 + decision["device_bytes"] <= 13000
    assert decision["budget_bytes"] == 13000
    assert any("2 of 4 units keep master and optimizer state on the device" in r.getMessage() for r in caplog.records)
    for unit in engine.parts.units:  # the host no longer holds gradient buffers for the units that came back
        assert (unit.index in engine.parts.placement.host.landing.numels) == (unit.index in decision["host_units"])


def test_auto_keeps_at_least_the_elements_the_best_fitting_ratio_keeps() -> None:
    from lightning_zeroq.zero.offload.auto import choose
    from lightning_zeroq.zero.offload.split import host_units

    # The 953M GPT's six buckets in stage 2 (elements in units of 10^4; 12 bytes each on the device) under
    # the headroom a 13 GiB budget leaves (4.91 GiB, 439M elements): largest cost first keeps units 2
    # and 1 (382.8M); the ratio's order sends 2, 1, then 0 to the host and keeps 3, 4 and 5 (385.4M),
    # more elements, so that is the choice, and it is exactly ratio 0.5's.
    sizes = [18509, 18876, 19400, 18247, 13737, 6554]
    costs = [12 * n for n in sizes]
    keep = choose(costs, sizes, 12 * 43900)
    layouts = [UnitLayout((), n, n, 1) for n in sizes]
    assert keep == [3, 4, 5] == sorted(set(range(6)) - host_units(layouts, 0.5))
    # Where largest-first keeps more (a big unit fits beside a small one), it is taken.
    assert choose([100, 60, 60, 10], [100, 60, 60, 10], 115) == [0, 3]
    assert choose([5, 5], [5, 5], -1) == [] and choose([5, 5], [5, 5], 10) == [0, 1]
    # Never over the headroom, for any sizes.
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        sizes = torch.randint(1, 100, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        costs = [n * int(torch.randint(8, 17, (1,), generator=gen)) for n in sizes]
        headroom = int(torch.randint(0, sum(costs) + 1, (1,), generator=gen))
        keep = choose(costs, sizes, headroom)
        assert sum(costs[i] for i in keep) <= headroom


def test_sharded_state_loads_into_an_auto_engine_after_its_decision(tmp_path) -> None:
    # The state loads next to each master, wherever "auto" put it; both engines then train alike.
    from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine

    source = _engine(0.5)
    _train(source, range(3))
    save_engine(source, tmp_path / "ckpt")
    target = _engine("auto", seed=1)
    target.parts.placement.measure = lambda: (0, 0, 20_000)
    target.parts.placement.budget = "65%"
    _train(target, range(1))  # decides: some units on the device, the others on the host
    assert 0 < len(target.parts.placement.decision["device_units"]) < len(target.parts.units)
    load_engine(target, tmp_path / "ckpt")
    target.parts.module.frozen.load_state_dict(source.parts.module.frozen.state_dict())
    for a, b in zip(_optimizer_state(source), _optimizer_state(target)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _train(source, range(3, 5))
    _train(target, range(3, 5))
    for name, value in source.full_state_dict().items():
        assert (value - target.full_state_dict()[name]).abs().max() <= 1e-6, name


def test_auto_in_stage_3_gathers_brought_back_units_from_their_masters() -> None:
    """A transient unit whose master "auto" brings back to the device drops the bf16 payload it rested on
    the device while its master was on the host (the decision counts that saving), and gathers from its
    master from then on, as a ratio's device units do; training goes on alike (DDP parity: test_parity)."""
    from lightning_zeroq.zero.offload.stores import MasterAlias, SplitStore

    torch.manual_seed(0)
    model = RichModel().to(DEVICE).to(torch.bfloat16)
    engine = ZeroEngine(model, ZeroConfig(stage=3, offload_optimizer=True, offload_optimizer_ratio="auto",
                                          stage3_wrap_classes=["Sequential", "Linear"],
                                          stage3_param_persistence_threshold=20),
                        param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    store = engine.parts.gatherer.store
    # One rank: a gather is a copy into the bf16 working buffer, which casts the master as it copies.
    assert isinstance(store, SplitStore) and not store.device_units and isinstance(store.on_device, MasterAlias)
    transient = [u.index for u in engine.parts.units if not u.persistent]
    payload = {i: store.freed_by_moving(i) for i in transient}
    assert all(b > 0 for b in payload.values())
    before = engine.memory_report()["stored_shards"]
    engine.parts.placement.measure = lambda: (1000, 10**9, 10**9 + 1000)  # room for every unit
    engine.backward(engine.parts.module.loss(_batch(0)).float())
    engine.step()
    decision = engine.parts.placement.decision
    assert decision["host_units"] == [] and set(store.device_units) == set(transient)
    assert not store.off_device.buffers and engine.memory_report()["stored_shards"] == 0 < before
    full = sum(_device_cost_of(engine, u) for u in engine.parts.units)
    assert decision["device_bytes"] == full - sum(payload.values())
    engine.backward(engine.parts.module.loss(_batch(1)).float())
    assert engine.step()
    for unit in engine.parts.units:  # gathers read the master, on the device now: the working weights are its cast
        assert unit.master.device == DEVICE
        if not unit.persistent:
            assert store.get(unit) is unit.master
            engine.parts.gatherer.gather(unit)
            assert torch.equal(unit.flat, unit.master.to(torch.bfloat16))
            engine.parts.gatherer.free(unit)


def _device_cost_of(engine: ZeroEngine, unit) -> int:
    from lightning_zeroq.zero.offload.auto import _device_cost

    return _device_cost(unit, engine.optimizers)
