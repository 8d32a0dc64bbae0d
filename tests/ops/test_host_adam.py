"""The host Adam/AdamW kernel (csrc/host_adam.c) against torch's fused CPU kernel: bitwise, on random
data of every size class (torch's vector body and its scalar tail), every mode, and what the kernel adds
(bf16 gradients, the multiplier, the bf16 working copy, outputs out of place)."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_zeroq.ops import host_adam as H
from tests.host_kernel import require

@pytest.fixture(scope="module")
def kernel() -> H.HostAdam:
    return require()


def _data(n: int, seed: int) -> list[torch.Tensor]:
    return H._sample(n, torch.Generator().manual_seed(seed))


SIZES = (1, 3, 7, 8, 15, 16, 17, 31, 33, 100_003, 1 << 20)
MODES = [dict(decoupled=d, weight_decay=wd, beta1=b1, maximize=mx)
         for d, wd, b1, mx in itertools.product([True, False], [0.0, 0.01], [0.9, 0.2], [False, True])]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_bitwise_as_torch_fused(kernel: H.HostAdam, mode: dict) -> None:
    for n, step in zip(SIZES, itertools.cycle([1.0, 2.0, 10.0])):
        p, g, m, v = _data(n, n)
        hyper = dict(mode, step=step, lr=3e-4, beta2=0.95, eps=1e-6)
        ref = [t.clone() for t in (p, g, m, v)]
        H._fused(*ref, **hyper)
        ours = [t.clone() for t in (p, m, v)]
        kernel.step(ours[0], g.clone(), ours[1], ours[2], **hyper)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, (ref[0], ref[2], ref[3])):
            assert torch.equal(a, b), f"n={n} {name}: {(a != b).sum().item()} elements differ"


def test_bf16_gradients_multiplier_working_copy_and_outputs(kernel: H.HostAdam) -> None:
    """What torch would do after ``grad.float().mul_(gmul)``, the working copy as ``param.bfloat16()``;
    out of place, the same values in the outputs and the inputs untouched."""
    for n in (5, 17, 4099, 1 << 18):
        p, g, m, v = _data(n, 7 * n)
        gh = g.bfloat16()
        hyper = dict(step=3.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
        ref = [p.clone(), gh.float().mul_(0.3125), m.clone(), v.clone()]
        H._fused(*ref, maximize=False, **hyper)
        ours = [t.clone() for t in (p, m, v)]
        working = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        kernel.step(ours[0], gh, ours[1], ours[2], gmul=0.3125, working=working, **hyper)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[2]) and torch.equal(ours[2], ref[3])
        assert torch.equal(working, ref[0].bfloat16())
        inputs = [t.clone() for t in (p, m, v)]
        outs = [torch.full((n,), float("nan")) for _ in range(3)]
        working.fill_(float("nan"))
        kernel.step(inputs[0], gh, inputs[1], inputs[2], gmul=0.3125, working=working, out=outs, **hyper)
        assert all(torch.equal(o, r) for o, r in zip(outs, (ref[0], ref[2], ref[3])))
        assert all(torch.equal(i, t) for i, t in zip(inputs, (p, m, v)))
        assert torch.equal(working, ref[0].bfloat16())


def test_overlapping_outputs_are_refused(kernel: H.HostAdam) -> None:
    p, g, m, v = _data(64, 1)
    hyper = dict(step=1.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    spare = torch.empty(2 * 64)
    with pytest.raises(ValueError, match="must not overlap"):
        kernel.step(p, g, m, v, out=[spare[:64], spare[32:96], torch.empty(64)], **hyper)
    with pytest.raises(ValueError, match="must not overlap"):
        kernel.step(p, g, m, v, out=[p, torch.empty(64), torch.empty(64)], **hyper)


def test_many_threads_same_bits(kernel: H.HostAdam) -> None:
    p, g, m, v = _data(3_000_017, 3)
    hyper = dict(step=2.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                 maximize=False)
    one = [t.clone() for t in (p, m, v)]
    kernel.step(one[0], g, one[1], one[2], threads=1, **hyper)
    many = [t.clone() for t in (p, m, v)]
    kernel.step(many[0], g, many[1], many[2], threads=7, **hyper)
    assert all(torch.equal(a, b) for a, b in zip(one, many))


def test_bad_tensors_are_refused(kernel: H.HostAdam) -> None:
    p, g, m, v = _data(64, 0)
    hyper = dict(step=1.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(ValueError, match="contiguous CPU tensors of one size"):
        kernel.step(p, g[:32], m, v, **hyper)
    with pytest.raises(ValueError, match="float32"):
        kernel.step(p.double(), g, m, v, **hyper)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.step(p, torch.randn(128)[::2], m, v, **hyper)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROQ_HOST_KERNEL", "0")
    kernel, reason = H._load()
    assert kernel is None and reason == "ZEROQ_HOST_KERNEL=0"


def test_one_run_of_many_jobs_as_each_alone(kernel: H.HostAdam) -> None:
    """``run`` of several tensors (one wake-up of the pool, as a unit's segments step) gives each tensor
    the bits it gets stepped alone, tails included."""
    sizes = (5, 40_000, 17, 300_001, 1)
    data = [_data(n, 11 * n) for n in sizes]
    hyper = dict(step=4.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
    alone = [[t.clone() for t in (p, m, v)] for p, _, m, v in data]
    for (_, g, _, _), (p, m, v) in zip(data, alone):
        kernel.step(p, g, m, v, threads=3, **hyper)
    together = [[t.clone() for t in (p, m, v)] for p, _, m, v in data]
    kernel.run([kernel.job(p, g, m, v, **hyper) for (_, g, _, _), (p, m, v) in zip(data, together)], threads=3)
    assert all(torch.equal(a, b) for x, y in zip(alone, together) for a, b in zip(x, y))


@pytest.mark.parametrize("chunk", [0, 16, 48, 1 << 12])
def test_every_split_of_the_work_gives_the_same_bits(kernel: H.HostAdam, chunk: int) -> None:
    """Fixed parts (0) or chunks taken one after another, small enough that every thread takes many
    and a chunk straddles no job: torch's bits in every element of every job (bodies and tails; a job
    of bf16 gradients with a working copy and one out of place among them)."""
    sizes = (5, 40_000, 17, 300_001, 1, 4096, 65_537)
    data = [_data(n, 13 * n) for n in sizes]
    hyper = dict(step=3.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                 maximize=False)
    refs = []
    for i, (p, g, m, v) in enumerate(data):
        ref = [t.clone() for t in (p, g.bfloat16().float() if i == 1 else g, m, v)]
        H._fused(*ref, **hyper)
        refs.append(ref)
    ours = [[t.clone() for t in (p, m, v)] for p, _, m, v in data]
    working = torch.empty(sizes[1], dtype=torch.bfloat16)
    half = data[1][1].bfloat16()  # held: a job keeps pointers, not tensors
    outs = [torch.empty(sizes[3]) for _ in range(3)]
    jobs = [kernel.job(p, half if i == 1 else g, m, v, working=working if i == 1 else None,
                       out=outs if i == 3 else None, **hyper)
            for i, ((_, g, _, _), (p, m, v)) in enumerate(zip(data, ours))]
    try:
        kernel.set_chunk(chunk)
        kernel.run(jobs, threads=3)
    finally:
        kernel.set_chunk(1 << 18)
    ours[3] = outs
    for i, (got, ref) in enumerate(zip(ours, refs)):
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, (ref[0], ref[2], ref[3])):
            assert torch.equal(a, b), f"chunk={chunk} job {i} (n={sizes[i]}) {name}: {(a != b).sum().item()} differ"
    assert torch.equal(working, refs[1][0].bfloat16())


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("offset", [0, 1, 7, 31])
@pytest.mark.parametrize("chunk", [48, 1 << 18])
def test_the_bf16_copy_is_the_cast_wherever_it_starts(kernel: H.HostAdam, stream: bool, offset: int,
                                                      chunk: int) -> None:
    """The bf16 copy, streamed past the caches or stored plainly, from any alignment of its first
    element and cut into chunks that start anywhere in a cache line: the cast of torch's updated
    parameter, element for element, in place and out of place; the fp32 results torch's bits."""
    sizes = (40_000, 300_001, 70)
    hyper = dict(step=2.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                 maximize=False)
    data = [_data(n, 17 * n + offset) for n in sizes]
    halves = [g.bfloat16() for _, g, _, _ in data]
    refs = []
    for (p, _, m, v), half in zip(data, halves):
        ref = [t.clone() for t in (p, half.float(), m, v)]
        H._fused(*ref, **hyper)
        refs.append(ref)
    ours = [[t.clone() for t in (p, m, v)] for p, _, m, v in data]
    workings = [torch.full((n + offset,), -1.0, dtype=torch.bfloat16)[offset:] for n in sizes]
    outs = [torch.empty(sizes[1]) for _ in range(3)]
    jobs = [kernel.job(p, half, m, v, working=working, out=outs if i == 1 else None, **hyper)
            for i, ((p, m, v), half, working) in enumerate(zip(ours, halves, workings))]
    try:
        kernel.set_chunk(chunk)
        kernel.set_stream_half(stream)
        kernel.run(jobs, threads=3)
    finally:
        kernel.set_chunk(1 << 18)
        kernel.set_stream_half(True)
    ours[1] = outs
    for i, (got, ref, working) in enumerate(zip(ours, refs, workings)):
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, (ref[0], ref[2], ref[3])):
            assert torch.equal(a, b), f"job {i} {name}: {(a != b).sum().item()} differ"
        assert torch.equal(working, ref[0].bfloat16()), f"job {i}: {(working != ref[0].bfloat16()).sum()} differ"


def test_bad_stream_settings_are_refused(kernel: H.HostAdam) -> None:
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="set_stream_half"):
            kernel.set_stream_half(bad)


def test_bad_chunks_are_refused(kernel: H.HostAdam) -> None:
    for bad in (-16, 17, 2.0, True):
        with pytest.raises(ValueError, match="set_chunk"):
            kernel.set_chunk(bad)


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
def test_triad_is_streams_triad(kernel: H.HostAdam, streaming: bool, threads: int) -> None:
    """The bandwidth probe computes a = b + s * c over every element (odd sizes and offsets too)."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 37, 100_003):
        b, c = torch.randn(n + 1, generator=g)[1:], torch.randn(n, generator=g)  # b starts off its alignment
        a = torch.full((n,), float("nan"))
        kernel.triad(a, b, c, 3.0, threads, streaming)
        assert torch.equal(a, b + 3.0 * c)
    with pytest.raises(ValueError, match="three contiguous float32"):
        kernel.triad(torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(4), 1.0, 1)
