"""Offload and accumulation semantics for every stage: heads that alternate between windows, and
managed == unmanaged == offloaded for the same micro-batches."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.models import DIM, SEQ, VOCAB
from tests.integration.engine.test_parity import OFFLOAD

COMBOS = [(1, "none"), (1, "optimizer_cpu"), (1, "optimizer_nvme"), (2, "none"), (2, "optimizer_cpu"),
          (2, "optimizer_nvme"), (3, "none"), (3, "optimizer_cpu"), (3, "optimizer_nvme"),
          (3, "params_optimizer_cpu"), (3, "params_cpu_optimizer_nvme"), (3, "params_nvme_optimizer_cpu"),
          (3, "params_optimizer_nvme")]
NVME_ROOT = os.environ.get("ZEROQ_TEST_NVME_DIR", tempfile.gettempdir())


def _offload_options(offload: str) -> dict:
    """The ZeroConfig fields of an offload mode; NVMe swaps to a fresh directory (as a test would
    with tmp_path; the pool's workers share the pytest process's temporary directory)."""
    if offload == "optimizer_nvme":
        return {"offload_optimizer": True, "offload_optimizer_device": "nvme", "nvme_path": tempfile.mkdtemp(dir=NVME_ROOT)}
    if offload == "params_cpu_optimizer_nvme":
        return {**_offload_options("optimizer_nvme"), "offload_parameters": True}
    if offload == "params_nvme_optimizer_cpu":
        return {"offload_optimizer": True, "offload_parameters": True, "offload_params_device": "nvme",
                "nvme_path": tempfile.mkdtemp(dir=NVME_ROOT)}
    if offload == "optimizer_nvme_half":  # half the parameters' state swapped, the rest in host memory
        return {**_offload_options("optimizer_nvme"), "offload_optimizer_nvme_ratio": 0.5}
    if offload == "params_optimizer_nvme":
        return {**_offload_options("optimizer_nvme"), "offload_parameters": True, "offload_params_device": "nvme"}
    return OFFLOAD[offload]


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(DIM, VOCAB), nn.Linear(DIM, VOCAB)])

    def forward(self, tokens: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](self.trunk(tokens))


def _loss(model, step: int, micro: int, head: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    g = torch.Generator().manual_seed(97 * step + 7 * micro + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g).to(device)
    return F.cross_entropy(model(tokens, head).reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))


def _engine(stage: int, offload: str, managed: bool) -> tuple[TwoHeads, ZeroEngine]:
    torch.manual_seed(0)
    model = TwoHeads()
    config = ZeroConfig(stage=stage, managed_gradient_accumulation=managed, reduce_bucket_size=700,
                        stage3_wrap_classes=["Linear"], stage3_param_persistence_threshold=40,
                        **_offload_options(offload))
    engine = ZeroEngine(model, config)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return model, engine


def _head_state(engine: ZeroEngine, model: TwoHeads, head: int) -> tuple[list[torch.Tensor], int]:
    """This rank's masters and optimizer state of one head's parameters (cloned), and how many of its
    segments have optimizer state."""
    ids = {id(p) for p in model.heads[head].parameters()}
    out, with_state = [], 0
    binding = engine._binding(engine.optimizer)
    pairs = [(unit, m, seg) for unit in engine.parts.units for m, seg in binding.optimized[unit.index]]
    for unit, seg_master, seg in pairs:
        if id(unit.params[seg.param]) in ids:
            out.append(seg_master.detach().clone())
            state = engine.optimizer.state.get(seg_master, {})
            with_state += bool(state)
            out.extend(v.detach().clone() for v in state.values())
    return out, with_state


def _train(stage: int, offload: str, managed: bool, backwards=(2, 5, 3), heads=(0, 1, 0)):
    model, engine = _engine(stage, offload, managed)
    snapshots = []
    for step, (n, head) in enumerate(zip(backwards, heads)):
        for micro in range(n):
            engine.backward(_loss(model, step, micro, head) / n, boundary=micro == n - 1)
        engine.clip_grad_norm_(1.0)
        engine.step()
        snapshots.append((_head_state(engine, model, 0), _head_state(engine, model, 1)))
    return engine.full_state_dict(), snapshots


def _alternating_body(stage: int, offload: str, managed: bool) -> None:
    _, snaps = _train(stage, offload, managed)
    ((a0, _), (b0, b0_state)), ((a1, _), (b1, _)), ((a2, _), (b2, _)) = snaps
    assert b0_state == 0  # head B got no gradient in window A: never stepped, no optimizer state
    # window B: head A is bitwise untouched, value and optimizer state
    assert len(a0) == len(a1) and all(torch.equal(x, y) for x, y in zip(a0, a1))
    # window A again: head B, stepped once in window B, is untouched
    assert len(b1) == len(b2) and all(torch.equal(x, y) for x, y in zip(b1, b2))
    assert any(not torch.equal(x, y) for x, y in zip(a1, a2))  # and head A moves again


@pytest.mark.parametrize("stage, offload", COMBOS)
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_inactive_head_untouched(dist_pool, stage, offload, managed):
    dist_pool(2).run(_alternating_body, stage, offload, managed)


def _modes_body(stage: int, offload: str) -> float:
    managed, _ = _train(stage, offload, True)
    unmanaged, _ = _train(stage, offload, False)
    plain, _ = _train(stage, "none", True)
    for k in managed:
        assert torch.equal(managed[k], unmanaged[k]), f"managed != unmanaged for {k}"
    # offloaded steps run torch's fused CPU AdamW, the plain run the default implementation
    return max((managed[k] - plain[k]).abs().max().item() for k in managed)


@pytest.mark.parametrize("stage, offload", COMBOS)
def test_unmanaged_equals_managed_and_offload_equals_plain(dist_pool, stage, offload):
    worst = dist_pool(2).run(_modes_body, stage, offload)
    assert max(worst) < 1e-6


def _nvme_engine(path: str, stage: int = 2):
    torch.manual_seed(0)
    model = TwoHeads()
    config = ZeroConfig(stage=stage, offload_optimizer=True, offload_optimizer_device="nvme", nvme_path=path,
                        reduce_bucket_size=700)
    engine = ZeroEngine(model, config)
    return model, engine


def _truncated_body(path: str) -> str:
    model, engine = _nvme_engine(path)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    engine.backward(_loss(model, 0, 0, 0))
    engine.step()
    swap = engine.parts.placement.swapper.path_of("u0.exp_avg")
    os.truncate(swap, 100)  # damaged between steps
    engine.backward(_loss(model, 1, 0, 0))
    with pytest.raises(RuntimeError, match=str(swap.name)) as caught:
        engine.step()
    # the damaged unit was never stepped: its segments' step counts (kept in memory) are still 1
    unit0 = engine.parts.units[0]
    steps = [float(engine.optimizer.state[s]["step"]) for s in unit0.segment_masters if s in engine.optimizer.state]
    assert steps and all(s == 1.0 for s in steps), steps
    return str(caught.value)


def test_truncated_swap_file_stops_training_naming_the_file(dist_pool, tmp_path):
    messages = dist_pool(2).run(_truncated_body, str(tmp_path))
    assert all("u0.exp_avg" in m for m in messages)


def test_nvme_path_errors_are_clear(tmp_path, monkeypatch):
    from lightning_zeroq.swap import swapper

    model = TwoHeads()
    missing = tmp_path / "nope"
    engine = ZeroEngine(model, ZeroConfig(offload_optimizer=True, offload_optimizer_device="nvme", nvme_path=str(missing)))
    with pytest.raises(RuntimeError, match="nope"):
        engine.attach_optimizer(torch.optim.AdamW(model.parameters()))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    engine = ZeroEngine(TwoHeads(), ZeroConfig(offload_optimizer=True, offload_optimizer_device="nvme", nvme_path=str(a_file)))
    with pytest.raises(RuntimeError, match="file"):
        engine.attach_optimizer(torch.optim.AdamW(engine.parts.module.parameters()))
    monkeypatch.setattr(swapper, "free_bytes", lambda path: 1000)
    engine = ZeroEngine(TwoHeads(), ZeroConfig(offload_optimizer=True, offload_optimizer_device="nvme", nvme_path=str(tmp_path)))
    with pytest.raises(RuntimeError, match=r"free") as caught:
        engine.attach_optimizer(torch.optim.AdamW(engine.parts.module.parameters()))
    assert str(tmp_path) in str(caught.value)
    assert not list(tmp_path.glob("zeroq_rank*/*.swp"))  # nothing written when the space is short


def _trainer_nvme_body(path: str, stage: int) -> int:
    from lightning_zeroq import ZeroQStrategy
    from tests.integration.lightning.test_parity import _fit

    strategy = ZeroQStrategy(stage=stage, offload_optimizer=True, offload_optimizer_device="nvme", nvme_path=path,
                             reduce_bucket_size=400, stage3_wrap_classes=["Sequential", "Linear"],
                             stage3_param_persistence_threshold=20)
    trainer, _, snaps = _fit(strategy, accumulate=3, clip=0.5, scheduler=True, epochs=1)
    _, _, ref = _fit("ddp_find_unused_parameters_true", accumulate=3, clip=0.5, scheduler=True, epochs=1)
    for got, want in zip(snaps, ref):
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
    mine = f"zeroq_rank{dist.get_rank():05d}_*/*.swp"  # the other rank cleans up on its own schedule
    swap_files = lambda: list(__import__("pathlib").Path(path).glob(mine))  # noqa: E731
    # After fit the module is handed back; the engine keeps its state on NVMe for save_checkpoint,
    # full_state_dict and the like, until the Trainer (and its strategy) goes.
    assert swap_files() and trainer.strategy.full_state_dict()
    del trainer, strategy
    __import__("gc").collect()
    assert not swap_files(), "swap files removed once the trainer is gone"
    return len(snaps)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_nvme_offload_matches_ddp_and_cleans_up(dist_pool, tmp_path, stage):
    assert dist_pool(2).run(_trainer_nvme_body, str(tmp_path), stage)[0] == 3


def _one_thread_body() -> list[str]:
    import warnings
    from unittest import mock

    model = nn.Linear(DIM, DIM)
    engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True))
    with mock.patch("os.cpu_count", return_value=16), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.attach_optimizer(torch.optim.AdamW(model.parameters()))
        torch.set_num_threads(2)
        engine.attach_optimizer(torch.optim.AdamW(model.parameters()))  # enough threads: no warning
    torch.set_num_threads(1)
    return [str(w.message) for w in caught]


def test_offload_warns_when_the_host_step_gets_one_thread(dist_pool):
    # One thread chosen by the user (not torchrun's default): the host AdamW of a 1B model then takes
    # ~1 s a step (seen on H200s); say so.
    messages = dist_pool(2).run(_one_thread_body)[0]
    assert len(messages) == 1 and "OMP_NUM_THREADS=8" in messages[0], messages


def _torchrun_threads_body() -> int:
    import os
    from unittest import mock

    model = nn.Linear(DIM, DIM)
    engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True))
    env = {"TORCHELASTIC_RUN_ID": "test", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
    with mock.patch("os.cpu_count", return_value=16), mock.patch.dict(os.environ, env):
        torch.set_num_threads(1)
        engine.attach_optimizer(torch.optim.AdamW(model.parameters()))
        threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def test_under_torchrun_the_host_step_gets_the_cores_per_local_rank(dist_pool):
    assert dist_pool(2).run(_torchrun_threads_body) == [8, 8]


class _FakeEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU: ``synchronize`` runs the test's check."""

    check = staticmethod(lambda event: None)

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        _FakeEvent.check(self)


