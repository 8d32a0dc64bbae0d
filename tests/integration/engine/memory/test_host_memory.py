"""Host memory before launch (``zero/memory/host.py``): the bytes each offload configuration puts on
the host are the bytes it allocates; a configuration the host (or ``host_memory_budget``) cannot hold
stops with one line, on every rank, when the engine is built or the optimizer attached, before any step;
bad budgets are refused."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.zero.memory import host as host_memory
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.offload.stores import HostStore
from lightning_zeroq.zero.policies import Host
from lightning_zeroq.zero.policies import ineffective
from tests.models import RichModel, make_batch, param_groups

CONFIGS = {
    "optimizer_cpu": dict(stage=2, offload_optimizer=True),
    "optimizer_cpu_ratio": dict(stage=2, offload_optimizer=True, offload_optimizer_ratio=0.5),
    "stage3_params_optimizer_cpu": dict(stage=3, offload_optimizer=True, offload_parameters=True),
    "stage3_optimizer_cpu": dict(stage=3, offload_optimizer=True),
    "optimizer_cpu_speculative": dict(stage=2, offload_optimizer=True, offload_speculative_step=True),
    "optimizer_nvme": dict(stage=2, offload_optimizer=True, offload_optimizer_device="nvme",
                           nvme_path=tempfile.gettempdir()),
    # half the parameters' state swapped to NVMe: only the units kept in host memory count there
    "optimizer_nvme_spill": dict(stage=2, offload_optimizer=True, offload_optimizer_device="nvme",
                                 offload_optimizer_nvme_ratio=0.5, nvme_path=tempfile.gettempdir()),
}
SMALL_UNITS = dict(reduce_bucket_size=300, stage3_wrap_classes=["Sequential", "Linear"],
                   stage3_param_persistence_threshold=20)


def _engine(config: dict, dtype: torch.dtype = torch.bfloat16, blocks: bool = False,
            **options) -> tuple[torch.nn.Module, ZeroEngine]:
    """``blocks``: twelve units of one size (as a model's blocks, which NVMe swaps a few at a time) instead
    of ``RichModel``'s units of many sizes."""
    torch.manual_seed(0)
    model = (torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)]) if blocks else RichModel()).to(dtype)
    return model, ZeroEngine(model, ZeroConfig(**SMALL_UNITS, **config, **options), param_dtype=dtype)


def _host_of(engine: ZeroEngine) -> HostOptimizer:
    placement = engine.parts.placement
    host = placement if isinstance(placement, HostOptimizer) else getattr(placement, "host", None)
    assert isinstance(host, HostOptimizer)
    return host


def _host_bytes(engine: ZeroEngine) -> int:
    """Every byte the engine's host side holds after a step: masters, landing buffers, the kernel's bf16
    copies (not those shared with stage 3's store), the store's buffers, stage 3's frozen shards, optimizer
    state, spares."""
    host = _host_of(engine)
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen and t.numel():
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    units = [u for u in engine.parts.units if u.index in host.landing.numels]
    total = nbytes(u.master for u in units)
    total += nbytes(host.landing.host_grads.values()) + nbytes(host.landing.half_grads.values())
    store = engine.parts.gatherer.store
    if isinstance(store, HostStore):
        total += nbytes(store.buffers.values())
    if host.kernel is not None:
        total += nbytes(host.kernel.working.values())
    frozen = engine.parts.frozen  # stage 3's frozen parts: their stored shards, on the host with parameter offload
    if frozen is not None and frozen.codec.on_host:
        total += nbytes(u.master for u in frozen.units)
    views = {id(v) for u in units for v in u.segment_masters}
    total += nbytes(t for view, state in engine.optimizer.state.items() if id(view) in views
                    for key, t in state.items() if isinstance(t, torch.Tensor) and key != "step")
    return total


def _pool_bytes(engine: ZeroEngine) -> int:
    """The NVMe step's buffers, all back in its pool after a step (their elements: each is page-aligned, up
    to 4 KiB more, which only these test-sized units notice)."""
    pool = getattr(_host_of(engine), "_pool", None)
    return 0 if pool is None else sum(b.numel() * b.element_size() for free in pool._free.values() for b, _ in free)


