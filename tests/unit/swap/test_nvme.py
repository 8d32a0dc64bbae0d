"""Tests of the NVMe swap space (``lightning_zeroq.swap``) on a temporary directory."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch

import lightning_zeroq.swap
from lightning_zeroq.swap import NvmeSwapper, SwapHandle, aligned_empty
from lightning_zeroq.swap import cleanup as swap_cleanup
from lightning_zeroq.swap import directory as swap_directory
from lightning_zeroq.swap import io as swap_io
from lightning_zeroq.swap import swapper as swap_swapper

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]  # uint8: stage 3's INT8 payloads
SWAP_LOGGER = "lightning_zeroq.swap"  # its modules log under it
SMALL_BUFFER = 64 * 1024  # several chunks per region, so chunking and queueing are exercised


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), generator=generator, dtype=torch.uint8)
    return torch.randn(numel, generator=generator).to(dtype)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _unaligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose data does not start on a 4096-byte boundary (forces the bounce buffers)."""
    t = aligned_empty(numel + 1, dtype)[1:]
    assert t.data_ptr() % 4096 != 0
    return t


@pytest.fixture(params=[None, False], ids=["probe", "buffered"])
def swapper(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NvmeSwapper]:
    sw = NvmeSwapper(tmp_path, rank=3, num_buffers=2, buffer_bytes=SMALL_BUFFER, direct_io=request.param)
    yield sw
    sw.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_sync(swapper: NvmeSwapper, dtype: torch.dtype) -> None:
    sizes = {"u0.master": 100_003, "u1.master": 12_345, "u2.master": 4096, "u3.master": 1}
    for key, numel in sizes.items():
        swapper.register(key, numel, dtype)
    swapper.reserve()
    sources = {key: _random(numel, dtype, seed=i) for i, (key, numel) in enumerate(sizes.items())}
    for key, src in sources.items():
        swapper.write(key, src)
    for key, src in sources.items():
        for out in (torch.empty_like(src), _unaligned_empty(src.numel(), dtype), aligned_empty(src.numel(), dtype)):
            swapper.read(key, out)
            assert _bitwise_equal(out, src), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_async_with_prefetch(swapper: NvmeSwapper, dtype: torch.dtype) -> None:
    numel = 77_777  # not a multiple of the alignment in bytes for any dtype
    keys = [f"u{i}.{kind}" for i in range(3) for kind in ("master", "exp_avg", "exp_avg_sq")]
    for key in keys:
        swapper.register(key, numel, dtype)
    swapper.reserve()
    sources = {key: _random(numel, dtype, seed=i) for i, key in enumerate(keys)}
    handles = [swapper.write_async(key, src) for key, src in sources.items()]
    for handle in handles:
        handle.wait()
        assert handle.done()
    into_out = {key: _unaligned_empty(numel, dtype) for key in keys[::2]}
    for key in keys:
        swapper.prefetch(key, out=into_out.get(key))
    for key, src in sources.items():
        out = into_out.get(key, torch.empty_like(src))
        swapper.read(key, out)
        assert _bitwise_equal(out, src), key
    swapper.wait_all()


def test_read_ahead_overlaps_write_back(swapper: NvmeSwapper) -> None:
    """The engine's loop: read unit i+1 ahead while unit i steps and unit i-1 is written back."""
    units, numel, kinds = 6, 50_000, ("master", "exp_avg", "exp_avg_sq")
    for u in range(units):
        for kind in kinds:
            swapper.register(f"u{u}.{kind}", numel, torch.float32)
    swapper.reserve()
    expected = {f"u{u}.{k}": _random(numel, torch.float32, seed=10 * u + i) for u in range(units) for i, k in enumerate(kinds)}
    for key, value in expected.items():
        swapper.write(key, value)
    for _ in range(2):  # two "steps"
        working = [{kind: torch.empty(numel) for kind in kinds} for _ in range(2)]  # double-buffered
        write_backs: list[list[SwapHandle]] = [[], []]
        for kind in kinds:
            swapper.prefetch(f"u0.{kind}")
        for u in range(units):
            if u + 1 < units:
                for kind in kinds:
                    swapper.prefetch(f"u{u + 1}.{kind}")
            for handle in write_backs[u % 2]:  # unit u-2's write-back still reads this buffer
                handle.wait()
            current = working[u % 2]
            write_backs[u % 2] = []
            for kind in kinds:
                key = f"u{u}.{kind}"
                swapper.read(key, current[kind])
                assert _bitwise_equal(current[kind], expected[key]), key
                current[kind].mul_(0.5).add_(u)  # the "optimizer step"
                expected[key] = current[kind].clone()
                write_backs[u % 2].append(swapper.write_async(key, current[kind]))
        swapper.wait_all()
    for key, value in expected.items():
        out = torch.empty(numel)
        swapper.read(key, out)
        assert _bitwise_equal(out, value), key