def _device_reads_body(offload: str) -> int:
    """With a GPU, ``publish`` copies a host master to the device asynchronously, so a master must not
    be written (a step, a checkpoint load) or its buffer reused (NVMe's pool) before that copy ran.
    Emulated on the CPU: the placement believes it is pinned and every event's wait checks that the
    master still holds the value that was published."""
    real = torch.cuda.Event, torch.cuda.current_stream
    torch.cuda.Event, torch.cuda.current_stream = _FakeEvent, (lambda device=None: None)
    waits = []
    try:
        model, engine = _engine(2, offload, True)
        placement = engine.parts.placement
        placement.pin = True
        published = {}
        original = placement.published

        synced = set()

        def spy(unit):  # the value the device copies for this unit; the copy before it was waited for
            if unit.index in published:
                waits.append(id(published[unit.index][1]) in synced)
            original(unit)
            published[unit.index] = (unit.master.clone(), placement.device_reads[unit.index])

        placement.published = spy

        def check(event):
            index = next(i for i, (_, e) in published.items() if e is event)
            master = engine.parts.units[index].master
            waits.append(master.numel() == 0 or torch.equal(master, published[index][0]))
            synced.add(id(event))

        _FakeEvent.check = staticmethod(check)
        for step in range(2):
            engine.backward(_loss(model, step, 0, 0), boundary=True)
            engine.step()
        full = engine.full_state_dict()
        engine.load_full_state_dict({k: v + 1.0 for k, v in full.items()})
        assert all(waits) and len(waits) >= 2 * len(engine.parts.units), (len(waits), waits)
        assert not placement.device_reads or offload == "optimizer_cpu"
        return len(waits)
    finally:
        torch.cuda.Event, torch.cuda.current_stream = real
        _FakeEvent.check = staticmethod(lambda event: None)