def _spare_bytes(engine: ZeroEngine) -> int:
    spec = _host_of(engine).spec
    return 0 if spec is None else sum(t.untyped_storage().nbytes() for spare in spec.spares.values()
                                       for t in [spare.master, *(m for pair in spare.moments.values() for m in pair)])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_counted_need_is_what_the_engine_allocates(name: str) -> None:
    model, engine = _engine(CONFIGS[name])
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
    for step in range(2):
        engine.backward(model.loss(make_batch(step, 0, 0)).float(), boundary=True)
        engine.step()
        engine.zero_grad()
    budget = engine.parts.host_memory
    counted = budget.need.total  # the build's and the optimizer's
    allocated = _host_bytes(engine)
    # RichModel has parameters that never get a gradient: no state is made for them (yet); counted anyway
    stateless = sum(v.numel() for u in engine.parts.units if u.index in _host_of(engine).landing.numels
                    for v in u.segment_masters if v not in engine.optimizer.state)
    spares = 12 * budget.need.host_elements if budget.offload.speculative else 0
    swapping = (4 + 8) * budget.need.swap_elements  # NVMe: the step buffers of the units in flight at once
    assert counted - spares - swapping == allocated + 8 * stateless, (budget.need.parts, counted, allocated, stateless)
    assert _spare_bytes(engine) <= spares  # a bound: made for the units stepped early
    assert _pool_bytes(engine) <= swapping  # a bound: the sizes that were in flight together
    if swapping:  # the bound is reached where several units of one size swap
        assert _pool_bytes(engine) >= swapping // 2, (_pool_bytes(engine), swapping)
    engine.close()


def test_a_budget_below_the_build_stops_it_with_one_line() -> None:
    with pytest.raises(host_memory.HostMemoryError) as caught:
        _engine(CONFIGS["stage3_params_optimizer_cpu"], host_memory_budget=1e-6)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("ZeroConfig: this offload configuration needs ") and " KiB of host memory" in message
    assert "fp32 masters" in message and "stage-3 parameters" in message
    assert "is available (host_memory_budget=1e-06)" in message and "set host_memory_budget" in message


def test_a_budget_below_the_optimizer_state_stops_at_attach() -> None:
    model, probe = _engine(CONFIGS["optimizer_cpu"])
    built = probe.parts.host_memory.need.total
    probe.close()
    # room for the build and 6 bytes per element: SGD without momentum fits (its fp32 gradient buffers take 4,
    # for it reads fp32 gradients), AdamW not (8 of state; the host kernel reads the bf16 gradients)
    budget = (built + 6 * sum(u.layout.shard_numel for u in probe.parts.units)) / 2**30
    model, engine = _engine(CONFIGS["optimizer_cpu"], host_memory_budget=budget)
    engine.attach_optimizer(torch.optim.SGD(param_groups(model), lr=1e-3))
    with pytest.raises(host_memory.HostMemoryError, match=r"^ZeroConfig: the optimizer's state on the host needs "
                                                         r"[0-9.]+ KiB .*optimizer state [0-9.]+ KiB\) and"):
        engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
    assert not engine.optimizer.state  # nothing was made
    engine.close()


def _two_ranks_body(budget: float) -> str:
    torch.manual_seed(0)
    try:
        ZeroEngine(RichModel(), ZeroConfig(**SMALL_UNITS, **CONFIGS["optimizer_cpu"],
                                           host_memory_budget=budget if dist.get_rank() == 1 else None))
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "built"


def test_every_rank_stops_when_one_rank_s_host_cannot_hold_it(dist_pool) -> None:
    said = dist_pool(2).run(_two_ranks_body, 1e-6)
    assert said[1].startswith("HostMemoryError: ZeroConfig: this offload configuration needs "), said
    assert said[0].startswith("RuntimeError: rank(s) [1] failed while building the ZeRO engine; rank 1 said: "
                              "HostMemoryError: ZeroConfig: this offload configuration needs "), said