def test_operations_on_one_key_keep_their_order(swapper: NvmeSwapper) -> None:
    swapper.register("k", 30_000, torch.float32)
    swapper.reserve()
    a, b, c = (_random(30_000, torch.float32, seed=s) for s in range(3))
    swapper.write_async("k", a)
    swapper.prefetch("k")  # issued after the write: must see a
    out = torch.empty(30_000)
    swapper.read("k", out)
    assert _bitwise_equal(out, a)
    swapper.prefetch("k")
    swapper.write_async("k", b)  # makes the read-ahead stale
    swapper.read("k", out)
    assert _bitwise_equal(out, b)
    swapper.prefetch("k")
    swapper.write("k", c)
    swapper.read("k", out)
    assert _bitwise_equal(out, c)


def test_empty_region(swapper: NvmeSwapper) -> None:
    swapper.register("empty", 0, torch.float32)
    swapper.reserve()
    swapper.write("empty", torch.empty(0))
    swapper.prefetch("empty")
    swapper.read("empty", torch.empty(0))


# ---------------------------------------------------------------------------------------------
# Direct I/O and its fallback
# ---------------------------------------------------------------------------------------------


def test_direct_io_is_probed_and_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    swap_io._warned_buffered.clear()
    with caplog.at_level(logging.WARNING, logger=SWAP_LOGGER):
        sw = NvmeSwapper(tmp_path, buffer_bytes=SMALL_BUFFER)
        sw.register("k", 10_001, torch.float32)
        sw.reserve()
    fallback_logged = any("O_DIRECT not supported" in r.getMessage() for r in caplog.records)
    assert sw.direct_io is not None
    assert fallback_logged == (not sw.direct_io), f"direct_io={sw.direct_io}, log: {caplog.text}"
    _assert_round_trip(sw, _random(10_001, torch.float32, seed=0))
    sw.close()


def _assert_round_trip(sw: NvmeSwapper, src: torch.Tensor, key: str = "k") -> None:
    sw.write(key, src)
    out = torch.empty_like(src)
    sw.read(key, out)
    assert _bitwise_equal(out, src)


def _reject_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def test_fallback_to_buffered_io_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _reject_o_direct(monkeypatch)
    swap_io._warned_buffered.clear()
    with caplog.at_level(logging.WARNING, logger=SWAP_LOGGER):
        swappers = [NvmeSwapper(tmp_path, rank=r, buffer_bytes=SMALL_BUFFER) for r in range(2)]
        for sw in swappers:
            sw.register("k", 5000, torch.bfloat16)
            sw.reserve()
    messages = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert messages == [f"O_DIRECT not supported on {tmp_path} ({swap_io.filesystem_type(tmp_path)}), using buffered I/O"]
    for sw in swappers:
        assert sw.direct_io is False
        _assert_round_trip(sw, _random(5000, torch.bfloat16, seed=1))
        sw.close()


def test_required_direct_io_unavailable_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _reject_o_direct(monkeypatch)
    sw = NvmeSwapper(tmp_path, direct_io=True)
    sw.register("k", 10, torch.float32)
    with pytest.raises(RuntimeError, match=r"O_DIRECT not supported on .*direct_io=None"):
        sw.reserve()
    sw.close()


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(RuntimeError, match=rf"{missing}.*does not exist; create it or set nvme_path to an existing directory"):
        NvmeSwapper(missing)


def test_path_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(RuntimeError, match=rf"{file}.*is not a directory"):
        NvmeSwapper(file)