@pytest.mark.parametrize("offload", ["optimizer_cpu", "optimizer_nvme"])
def test_a_host_master_is_written_only_after_the_device_read_it(dist_pool, offload):
    assert min(dist_pool(2).run(_device_reads_body, offload)) > 0


def _copy_stream_body(boundary, idle: bool, in_flight: int = 100) -> tuple[list, list, list, list, int]:
    """The gradient copies to the host (CUDA only; emulated): in a backward that ends the window
    (``boundary=True``) a unit is copied as soon as it is reduced if no such copy is still running
    (``idle``: each finished before the next unit's reduction), the others at finalize; on the
    copy stream, one event per unit; the step reads a unit's host gradient only after its event; a
    window dropped after its copies were issued makes the compute stream wait for them before the
    device shards are zeroed. ``in_flight``: ``host_grads.IN_FLIGHT`` (the copies a backward keeps
    running before the host waits for the oldest)."""
    from contextlib import nullcontext

    from lightning_zeroq.zero import comm
    from lightning_zeroq.zero.offload import host_grads

    log: list = []

    class Stream:
        def wait_stream(self, other) -> None:
            pass

        def wait_event(self, event) -> None:
            log.append(("stream waits", event.n))

    class Event:
        made = 0

        def __init__(self) -> None:
            Event.made += 1
            self.n = Event.made

        def record(self, stream=None) -> None:
            log.append(("copy issued", self.n))

        def synchronize(self) -> None:
            log.append(("host waits", self.n))

        def query(self) -> bool:
            return idle

    real = (torch.cuda.Event, torch.cuda.current_stream, torch.cuda.stream, comm.side_stream)
    real_in_flight, host_grads.IN_FLIGHT = host_grads.IN_FLIGHT, in_flight
    torch.cuda.Event, torch.cuda.current_stream = Event, (lambda device=None: Stream())
    torch.cuda.stream, comm.side_stream = (lambda stream: nullcontext()), (lambda device: Stream())
    try:
        torch.manual_seed(0)
        model = TwoHeads()
        engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=700, overlap_comm=False,
                                              offload_optimizer=True))
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        n = len(engine.parts.units)
        engine.backward(_loss(model, 0, 0, 0), boundary=boundary)
        during_backward = list(log)
        engine.clip_grad_norm_(1.0)  # the first clip brings the landed gradients back for their norm ...
        recalled = [e for kind, e in log if kind == "stream waits"]
        issued = [entry for entry in log if entry[0] == "copy issued"]
        assert sorted(recalled) == sorted(e for _, e in issued), log  # each once, after its copy
        log[:] = before = [entry for entry in log if entry[0] != "stream waits"]  # with the waits of IN_FLIGHT
        engine.step()
        stepped = log[len(before):]
        log.clear()
        engine.backward(_loss(model, 1, 0, 0), boundary=boundary)
        engine.clip_grad_norm_(1.0)  # ... later ones measured it as it left; the copies are issued (during the backward or at finalize) ...
        engine.zero_grad()  # ... and the window is dropped
        return during_backward, issued, stepped, log[n:], n
    finally:
        torch.cuda.Event, torch.cuda.current_stream, torch.cuda.stream, comm.side_stream = real
        host_grads.IN_FLIGHT = real_in_flight