def test_several_ranks_on_one_node_each_need_their_share(monkeypatch) -> None:
    need = host_memory.HostNeed({"fp32 masters": 3 * 2**30})
    room = host_memory.Available(10 * 2**30, "MemAvailable")
    host_memory.check(need, room, 3, "x")  # 9 of 10 GiB
    with pytest.raises(host_memory.HostMemoryError, match=r"needs 12\.0 GiB .* \(4 ranks x 3\.0 GiB: fp32 masters 3\.0 "
                                                         r"GiB\) and 10\.0 GiB is available \(MemAvailable\)"):
        host_memory.check(need, room, 4, "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_memory.ranks_on_node(None) == 4 and host_memory.ranks_on_node(2) == 2


def test_without_a_budget_the_host_s_available_memory_decides(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "_meminfo", lambda key: {"MemAvailable": 2**12, "MemTotal": 2**30}[key])
    monkeypatch.setattr(host_memory, "_cgroup_room", lambda: None)
    with pytest.raises(host_memory.HostMemoryError, match=r"is available \(MemAvailable\)"):
        _engine(CONFIGS["optimizer_cpu"])
    monkeypatch.setattr(host_memory, "_cgroup_room", lambda: 2**10)
    with pytest.raises(host_memory.HostMemoryError, match=r"is available \(the cgroup's memory limit less its use\)"):
        _engine(CONFIGS["optimizer_cpu"])
    room = host_memory.available("50%")
    assert room is not None and room.bytes == 2**29  # a share of MemTotal


@pytest.mark.parametrize("value", [0, -1, True, "abc", "120%", "0%", float("inf"), "12%%", "12 parsecs"])
def test_bad_budgets_are_refused_with_the_fix(value) -> None:
    with pytest.raises(ValueError, match=r"ZeroConfig\.host_memory_budget=.* use GiB as a number"):
        ZeroConfig(offload_optimizer=True, host_memory_budget=value)


def test_a_budget_without_offload_has_no_effect_and_says_so() -> None:
    assert any("host_memory_budget=100 has no effect" in m for m in ineffective(ZeroConfig(host_memory_budget=100), loss_scaling=False))


def test_the_trainer_stops_before_any_step(tmp_path) -> None:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy
    from tests.models import TokenDataset, make_lit_module

    steps: list[int] = []

    class Counted(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            steps.append(batch_idx)

    budget = 1e-6  # GiB: below what the optimizer's state needs, above nothing
    strategy = ZeroQStrategy(stage=2, offload_optimizer=True, host_memory_budget=budget)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[Counted()])
    with pytest.raises(host_memory.HostMemoryError, match=r"^ZeroConfig: this offload configuration needs [^\n]*$"):
        trainer.fit(make_lit_module(), torch.utils.data.DataLoader(TokenDataset(8), batch_size=2))
    assert steps == []


def test_fp32_gradient_buffers_are_made_and_checked_only_when_a_window_sums_several_backwards() -> None:
    model, probe = _engine(CONFIGS["optimizer_cpu"])
    probe.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
    probe.backward(model.loss(make_batch(0, 0, 0)).float(), boundary=True)
    probe.step()
    assert probe.parts.placement.landing.host_grads == {}  # one bf16 reduction per window: 2 bytes per element
    held = probe.parts.host_memory.need.total  # the build's and AdamW's state
    probe.close()
    model, engine = _engine(CONFIGS["optimizer_cpu"], host_memory_budget=(held + 64) / 2**30)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
    engine.backward(model.loss(make_batch(0, 0, 0)).float() / 2, boundary=False)
    with pytest.raises(host_memory.HostMemoryError, match=r"^ZeroConfig: summing several backward passes on the host "
                                                         r"\(fp32 gradient buffers\) needs [^\n]*$"):
        engine.backward(model.loss(make_batch(0, 1, 0)).float() / 2, boundary=True)  # its fp32 sum lands
    assert engine.parts.placement.landing.host_grads == {}
    engine.close()


def test_the_trainer_counts_the_fp32_buffers_of_accumulation_before_any_step(tmp_path) -> None:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy
    from tests.models import TokenDataset, make_lit_module

    steps: list[int] = []

    class Counted(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            steps.append(batch_idx)

    def fit(accumulate: int, budget: float) -> ZeroQStrategy:
        strategy = ZeroQStrategy(stage=2, offload_optimizer=True, host_memory_budget=budget, reduce_bucket_size=300)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                            strategy=strategy, precision="bf16-true", accumulate_grad_batches=accumulate,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                            callbacks=[Counted()])
        trainer.fit(make_lit_module(), torch.utils.data.DataLoader(TokenDataset(8), batch_size=2))
        return strategy

    engine = fit(1, 1.0).engine
    assert engine is not None and engine.parts.placement.landing.host_grads == {}
    held = engine.parts.host_memory.need.total  # the build's and AdamW's state
    steps.clear()
    fit(1, (held + 64) / 2**30)  # room for the build and AdamW's state
    assert steps == [0]
    steps.clear()
    with pytest.raises(host_memory.HostMemoryError, match=r"^ZeroConfig: the optimizer's state on the host needs "
                                                         r"[^\n]*fp32 gradient buffers"):
        fit(2, (held + 64) / 2**30)  # accumulation sums in fp32 on the host: 4 more bytes per element
    assert steps == []


def test_a_state_the_device_cannot_hold_stops_with_one_line_before_it_is_allocated(monkeypatch) -> None:
    """The device's share of the model's state, from the layouts, against the device's memory: when the
    engine is built (masters, gradient shards, working weights) and when the optimizer is attached (its
    state), before either is allocated. On CPU the check is given a device of a few bytes."""
    from lightning_zeroq.zero.memory import device as device_memory

    model, probe = _engine({"stage": 2})
    probe.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
    numel = sum(u.layout.shard_numel for u in probe.parts.units)
    probe.close()
    # bf16 weights, no offload, one rank: the build holds 10 bytes per element (fp32 master and gradient
    # shard, bf16 working weights), the optimizer 8 more
    monkeypatch.setattr(device_memory, "capacity", lambda device: 8 * numel)
    with pytest.raises(device_memory.DeviceMemoryError, match=r"^ZeroConfig: this configuration's state needs "
                       r"[0-9.]+ GiB of device memory per rank before any activation \(masters .*offload_optimizer=True"):
        _engine({"stage": 2})
    monkeypatch.setattr(device_memory, "capacity", lambda device: 12 * numel)  # the build fits, Adam's 8 more do not
    model, engine = _engine({"stage": 2})
    with pytest.raises(device_memory.DeviceMemoryError, match="with the optimizer's needs .*optimizer state"):
        engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
    engine.close()
    monkeypatch.setattr(device_memory, "capacity", lambda device: 8 * numel)  # offloaded: only the weights there
    model, engine = _engine({"stage": 2, "offload_optimizer": True})
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
    engine.close()


def test_the_device_check_counts_stage3s_int8_payload(monkeypatch) -> None:
    """With INT8 weights a transient unit's payload (INT8 groups and their scales) rests on the device beside
    its master: the check before allocating counts it, as the engine then holds it (before: only beside
    masters off the device)."""
    from lightning_zeroq.zero.memory import device as device_memory

    model, probe = _engine({"stage": 3, "quantized_weights": True}, blocks=True)
    probe.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    held, build = probe.memory_report(), probe.parts.host_memory._build
    kinds = device_memory.device_kinds(build.layouts, build.persistent, probe.parts.policies.offload, build.param_dtype, 8,
                                     build.rank, build.payload)
    probe.close()
    assert kinds["stored_shards"] == held["stored_shards"] > 0, (kinds, held)
    total = sum(kinds.values())
    monkeypatch.setattr(device_memory, "capacity", lambda device: total)  # exactly the counted state: fits
    model, engine = _engine({"stage": 3, "quantized_weights": True}, blocks=True)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.close()
    monkeypatch.setattr(device_memory, "capacity", lambda device: total - held["stored_shards"] // 2)
    model, engine = _engine({"stage": 3, "quantized_weights": True}, blocks=True)
    with pytest.raises(device_memory.DeviceMemoryError, match="stored shards"):
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.close()


@pytest.mark.parametrize("stage, capacity_per_element", [(2, 14), (2, 8), (3, None)])
def test_a_state_that_does_not_fit_names_the_least_offload_that_does(monkeypatch, stage, capacity_per_element) -> None:
    """The device check's fix is the nearest configuration that fits (the smallest share of the optimizer
    on the host, in steps of 0.05, then parameters too in stage 3), and that configuration builds and
    takes the optimizer under the same device. Stage 3: a device between what parameter offload leaves
    there and what the optimizer's offload alone does."""
    import re

    from lightning_zeroq.zero.memory import device as device_memory

    model, probe = _engine({"stage": stage})
    numel = sum(u.layout.shard_numel for u in probe.parts.units)
    room = capacity_per_element * numel if capacity_per_element else None
    if room is None:
        layouts = [u.layout for u in probe.parts.units]
        persistent = [u.persistent for u in probe.parts.units]
        offload = probe.parts.policies.offload

        def need(**where) -> int:
            return sum(device_memory.device_kinds(layouts, persistent, dataclasses.replace(offload, **where),
                                                torch.bfloat16, 8).values())
        both, optimizer_only = need(optimizer=Host(), parameters=Host()), need(optimizer=Host())
        assert both < optimizer_only
        room = (both + optimizer_only) // 2
    probe.close()
    monkeypatch.setattr(device_memory, "capacity", lambda device: room)
    model, engine = _engine({"stage": stage}) if (capacity_per_element or 0) > 10 else (None, None)
    with pytest.raises(device_memory.DeviceMemoryError) as caught:
        if engine is None:
            _engine({"stage": stage})
        else:
            engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
    message = str(caught.value)
    found = re.search(r"the nearest that fits(?: with Adam)? is (offload_optimizer=True(?:, offload_optimizer_ratio=[0-9.]+"
                      r"|, offload_parameters=True)?) \(", message)
    assert found and "\n" not in message, message
    options = {"offload_optimizer": True}
    for option in found.group(1).split(", ")[1:]:
        key, value = option.split("=")
        options[key] = True if value == "True" else float(value)
    if stage == 2:
        assert "offload_optimizer_ratio" in options or capacity_per_element <= 8, message
    else:
        assert options.get("offload_parameters") is True, message
    model, fitted = _engine({"stage": stage, **options})
    fitted.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))  # fits, the optimizer's state too
    fitted.close()
    if "offload_optimizer_ratio" in options:  # and it is the least: one step less does not fit
        less = round(options["offload_optimizer_ratio"] - device_memory.RATIO_STEP, 2)
        model, smaller = _engine({"stage": stage, "offload_optimizer": True, "offload_optimizer_ratio": less}) \
            if less > 0 else _engine({"stage": stage})
        with pytest.raises(device_memory.DeviceMemoryError):
            smaller.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-3))
        smaller.close()


