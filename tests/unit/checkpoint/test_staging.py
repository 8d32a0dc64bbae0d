"""The staging ring synchronous saves copy device tensors through (``writer.StagingRing``).

On CPU the ring is forced on CPU source tensors (``cpu_sources=True``, unpinned) and made tiny, so
that it wraps around, fills up, makes the producer wait and refuses items larger than itself: the
files must be byte for byte those of the unstaged writer, load back bitwise (our loader and stock
``dcp.load``), and the ring must never hold more than its capacity, nor keep a region after a save,
failed or not. The ``gpu`` test does the same with CUDA tensors through pinned memory. CPU views
written without a copy (``copy_views=False``) give the same bytes too.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zeroq.checkpoint import writer as writer_module
from lightning_zeroq.checkpoint.chunks import LocalChunks
from lightning_zeroq.checkpoint.writer import STAGING_ALIGN, ChunkSavePlanner, ChunkWriter, StagingRing

RING = 8 * STAGING_ALIGN
"""Smaller than some items below (they take the old path), larger than most (several fit at once)."""


class CheckedRing(StagingRing):
    """Checks, at every region taken, that the regions in use are disjoint and inside the buffer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.staged = 0
        self.refused = 0

    def takes(self, tensor):
        ok = super().takes(tensor)
        self.refused += not ok
        return ok

    def _acquire(self, size):
        region = super()._acquire(size)
        with self._cond:
            self.staged += 1
            spans = sorted(self._regions)
            assert all(0 <= start and start + n <= self.capacity for start, n in spans), spans
            assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"overlapping regions {spans}"
            assert sum(n for _, n in spans) == self.held <= self.capacity
        return region


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(3000, generator=g)
    return {
        "small": torch.randn(5, 7, generator=g),
        "exact": torch.randn(RING // 4, generator=g),  # exactly the ring
        "large": torch.randn(RING // 4 + 1, generator=g),  # one element too many: the old path
        "bf16": torch.randn(33, generator=g).bfloat16(),
        "int": torch.arange(100),
        "scalar": torch.tensor(2.5),
        "bool": torch.rand(17, generator=g) > 0.5,
        "transposed": torch.randn(8, 9, generator=g).t(),  # not contiguous: the old path (strides kept)
        "size1_strides": torch.randn(6, 1, generator=g).t(),  # contiguous, stride (1, 1): written as such
        "offset_view": torch.randn(50, generator=g)[7:40],
        "empty": torch.empty(0, 4),
        "chunks": LocalChunks(torch.Size([60, 50]), torch.float32, 0, 3000, read=lambda: flat, order=0),
        "nested": {"lr": 0.1, "name": "adamw", "t": torch.randn(3, 3, generator=g)},
    }


def _expected(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, LocalChunks):
            out[key] = value.read().view(value.shape).clone()
        elif isinstance(value, dict):
            out[key] = _expected(value)
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def _zeros_like(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _zeros_like(value)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value, memory_format=torch.contiguous_format)
        else:
            out[key] = None
    return out


def _save(path: str, state: dict, ring, copy_views: bool = True) -> bytes:
    writer = ChunkWriter(path, "sametoken", staging=ring, copy_views=copy_views)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it assumes so
        dcp.save(state, storage_writer=writer, planner=ChunkSavePlanner())
    with open(os.path.join(path, "__0_0.distcp"), "rb") as f:
        return f.read()


def _assert_equal(got, want, where="") -> None:
    if isinstance(want, dict):
        for key in want:
            _assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    else:
        assert got == want, where


def test_staged_files_are_byte_identical_and_load_back_bitwise():
    state = _state()
    with tempfile.TemporaryDirectory() as tmp:
        plain = _save(os.path.join(tmp, "plain"), state, None)
        ring = CheckedRing(RING, pin=False, cpu_sources=True)
        staged = _save(os.path.join(tmp, "staged"), state, ring)
        assert staged == plain
        assert ring.staged >= 8 and ring.refused >= 3  # both paths were taken
        assert ring.held == 0 and 0 < ring.peak <= RING and ring.buffer.numel() == RING
        staged_again = _save(os.path.join(tmp, "again"), _state(), ring)  # the buffer is reused
        assert staged_again == plain and ring.held == 0

        target = _zeros_like(_expected(state))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, checkpoint_id=os.path.join(tmp, "staged"))  # stock DCP reader
        _assert_equal(target, _expected(state))


def test_cpu_views_written_without_a_copy_are_byte_identical():
    state = _state()
    with tempfile.TemporaryDirectory() as tmp:
        plain = _save(os.path.join(tmp, "plain"), state, None)
        assert _save(os.path.join(tmp, "cut"), state, None, copy_views=False) == plain
    writer = ChunkWriter("unused", "t", copy_views=False)
    base = torch.randn(100)
    for view in (base[10:30], base[10:30].view(4, 5), base[:0], base[::2], torch.randn(6, 1).t(), base):
        out = writer._to_host(view)
        assert torch.equal(out, view) and out.untyped_storage().nbytes() == out.numel() * out.element_size()
        if view.numel() and view.is_contiguous():
            assert out.data_ptr() == view.data_ptr()  # no copy
    assert ChunkWriter("unused", "t")._to_host(base[10:30]).data_ptr() != base[10:30].data_ptr()


def test_ring_never_holds_more_than_its_capacity_under_concurrency():
    ring = CheckedRing(RING, pin=False, cpu_sources=True)
    rng = random.Random(0)
    sizes = [rng.choice([1, 3, 64, 200, 511, 512, 700, 1024]) for _ in range(400)]
    handed: list = []
    cond = threading.Condition()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for i in range(len(sizes)):
                with cond:
                    while len(handed) <= i:
                        cond.wait()
                    staged, expected = handed[i]
                time.sleep(rng.random() * 1e-4)
                assert ring.held <= RING
                assert torch.equal(staged.wait(), expected), f"item {i} was overwritten while in flight"
                staged.release()
                staged.release()  # a second release does nothing
        except BaseException as error:
            errors.append(error)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for i, n in enumerate(sizes):
        source = torch.full((n,), i % 251, dtype=torch.uint8)
        assert ring.takes(source)
        staged = ring.stage(source)  # waits while the ring is full
        with cond:
            handed.append((staged, source.clone()))
            cond.notify()
    consumer.join(60)
    assert not consumer.is_alive() and not errors, errors
    assert ring.held == 0 and RING - STAGING_ALIGN < ring.peak <= RING
    assert ring.staged == len(sizes)
    big = torch.zeros(RING + 1, dtype=torch.uint8)
    assert not ring.takes(big) and not ring.takes(torch.zeros(0)) and not ring.takes(torch.zeros(4, 4).t())
    ring.free()
    assert ring.buffer is None


@pytest.mark.parametrize("bad", [-1, 1.5, "512MiB", True])
def test_checkpointer_rejects_a_bad_staging_size(bad):
    from lightning_zeroq.checkpoint.checkpointer import Checkpointer

    with pytest.raises(ValueError, match=f"staging_bytes={bad!r}.*int >= 0"):
        Checkpointer(staging_bytes=bad)
    assert Checkpointer(staging_bytes=0).staging is None


def test_ring_pickles_without_its_buffer():
    import pickle

    ring = StagingRing(RING, pin=False, cpu_sources=True)
    ring.stage(torch.ones(3)).release()
    copy = pickle.loads(pickle.dumps(ring))
    assert (copy.capacity, copy.pin, copy.cpu_sources, copy.buffer, copy.held) == (RING, False, True, None, 0)
    staged = copy.stage(torch.ones(3))
    assert torch.equal(staged.wait(), torch.ones(3))
    staged.release()


def test_failed_copy_hands_its_region_back():
    ring = CheckedRing(RING, pin=False, cpu_sources=True)
    first = ring.stage(torch.ones(10))
    second = ring.stage(torch.ones(10))
    good = ring.buffer

    class Broken:
        def __getitem__(self, index):
            raise RuntimeError("copy failed")

    ring.buffer = Broken()
    with pytest.raises(RuntimeError, match="copy failed"):
        ring.stage(torch.ones(10))
    ring.buffer = good
    assert ring.held == 2 * STAGING_ALIGN  # the newest region went back out of order
    first.release()
    third = ring.stage(torch.full((3,), 7.0))
    assert torch.equal(second.wait(), torch.ones(10)) and torch.equal(third.wait(), torch.full((3,), 7.0))
    second.release()
    third.release()
    assert ring.held == 0


def test_writer_failure_releases_every_region_and_does_not_hang(monkeypatch):
    state = _state()
    ring = CheckedRing(RING, pin=False, cpu_sources=True)
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj, f, *args, **kwargs):
        if threading.current_thread().name == "zeroq-checkpoint-writer":
            calls["n"] += 1
            if calls["n"] == 4:
                raise OSError("disk full")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(writer_module.torch, "save", failing_save)
    outcome: list = []

    def run(tmp: str) -> None:
        try:
            _save(os.path.join(tmp, "x"), state, ring)
        except CheckpointException as error:
            outcome.append(error)

    with tempfile.TemporaryDirectory() as tmp:
        thread = threading.Thread(target=run, args=(tmp,), daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the save hung after its writer failed"
    assert len(outcome) == 1 and "disk full" in repr(outcome[0].failures)
    assert ring.held == 0
    monkeypatch.setattr(writer_module.torch, "save", real_save)
    with tempfile.TemporaryDirectory() as tmp:  # the ring is usable again
        assert _save(os.path.join(tmp, "a"), state, ring) == _save(os.path.join(tmp, "b"), state, None)


def _engine_body(tmp: str, config: str) -> bool:
    import torch.distributed as dist

    from lightning_zeroq.checkpoint.checkpointer import Checkpointer
    from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine
    from tests.integration.checkpoint.test_engine import _engine, _state as full_state, _train, _assert_state_equal

    engine = _engine(config, tmp)
    _train(engine, range(2))
    staged = Checkpointer()
    staged.staging = CheckedRing(RING, pin=False, cpu_sources=True)
    save_engine(engine, os.path.join(tmp, "staged"), trainer_state={"step": 2}, checkpointer=staged)
    save_engine(engine, os.path.join(tmp, "plain"), trainer_state={"step": 2}, checkpointer=Checkpointer(staging_bytes=0))
    assert staged.staging.staged > 0 and staged.staging.held == 0 and staged.staging.peak <= RING
    dist.barrier()
    name = f"__{dist.get_rank()}_0.distcp"
    files = [Path(tmp, d, name).read_bytes()[writer_module.HEADER_SIZE:] for d in ("staged", "plain")]
    assert files[0] == files[1]  # the same items, byte for byte (the headers name two saves)
    saved = full_state(engine)
    fresh = _engine(config, tmp, seed=3)
    assert load_engine(fresh, os.path.join(tmp, "staged")) == {"step": 2}
    _assert_state_equal(saved, full_state(fresh))
    staged.release()
    assert staged.staging.buffer is None
    return True


@pytest.mark.parametrize("config", ["s2", "s3_offload"])
def test_engine_save_through_the_ring_round_trips_bitwise(dist_pool, config):
    with tempfile.TemporaryDirectory() as tmp:
        assert dist_pool(2).run(_engine_body, tmp, config) == [True, True]


@pytest.mark.gpu
def test_cuda_tensors_through_pinned_ring_are_byte_identical():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    state = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _state().items() if k != "chunks"}
    flat = torch.randn(3000, device="cuda")
    state["chunks"] = LocalChunks(torch.Size([60, 50]), torch.float32, 0, 3000, read=lambda: flat, order=0)
    with tempfile.TemporaryDirectory() as tmp:
        plain = _save(os.path.join(tmp, "plain"), state, None)
        ring = CheckedRing(RING, pin=None)
        assert _save(os.path.join(tmp, "staged"), state, ring) == plain
        assert ring.pin and ring.buffer.is_pinned() and ring.staged >= 8 and ring.held == 0