@pytest.mark.parametrize("boundary, idle", [(True, True), (True, False), (None, True)],
                         ids=["last_backward_idle_copies", "last_backward_busy_copies", "unmanaged"])
def test_gradient_copies_are_waited_for_unit_by_unit(dist_pool, boundary, idle):
    during_backward, issued, stepped, dropped, n = dist_pool(2).run(_copy_stream_body, boundary, idle)[0]
    assert n > 1
    # a backward that ends the window copies a unit as it is reduced while no such copy is running
    # (busy: the first only; the agreement's read-back then waits for it alone), except the unit reduced
    # last (the read-back comes right after it); the others at finalize
    assert during_backward == (issued[: n - 1] if idle else issued[:1]) if boundary else during_backward == []
    assert [kind for kind, _ in issued] == ["copy issued"] * n
    assert sorted(e for _, e in stepped) == sorted(e for _, e in issued)  # each copy waited for once
    assert all(kind == "host waits" for kind, _ in stepped)
    # reverse unit order, as the step takes them: the host starts on the first copy issued
    assert [e for _, e in stepped] == [e for _, e in issued]
    assert [kind for kind, _ in dropped] == ["stream waits"] * n


def test_a_backward_waits_for_its_oldest_copy_past_the_copies_in_flight(dist_pool):
    """A device gradient a copy still reads cannot be reused: past ``IN_FLIGHT`` copies running, the host
    waits for the oldest before issuing the next, so the device never holds more unit gradients than that
    waiting for PCIe (with 1: each copy after the first waits for the one before it)."""
    during_backward, *_ , n = dist_pool(2).run(_copy_stream_body, True, True, 1)[0]
    assert n > 2
    issued = [e for kind, e in during_backward if kind == "copy issued"]
    assert len(issued) == n - 1
    expected = [("copy issued", issued[0])]
    for before, e in zip(issued, issued[1:]):
        expected += [("copy issued", e), ("host waits", before)]
    assert during_backward == expected