def test_path_not_writable(tmp_path: Path) -> None:
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("running as root: chmod 0o500 does not stop this process from writing")
        with pytest.raises(RuntimeError, match=rf"{read_only}.*not writable"):
            NvmeSwapper(read_only)
    finally:
        read_only.chmod(0o700)


def test_too_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swap_swapper, "free_bytes", lambda path: 3 * 1024 * 1024)
    sw = NvmeSwapper(tmp_path)
    sw.register("a", 1_000_000, torch.float32)  # 4_000_000 bytes, rounded up to 4096: 4_001_792
    sw.register("b", 10, torch.float16)  # one 4096-byte block
    with pytest.raises(RuntimeError) as info:
        sw.reserve()
    message = str(info.value)
    for part in (str(tmp_path), "need 3.82 MiB (4005888 bytes)", "only 3.00 MiB (3145728 bytes) are free", "larger disk"):
        assert part in message, message
    assert not list(sw.directory.glob("*.swp"))  # checked before anything was written
    sw.close()


def test_truncated_file_between_write_and_read(swapper: NvmeSwapper) -> None:
    swapper.register("k", 100_000, torch.float32)
    swapper.register("other", 100, torch.float32)
    swapper.reserve()
    swapper.write("k", _random(100_000, torch.float32, seed=0))
    swapper.write("other", torch.zeros(100))
    os.truncate(swapper.path_of("k"), 150_000)
    out = torch.zeros(100_000)
    with pytest.raises(RuntimeError, match=rf"short read from swap file {swapper.path_of('k')}: offset \d+, expected \d+ bytes, got \d+"):
        swapper.read("k", out)
    # sticky: the swap space is not trusted any more
    with pytest.raises(RuntimeError, match="stopped after an I/O error"):
        swapper.read("other", torch.empty(100))