def _groups(model: torch.nn.Module) -> list[dict]:
    return param_groups(model) if isinstance(model, RichModel) else [{"params": list(model.parameters())}]


def _budget_of(config: dict, blocks: bool = False) -> int:
    """Host bytes the configuration counts, AdamW attached."""
    model, probe = _engine(config, blocks=blocks)
    probe.attach_optimizer(torch.optim.AdamW(_groups(model), lr=1e-3))
    total = probe.parts.host_memory.need.total
    probe.close()
    return total


@pytest.mark.parametrize("case", ["speculative", "nvme_spill"])
def test_a_host_that_cannot_hold_it_names_the_nearest_configuration_that_fits(case, tmp_path) -> None:
    """The host check's fix is the nearest configuration that fits the same budget: without speculative
    spares, else the smallest share of the optimizer state swapped to NVMe (steps of 0.05); that
    configuration builds and takes AdamW under the budget, and (NVMe) one step less does not. NVMe spill
    pays where several units of one size swap (each size's step buffers are held for a few units at once),
    so its case is a model of twelve like blocks."""
    import re

    config = CONFIGS["optimizer_cpu_speculative" if case == "speculative" else "optimizer_cpu"]
    blocks = case == "nvme_spill"
    full = _budget_of(config, blocks)
    budget = (full - 1024) / 2**30 if case == "speculative" else 0.66 * full / 2**30
    with pytest.raises(host_memory.HostMemoryError) as caught:  # at the build (with Adam's state) or at attach
        model, engine = _engine(config, blocks=blocks, host_memory_budget=budget)
        try:
            engine.attach_optimizer(torch.optim.AdamW(_groups(model), lr=1e-3))
        finally:
            engine.close()
    message = str(caught.value)
    assert "\n" not in message, message
    found = re.search(r"the nearest that fits(?: with Adam)? is (.*?) \([0-9.]+ [KMG]iB on this node\)", message)
    assert found, message
    if case == "speculative":
        assert found.group(1) == "offload_speculative_step=False", message
        options = {**config, "offload_speculative_step": False}
    else:
        ratio = re.fullmatch(r"offload_optimizer_device='nvme', nvme_path=<a local disk>, "
                             r"offload_optimizer_nvme_ratio=([0-9.]+)", found.group(1))
        assert ratio, message
        options = {**config, "offload_optimizer_device": "nvme", "nvme_path": str(tmp_path),
                   "offload_optimizer_nvme_ratio": float(ratio.group(1))}
    model, fitted = _engine(options, blocks=blocks, host_memory_budget=budget)
    fitted.attach_optimizer(torch.optim.AdamW(_groups(model), lr=1e-3))
    fitted.close()
    if case == "nvme_spill":
        less = round(options["offload_optimizer_nvme_ratio"] - host_memory.RATIO_STEP, 2)
        assert less > 0
        with pytest.raises(host_memory.HostMemoryError):
            model, smaller = _engine({**options, "offload_optimizer_nvme_ratio": less}, blocks=blocks,
                                    host_memory_budget=budget)
            smaller.attach_optimizer(torch.optim.AdamW(_groups(model), lr=1e-3))