@pytest.mark.parametrize("numel, chunk", [(1000, 64), (1000, 1000), (1000, 3000), (1, 7), (0, 5)])
def test_copy_cast_to_device_chunks_cover_every_element(numel, chunk):
    """The copy back of a host master (fp32, cast where it lands): chunk by chunk, the tail included,
    the same values as one cast (here host to host: the chunking is what is tested)."""
    from lightning_zeroq.zero.offload.stores import copy_cast_to_device

    src = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    for dtype in (torch.bfloat16, torch.float16):
        dst = torch.full((numel,), float("nan"), dtype=dtype)
        assert copy_cast_to_device(dst, src, chunk_numel=chunk) is dst
        assert torch.equal(dst, src.to(dtype))


def _landing_body(stage: int, offload: str, dtype: torch.dtype) -> list:
    """Per window: which units still hold a gradient on the device after finalize, the clipped norm,
    the per-parameter norms and the finiteness verdict; for one engine per offload setting."""
    torch.manual_seed(0)
    model = TwoHeads().to(dtype)
    config = ZeroConfig(stage=stage, reduce_bucket_size=700, stage3_wrap_classes=["Linear"],
                        stage3_param_persistence_threshold=40, **_offload_options(offload))
    engine = ZeroEngine(model, config, param_dtype=dtype)
    engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))  # lr 0: every window sees the same weights
    out = []
    for step in range(3):
        engine.backward(_loss(model, step, 0, head=0).float(), boundary=True)
        engine.finalize_gradients()
        on_device = [u.index for u in engine.parts.units if u.pending is not None or u.has_grad_storage]
        norm = engine.clip_grad_norm_(1e9)  # no clipping, only the norm
        per_param = {k: v.clone() for k, v in engine.grad_norms().items()}
        out.append((on_device, norm.clone(), per_param))
        engine.step()
        engine.zero_grad()
    engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_offloaded_gradients_leave_the_device_and_their_norms_stay_bitwise(dist_pool, stage, dtype):
    """With the optimizer on the host, no unit holds its gradient on the device once the window is
    finalized (it was copied to the host and released; before, every unit held an fp32 shard there
    until the step: at 3.8B parameters on one H200, 14 GiB more reserved than the forward needed), and
    the norms read from what left the device (first window: brought back; later: measured as it left)
    are bitwise those of the same model with the optimizer on the device."""
    pool = dist_pool(2)
    ours = pool.run(_landing_body, stage, "optimizer_cpu", dtype)
    reference = pool.run(_landing_body, stage, "none", dtype)
    for mine, theirs in zip(ours, reference):
        for (on_device, norm, per_param), (ref_on_device, ref_norm, ref_per_param) in zip(mine, theirs):
            assert on_device == [] and ref_on_device != []
            assert torch.equal(norm, ref_norm)
            assert per_param.keys() == ref_per_param.keys()
            assert all(torch.equal(per_param[k], ref_per_param[k]) for k in per_param)