def test_truncated_file_found_by_prefetch(swapper: NvmeSwapper) -> None:
    swapper.register("k", 20_000, torch.float16)
    swapper.reserve()
    swapper.write("k", _random(20_000, torch.float16, seed=0))
    os.truncate(swapper.path_of("k"), 0)
    handle = swapper.prefetch("k")
    with pytest.raises(RuntimeError, match=rf"short read from swap file {swapper.path_of('k')}"):
        swapper.read("k", torch.empty(20_000, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="short read"):
        handle.wait()


def test_removed_file_in_background_write_is_reraised(swapper: NvmeSwapper) -> None:
    swapper.register("gone", 1000, torch.float32)
    swapper.register("ok", 1000, torch.float32)
    swapper.reserve()
    swapper.path_of("gone").unlink()
    swapper.write_async("gone", torch.ones(1000))
    with pytest.raises(RuntimeError, match=rf"swap file {swapper.path_of('gone')} .*is missing"):
        swapper.wait_all()
    with pytest.raises(RuntimeError, match="stopped after an I/O error.*gone.swp"):
        swapper.write("ok", torch.ones(1000))


def test_bad_keys_and_tensors(swapper: NvmeSwapper) -> None:
    swapper.register("u0.master", 1000, torch.float32)
    with pytest.raises(ValueError, match=r"key='u0.master' is registered but not reserved"):
        swapper.write("u0.master", torch.zeros(1000))
    swapper.reserve()
    with pytest.raises(ValueError, match=r"key='u9.master' is not registered"):
        swapper.write("u9.master", torch.zeros(1000))
    with pytest.raises(ValueError, match=r"key='u9.master' is not registered"):
        swapper.prefetch("u9.master")
    with pytest.raises(ValueError, match=r"'u0.master'.*numel=999 dtype=torch.float32.*numel=1000 dtype=torch.float32"):
        swapper.write("u0.master", torch.zeros(999))
    with pytest.raises(ValueError, match=r"'u0.master'.*dtype=torch.bfloat16.*dtype=torch.float32"):
        swapper.write("u0.master", torch.zeros(1000, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        swapper.write("u0.master", torch.zeros(2000)[::2])
    with pytest.raises(ValueError, match="never been written"):
        swapper.read("u0.master", torch.zeros(1000))
    with pytest.raises(ValueError, match="already registered"):
        swapper.register("u0.master", 1000, torch.float32)
    with pytest.raises(ValueError, match="names a file"):
        swapper.register("../escape", 10, torch.float32)
    with pytest.raises(ValueError, match="dtype=torch.int64 is not supported"):
        swapper.register("ints", 10, torch.int64)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": -1}, "rank=-1"),
        ({"num_buffers": 0}, "num_buffers=0"),
        ({"alignment": 1000}, "alignment=1000"),
        ({"buffer_bytes": 5000}, "buffer_bytes=5000"),
        ({"num_threads": 0}, "num_threads=0"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NvmeSwapper(tmp_path, **kwargs)


# ---------------------------------------------------------------------------------------------
# Lifetime
# ---------------------------------------------------------------------------------------------


def test_close_waits_and_removes_files(tmp_path: Path) -> None:
    sw = NvmeSwapper(tmp_path, rank=1, buffer_bytes=SMALL_BUFFER)
    for i in range(4):
        sw.register(f"k{i}", 200_000, torch.float32)
    sw.reserve()
    files = [sw.path_of(f"k{i}") for i in range(4)]
    assert all(f.stat().st_size == 802_816 for f in files)  # 800_000 rounded up to 4096
    for i in range(4):
        sw.write_async(f"k{i}", torch.full((200_000,), float(i)))
    sw.prefetch("k0")
    sw.close()
    assert not any(f.exists() for f in files)
    assert not sw.directory.exists()
    assert list(tmp_path.iterdir()) == []
    sw.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        sw.write("k0", torch.zeros(200_000))


def test_keeps_a_directory_it_did_not_create(tmp_path: Path) -> None:
    existing = tmp_path / "zeroq_rank00000"
    existing.mkdir()
    (existing / "unrelated").write_text("keep me")
    with NvmeSwapper(tmp_path) as sw:
        sw.register("k", 10, torch.float32)
        sw.reserve()
    assert sorted(p.name for p in existing.iterdir()) == ["unrelated"]


# ---------------------------------------------------------------------------------------------
# The private directory: exclusive, unshared, never following a symlink
# ---------------------------------------------------------------------------------------------


def test_swappers_on_one_path_and_rank_never_share_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=SWAP_LOGGER):
        a, b = (NvmeSwapper(tmp_path, rank=3, buffer_bytes=SMALL_BUFFER) for _ in range(2))
    assert "left behind" not in caplog.text  # a live swapper's directory is locked, never reported
    assert a.directory != b.directory
    for sw in (a, b):
        assert sw.directory.parent == tmp_path and sw.directory.name.startswith("zeroq_rank00003_")
        assert stat.S_IMODE(sw.directory.lstat().st_mode) == 0o700
        sw.register("k", 5000, torch.float32)
        sw.reserve()
    a_data, b_data = _random(5000, torch.float32, seed=1), _random(5000, torch.float32, seed=2)
    a.write("k", a_data)
    b.write("k", b_data)
    a.close()
    assert not a.directory.exists()
    out = torch.empty(5000)
    b.read("k", out)  # intact after the other one closed
    assert _bitwise_equal(out, b_data)
    b.close()
    assert list(tmp_path.iterdir()) == []


def test_planted_symlinks_are_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "k.swp").write_text("precious")
    nvme_path = tmp_path / "nvme"
    nvme_path.mkdir()
    (nvme_path / "zeroq_rank00000").symlink_to(victim)  # the per-rank name older versions reused
    sw = NvmeSwapper(nvme_path)
    assert sw.directory.parent == nvme_path and not sw.directory.is_symlink()
    sw.register("k", 1000, torch.float32)
    sw.register("planted", 1000, torch.float32)
    planted = sw.directory / "planted.swp"
    planted.symlink_to(victim / "k.swp")  # something else writes into our directory
    with pytest.raises(RuntimeError, match=rf"cannot create swap file {planted}: something this swapper did not"):
        sw.reserve()
    assert planted.is_symlink()  # left untouched
    planted.unlink()
    sw.reserve()
    sw.path_of("k").unlink()
    sw.path_of("k").symlink_to(victim / "k.swp")  # replaced after reserve()
    with pytest.raises(RuntimeError, match=rf"swap file {sw.path_of('k')} of key 'k' was replaced by a symlink"):
        sw.write("k", torch.ones(1000))
    assert (victim / "k.swp").read_text() == "precious"
    sw.path_of("k").unlink()
    sw.close()
    assert sorted(p.name for p in nvme_path.iterdir()) == ["zeroq_rank00000"]
    assert (victim / "k.swp").read_text() == "precious"


def test_nvme_path_may_be_a_symlink(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "link").symlink_to(disk)  # e.g. a link to a mount point
    with NvmeSwapper(tmp_path / "link") as sw:
        sw.register("k", 10_001, torch.float32)
        sw.reserve()
        _assert_round_trip(sw, _random(10_001, torch.float32, seed=0))
        assert [p.name for p in disk.iterdir()] == [sw.directory.name]
    assert list(disk.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Cleanup without close(): garbage collection, forks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dropped", "in_a_cycle", "write_pending"])
def test_dropped_swapper_removes_its_files(tmp_path: Path, how: str) -> None:
    sw = NvmeSwapper(tmp_path, buffer_bytes=SMALL_BUFFER)
    sw.register("k", 100_000, torch.float32)
    sw.reserve()
    sw.write("k", torch.zeros(100_000))
    if how == "in_a_cycle":
        sw.myself = sw  # type: ignore[attr-defined]
    # Background work and its handle do not hold the swapper, so it dies with the caller's reference.
    handle = sw.write_async("k", torch.ones(100_000)) if how == "write_pending" else None
    directory = sw.directory
    del sw
    gc.collect()
    assert not directory.exists()
    assert list(tmp_path.iterdir()) == []
    del handle


def test_forked_child_leaves_the_parents_files_alone(tmp_path: Path) -> None:
    sw = NvmeSwapper(tmp_path)
    sw.register("k", 1000, torch.float32)
    sw.reserve()
    src = _random(1000, torch.float32, seed=0)
    sw.write("k", src)
    pid = os.fork()
    if pid == 0:  # the child: its copy of the swapper is closed (and collected) without harm
        try:
            sw.close()
            del sw
            gc.collect()
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    out = torch.empty(1000)
    sw.read("k", out)
    assert _bitwise_equal(out, src)
    sw.close()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Signals and interpreter exit
# ---------------------------------------------------------------------------------------------


def test_only_a_default_signal_action_is_replaced_and_put_back(tmp_path: Path) -> None:
    gc.collect()  # no swapper of an earlier test still alive: the default comes back with the last
    original, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    received: list[int] = []
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with NvmeSwapper(tmp_path):
            assert isinstance(signal.getsignal(signal.SIGTERM), swap_cleanup._CleanupHandler)
            assert signal.getsignal(signal.SIGINT) is sigint  # Python's: KeyboardInterrupt as ever
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

        def application_handler(signum: int, frame: object) -> None:
            received.append(signum)

        for disposition in (application_handler, signal.SIG_IGN):
            signal.signal(signal.SIGTERM, disposition)
            with NvmeSwapper(tmp_path) as sw:
                assert signal.getsignal(signal.SIGTERM) == disposition  # left alone: it decides
                sw.register("k", 1000, torch.float32)
                sw.reserve()
                signal.raise_signal(signal.SIGTERM)  # handled or ignored: the files are still needed
                _assert_round_trip(sw, _random(1000, torch.float32, seed=0))
        assert received == [signal.SIGTERM]
        assert list(tmp_path.iterdir()) == []
    finally:
        signal.signal(signal.SIGTERM, original)


def test_a_handler_that_calls_ours_decides(tmp_path: Path) -> None:
    """Lightning's trainer installs its SIGTERM handler after the strategy made the swappers and
    calls the one it found too; it stops training gracefully, so ours must neither remove nor kill."""
    gc.collect()
    original = signal.getsignal(signal.SIGTERM)
    received: list[int] = []
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sw = NvmeSwapper(tmp_path)
        sw.register("k", 1000, torch.float32)
        sw.reserve()
        ours = signal.getsignal(signal.SIGTERM)
        assert callable(ours)

        def composed(signum: int, frame: object) -> None:  # like lightning's _HandlersCompose
            received.append(signum)
            ours(signum, frame)

        signal.signal(signal.SIGTERM, composed)
        signal.raise_signal(signal.SIGTERM)  # the process survives
        assert received == [signal.SIGTERM]
        _assert_round_trip(sw, _random(1000, torch.float32, seed=0))
        sw.close()
        assert list(tmp_path.iterdir()) == []
        assert signal.getsignal(signal.SIGTERM) is composed  # not ours to put back
    finally:
        signal.signal(signal.SIGTERM, original)


def test_swapper_outside_the_main_thread_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gc.collect()
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("SIGTERM already has a handler in this process")
    monkeypatch.setattr(swap_cleanup, "_warned_not_main_thread", False)
    swappers: list[NvmeSwapper] = []
    with caplog.at_level(logging.WARNING, logger=SWAP_LOGGER):
        for _ in range(2):
            worker = threading.Thread(target=lambda: swappers.append(NvmeSwapper(tmp_path)))
            worker.start()
            worker.join()
    messages = [r.getMessage() for r in caplog.records if "outside the main thread" in r.getMessage()]
    assert len(messages) == 1 and str(swappers[0].directory) in messages[0], caplog.text
    for sw in swappers:
        sw.close()


# A fresh interpreter that holds a swapper with data in it, reports its directory on stdout, then
# runs ``scenario``. The swap package is loaded without the package above it (and Lightning), to start fast.
_CHILD = """
import signal, sys, types
# The dispositions a process starts with, which the swapper is written for: under nohup (SIGHUP ignored) or a
# shell that ignores SIGINT the child would inherit ignored signals, and the swapper leaves those alone.
for _signum in (signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(_signum) == signal.SIG_IGN:
        signal.signal(_signum, signal.SIG_DFL)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
package = types.ModuleType("lightning_zeroq")
package.__path__ = [{package!r}]
sys.modules["lightning_zeroq"] = package
from lightning_zeroq.swap import directory, swapper
import torch
sw = swapper.NvmeSwapper({path!r}, buffer_bytes=65536)
sw.register("k", 100_000, torch.float32)
sw.reserve()
sw.write("k", torch.ones(100_000))
print(sw.directory, flush=True)
{scenario}
"""


def _start_child(tmp_path: Path, scenario: str) -> tuple["subprocess.Popen[str]", Path]:
    code = _CHILD.format(package=str(Path(lightning_zeroq.swap.__file__).parents[1]), path=str(tmp_path), scenario=scenario)
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    directory = Path(child.stdout.readline().strip())
    assert directory.parent == tmp_path and (directory / "k.swp").is_file(), child.communicate(timeout=60)
    return child, directory


def test_sigterm_removes_the_files_and_still_kills(tmp_path: Path) -> None:
    child, directory = _start_child(tmp_path, "sys.stdin.readline()")
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM, err
    assert not directory.exists() and list(tmp_path.iterdir()) == []


_SIGNAL_IN_THE_WINDOW = """
import os, signal, sys, types
package = types.ModuleType("lightning_zeroq")
package.__path__ = [{package!r}]
sys.modules["lightning_zeroq"] = package
from lightning_zeroq.swap import directory, swapper
made = directory.create_private_directory

def made_then_signalled(*args, **kwargs):  # SIGTERM lands after the mkdir, before the directory is tracked
    resources = made(*args, **kwargs)
    print(resources.directory, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    return resources

swapper.create_private_directory = made_then_signalled
swapper.NvmeSwapper({path!r}, buffer_bytes=65536)
print("survived", flush=True)
"""


def test_a_signal_between_making_the_directory_and_tracking_it_still_removes_it(tmp_path: Path) -> None:
    code = _SIGNAL_IN_THE_WINDOW.format(package=str(Path(lightning_zeroq.swap.__file__).parents[1]), path=str(tmp_path))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    directory = Path(child.stdout.splitlines()[0])
    assert directory.parent == tmp_path, child.stderr
    assert child.returncode == -signal.SIGTERM, (child.stdout, child.stderr)
    assert "survived" not in child.stdout
    assert list(tmp_path.iterdir()) == [], "the swap directory was left behind"


def test_sigint_raises_keyboard_interrupt_then_the_files_go_at_exit(tmp_path: Path) -> None:
    scenario = (
        "try:\n"
        "    print('ready', flush=True)\n"
        "    sys.stdin.readline()\n"
        "except KeyboardInterrupt:\n"
        "    print('KeyboardInterrupt; files still there:', sw.path_of('k').exists(), flush=True)\n"
        "    raise\n"
    )
    child, directory = _start_child(tmp_path, scenario)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"  # inside the try
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    # Whoever catches the KeyboardInterrupt (an on-exception checkpoint, a notebook) still has the
    # files; the uncaught exception ends the interpreter, which removes them, then dies by SIGINT.
    assert out == "KeyboardInterrupt; files still there: True\n", err
    assert child.returncode == -signal.SIGINT, err
    assert not directory.exists() and list(tmp_path.iterdir()) == []


def test_exit_without_close_removes_the_files(tmp_path: Path) -> None:
    child, directory = _start_child(tmp_path, "sw.write_async('k', torch.zeros(100_000))")
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert not directory.exists() and list(tmp_path.iterdir()) == []


def test_leftovers_of_a_killed_run_are_reported_not_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    child, directory = _start_child(tmp_path, "sys.stdin.readline()")
    child.kill()  # SIGKILL: nothing can clean up
    child.communicate(timeout=60)
    assert (directory / "k.swp").is_file()
    with caplog.at_level(logging.WARNING, logger=SWAP_LOGGER):
        with NvmeSwapper(tmp_path):
            pass
    messages = [r.getMessage() for r in caplog.records if "left behind" in r.getMessage()]
    assert messages == [
        f"NvmeSwapper: {directory} was left behind by pid {child.pid} on this host, which is gone (killed?); it is "
        "not removed automatically: delete it once you are sure no job uses it"
    ]
    assert (directory / "k.swp").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [directory.name]
    shutil.rmtree(directory)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_second_signal_during_the_clean_up_does_not_cut_it_short(tmp_path: Path, signum: int) -> None:
    # A signal sent to a process group arrives twice in a rank its parent forwards it to (``timeout``,
    # Lightning's launcher); Python may run the handler again between any two bytecodes of the first
    # run, which then died half-way and left the lock and the directory behind. The second signal
    # comes here right after the first file is unlinked.
    scenario = (
        "import os, types\n"
        "other = swapper.NvmeSwapper({path!r}, prefix='zeroq_params')\n"
        "other.register('p', 1000, torch.float32)\n"
        "other.reserve()\n"
        "real, fired = os.unlink, []\n"
        "def unlink(*args, **kwargs):\n"
        "    real(*args, **kwargs)\n"
        "    if not fired:\n"
        "        fired.append(1)\n"
        "        os.kill(os.getpid(), {signum})\n"
        "directory.os = types.SimpleNamespace(**{{k: getattr(os, k) for k in dir(os) if not k.startswith('__')}})\n"
        "directory.os.unlink = unlink\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
    ).format(path=str(tmp_path), signum=int(signum))
    child, directory = _start_child(tmp_path, scenario)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    child.send_signal(signum)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signum, err
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


def _killed_job(tmp_path: Path) -> tuple[int, list[Path]]:
    """Swap directories of two ranks and both prefixes left by a process killed with SIGKILL."""
    scenario = (
        "kept = [swapper.NvmeSwapper({path!r}, rank=r, prefix=p) for r in (0, 1) for p in ('zeroq', 'zeroq_params')]\n"
        "print(' '.join(str(s.directory) for s in kept), flush=True)\n"
        "sys.stdin.readline()\n"
    ).format(path=str(tmp_path))
    child, first = _start_child(tmp_path, scenario)
    assert child.stdout is not None
    others = [Path(p) for p in child.stdout.readline().split()]
    child.kill()
    child.communicate(timeout=60)
    return child.pid, [first, *others]


def test_rank_0_names_every_leftover_of_a_killed_job(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pid, leftovers = _killed_job(tmp_path)
    assert len(leftovers) == 5 and all(p.is_dir() for p in leftovers)
    with caplog.at_level(logging.WARNING, logger=SWAP_LOGGER):
        with NvmeSwapper(tmp_path, rank=0, prefix="zeroq_params"):
            pass
        with NvmeSwapper(tmp_path, rank=0):  # the same process names each one once
            pass
    named = sorted(r.getMessage().split()[1] for r in caplog.records if "left behind" in r.getMessage())
    assert named == sorted(map(str, leftovers)), caplog.text
    assert all(f"by pid {pid} " in r.getMessage() for r in caplog.records if "left behind" in r.getMessage())
    assert all(p.is_dir() for p in leftovers)  # reported, never removed


def test_a_launcher_removes_the_directories_of_the_ranks_it_killed_only(tmp_path: Path) -> None:
    pid, killed = _killed_job(tmp_path)
    _, other_job = _killed_job(tmp_path)
    with NvmeSwapper(tmp_path) as live:
        removed = swap_directory.remove_directories_of(tmp_path, [pid, os.getpid()])
        assert sorted(removed) == sorted(killed)
        assert live.directory.is_dir() and all(p.is_dir() for p in other_job)
    assert sorted(tmp_path.iterdir()) == sorted(other_job)


def test_ending_the_process_waits_for_a_removal_another_thread_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The watchdog ends a process (remove_live_files, then os._exit) while a signal handler removes the
    # same files, or the other way round: the second caller must not return (and let the process end)
    # before the first one's removal is done, or the directory stays behind.
    sw = NvmeSwapper(tmp_path, buffer_bytes=65536)
    sw.register("k", 1000, torch.float32)
    sw.reserve()
    directory = sw.directory
    unlink, entered, release = os.unlink, threading.Event(), threading.Event()

    def slow_unlink(*args, **kwargs):
        entered.set()
        release.wait(30)
        return unlink(*args, **kwargs)

    monkeypatch.setattr(os, "unlink", slow_unlink)
    first = threading.Thread(target=sw._resources.remove_files)
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=swap_cleanup.remove_live_files)
    second.start()
    second.join(0.5)
    assert second.is_alive(), "returned while the other thread was still removing the files"
    monkeypatch.setattr(os, "unlink", unlink)
    release.set()
    first.join(30)
    second.join(30)
    assert not directory.exists()
    sw.close()


@pytest.mark.parametrize("killed_at", ["unlink", "rmdir"])
def test_a_rank_killed_half_way_through_its_clean_up_leaves_a_directory_its_launcher_removes(
    tmp_path: Path, killed_at: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Lightning's launcher SIGKILLs the ranks it started while they clean up after the same Ctrl-C.
    # Killed after unlinking the lock and before removing the directory, a rank left an unlocked, empty
    # directory that nothing could prove to be its own, so the launcher left it (a CI run saw it).
    # ``unlink``: killed before the first file goes (the lock still names it); ``rmdir``: after the lock.
    scenario = (
        "import os, signal, types\n"
        "def die(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "directory.os = types.SimpleNamespace(**{{k: getattr(os, k) for k in dir(os) if not k.startswith('__')}})\n"
        "directory.os.{killed_at} = die\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
    ).format(killed_at=killed_at)
    child, directory = _start_child(tmp_path, scenario)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err
    (left,) = list(tmp_path.iterdir())
    assert left.name == swap_directory.claimed_name(directory.name, child.pid)
    assert (left / ".lock").exists() == (killed_at == "unlink")
    with caplog.at_level(logging.WARNING, logger=SWAP_LOGGER):
        with NvmeSwapper(tmp_path):  # a new swapper of the same rank names the leftover
            pass
    assert f"{left} was left behind by pid {child.pid} " in caplog.text
    assert swap_directory.remove_directories_of(tmp_path, [child.pid + 1]) == []  # not the killed pid: kept
    assert swap_directory.remove_directories_of(tmp_path, [child.pid]) == [left]
    assert list(tmp_path.iterdir()) == []


def test_pinned_empty_without_pinning_is_a_plain_tensor_of_its_size_and_rejects_a_negative_size():
    from lightning_zeroq.swap.buffers import pinned_empty

    t = pinned_empty(3 << 20, torch.bfloat16, pin=False)
    assert t.shape == (3 << 20,) and t.dtype == torch.bfloat16 and not t.is_pinned()
    with pytest.raises(ValueError, match="numel=-1"):
        pinned_empty(-1, torch.float32, pin=False)