def test_the_nvme_step_holds_the_counted_units_of_one_size_at_once(tmp_path) -> None:
    """Eight swapped units of one size: the step's pool ends with exactly the counted units' buffers (the
    one stepping, the one read ahead, the writes behind), and the count is what the check adds."""
    from lightning_zeroq.zero.offload import nvme

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=64 * 65, offload_optimizer=True,
                                          offload_optimizer_device="nvme", nvme_path=str(tmp_path)))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(2):
        engine.backward(model(torch.randn(4, 64)).square().mean(), boundary=True)
        engine.step()
        engine.zero_grad()
    sizes = {u.layout.shard_numel for u in engine.parts.units}
    assert len(engine.parts.units) == 8 and len(sizes) == 1, [u.layout.shard_numel for u in engine.parts.units]
    expected = nvme.UNITS_IN_FLIGHT * sizes.pop()
    assert engine.parts.host_memory.need.swap_elements == expected
    parts = engine.parts.host_memory.need.parts
    assert parts["NVMe step buffers (masters)"] == 4 * expected
    assert parts["NVMe step buffers (optimizer state)"] == 8 * expected
    assert _pool_bytes(engine) == 12 * expected
    engine.close()


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_muon_on_the_host_counts_its_staging_buffers() -> None:
    model, engine = _engine(CONFIGS["optimizer_cpu"])
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    engine.attach_optimizer(torch.optim.Muon(matrices, lr=0.02))
    engine.attach_optimizer(torch.optim.AdamW(rest, lr=1e-3))
    parts = engine.parts.host_memory.need.parts
    largest = max(u.layout.shard_numel for u in engine.parts.units)
    assert parts["matrix optimizer staging buffers"] == 4 * host_memory._power_of_two(4 * largest)
    assert "fp32 gradient buffers" in parts  # AdamW's share of a unit Muon shares steps with torch's kernel
    engine.close()


def test_pinned_sizes_are_powers_of_two() -> None:
    assert [host_memory._power_of_two(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        0, 1, 2, 4, 4, 8, 1024, 1024, 2048]