def _nvme_spill_body(stage: int) -> None:
    spilled, _ = _train(stage, "optimizer_nvme_half", True)
    on_host, _ = _train(stage, "optimizer_cpu", True)
    assert spilled.keys() == on_host.keys() and all(torch.equal(spilled[k], on_host[k]) for k in spilled)
    model, engine = _engine(stage, "optimizer_nvme_half", True)
    engine.backward(_loss(model, 0, 0, 0))
    engine.step()
    placement = engine.parts.placement
    swapped = {u.index for u in engine.parts.units if placement._swaps(u)}
    assert 0 < len(swapped) < len(engine.parts.units), "some units swap, the others stay in host memory"
    numel = sum(u.layout.numel for u in engine.parts.units)
    assert sum(u.layout.numel for u in engine.parts.units if u.index in swapped) >= numel / 2, "largest first, to half"
    regions = set(placement.swapper._regions)
    for unit in engine.parts.units:
        on_disk = unit.index in swapped
        assert (f"u{unit.index}.master" in regions) == on_disk, "only the swapped units have swap files"
        assert (unit.master.numel() == 0) == on_disk, "between steps only the swapped units' masters are evicted"
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_spill_keeps_the_other_units_in_host_memory_bitwise(dist_pool, stage):
    """``offload_optimizer_nvme_ratio=0.5``: the largest units' optimizer state goes to the swap files
    until half the parameters are there, the others' stays in host memory; the training is bitwise CPU
    offload's (both step on the host)."""
    dist_pool(2).run(_nvme_spill_body, stage)


def _nvme_pool_body() -> tuple[int, int]:
    from lightning_zeroq.zero.offload.nvme import WRITES_IN_FLIGHT

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=272, **_offload_options("optimizer_nvme")))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        engine.backward(model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).square().mean())
        engine.step()
        engine.zero_grad()
    placement = engine.parts.placement
    units = len(engine.parts.units)
    held = sum(len(free) for free in placement._pool._free.values())
    engine.close()
    return units, held // (1 + len(placement.keys)) - WRITES_IN_FLIGHT


def test_nvme_step_holds_a_few_units_buffers_not_every_swapped_units(dist_pool):
    """The step walks the swapped units reading one ahead and writing each back: a unit's buffers go back
    to the pool once its write is done, at most ``WRITES_IN_FLIGHT`` writes behind, so the host holds a few
    units' masters and moments, not the whole model's (which it held before the bound)."""
    for units, beyond in dist_pool(2).run(_nvme_pool_body):
        assert units == 8
        assert beyond <= 2, beyond  # the unit being stepped and the one read ahead


def _evicted_masters_body() -> list[bool]:
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=272, **_offload_options("optimizer_nvme")))
    masters = [weakref.ref(unit.master) for unit in engine.parts.units]
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))  # writes the masters out, evicts them
    gc.collect()
    alive = [ref() is not None for ref in masters]
    engine.close()
    return alive


def test_a_master_written_to_nvme_leaves_host_memory(dist_pool):
    """Once a unit's master is in its swap file, nothing holds the host copy: the optimizer's segment
    tensors are not views of it (a view would keep its base, whatever its ``.data`` was set to later)."""
    for alive in dist_pool(2).run(_evicted_masters_body):
        assert alive and not any(alive), alive
