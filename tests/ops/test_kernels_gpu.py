"""The compiled CUDA kernels against the reference: bitwise equal codes, scales and decodes.

Run on a CUDA machine (builds or loads the kernels on first use):
    python -m pytest tests/ops/test_kernels_gpu.py -q -m gpu -rs
With ``ZEROQ_DISABLE_EXT=1`` these tests are skipped; if the kernels fail to build they fail.
"""

from __future__ import annotations

import os

import pytest
import torch

import lightning_zeroq.ops as ops
from lightning_zeroq.ops import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUM_GROUPS = [0, 1, 3, 1000, 12345]
# Every team size of the kernels (1..32 lanes), with one and with several chunks per lane.
GROUP_SIZES = [8, 16, 24, 32, 64, 128, 192, 256, 512, 8192]


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    if os.environ.get("ZEROQ_DISABLE_EXT") == "1":
        pytest.skip("ZEROQ_DISABLE_EXT=1: the compiled kernels are disabled")
    backend = ops.load_cuda_backend()
    if not ops.has_cuda_kernel():
        pytest.fail(f"the CUDA kernels did not load (backend {backend.value}); see the log warning")
    print(f"zeroq CUDA backend: {backend.value}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.cpu(), expected.cpu()
    if actual.is_floating_point():
        actual, expected = _bits(actual), _bits(expected)
    mismatches = (actual != expected).nonzero()
    first = mismatches[:5].flatten().tolist()
    assert mismatches.numel() == 0, f"{mismatches.numel()} mismatches, first at {first}"


def _quantize(x: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' codes and scales: views of the packed buffer [codes | scales]."""
    packed = ops.quantize_pack_int8(x, group_size=group_size)
    n = x.numel()
    return packed[:n].view(torch.int8), packed[n:].view(torch.float32)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, group_size: int = 64) -> torch.Tensor:
    packed = torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)])
    return ops.unpack_dequantize_int8(packed, dtype=dtype, group_size=group_size)


def _data(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Finite values of mixed magnitudes, rare outliers and a leading zero group, on the CPU.

    Bounded so that float16 stays finite (non-finite input is _poisoned's business).
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    if numel:
        x = x * 10.0 ** torch.randint(-4, 2, (numel,), generator=gen).float()
        x[torch.rand(numel, generator=gen) < 0.001] *= 1000.0
        x[: min(numel, 64)] = 0.0
    x = x.to(dtype)
    assert x.isfinite().all()
    return x


def _ties(dtype: torch.dtype) -> torch.Tensor:
    group = torch.zeros(64)
    group[0] = 127.0  # scale 1: every k + 0.5 below is an exact tie
    group[1:11] = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 125.5, 126.5, -126.5])
    half = torch.zeros(64)
    half[0] = 63.5  # scale 0.5
    half[1:5] = torch.tensor([0.25, 0.75, -0.25, -0.75])
    return torch.cat([group, half]).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_groups", NUM_GROUPS)
def test_quantize_matches_reference(dtype, num_groups):
    x = _data(num_groups * 64, dtype, seed=num_groups)
    codes, scales = _quantize(x.cuda())
    ref_codes, ref_scales = reference.quantize_int8(x, 64)
    _assert_bitwise(codes, ref_codes)
    _assert_bitwise(scales, ref_scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_every_group_size_matches_reference(dtype, group_size):
    x = _data(group_size * 37, dtype, seed=group_size)
    codes, scales = _quantize(x.cuda(), group_size)
    ref_codes, ref_scales = reference.quantize_int8(x, group_size)
    _assert_bitwise(codes, ref_codes)
    _assert_bitwise(scales, ref_scales)
    for out_dtype in DTYPES:
        decoded = _dequantize(codes, scales, out_dtype, group_size)
        _assert_bitwise(decoded, reference.dequantize_int8(ref_codes, ref_scales, group_size, out_dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_clamp_and_subnormal_scales(dtype):
    x = _ties(dtype)
    if dtype == torch.float32:
        tiny = 2.0**-149
        extra = torch.tensor([256.0, -256.0, 255.0, 2.0, 0, 0, 0, 0, 3.0, -1.0, 0, 0, 0, 0, 0, 0]) * tiny
        x = torch.cat([x, extra, torch.zeros(48)])
    codes, scales = _quantize(x.cuda())
    ref_codes, ref_scales = reference.quantize_int8(x, 64)
    _assert_bitwise(codes, ref_codes)
    _assert_bitwise(scales, ref_scales)
    codes8, scales8 = _quantize(x.cuda(), 8)
    _assert_bitwise(codes8, reference.quantize_int8(x, 8)[0])
    _assert_bitwise(scales8, reference.quantize_int8(x, 8)[1])


def _near_ties(num_groups: int, seed: int) -> torch.Tensor:
    """float32 groups whose values sit within a few ulps of (k + 0.5) * scale.

    The kernels multiply by the reciprocal of the scale and fall back to the exact division only
    near a half-integer; these are the values where the two could round differently.
    """
    gen = torch.Generator().manual_seed(seed)
    absmax = torch.rand(num_groups, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -30, 30, (num_groups,), generator=gen
    ).double()
    absmax = absmax.float()
    scale = (absmax / torch.tensor(127.0)).double()
    k = torch.randint(-127, 127, (num_groups, 63), generator=gen).double()
    x = ((k + 0.5) * scale[:, None]).float()
    ulps = torch.randint(-3, 4, (num_groups, 63), generator=gen)
    for _ in range(3):  # walk up to 3 ulps either way
        up, down = ulps > 0, ulps < 0
        x = torch.where(up, torch.nextafter(x, torch.tensor(float("inf"))), x)
        x = torch.where(down, torch.nextafter(x, torch.tensor(float("-inf"))), x)
        ulps = ulps - up.int() + down.int()
    x = torch.minimum(torch.maximum(x, -absmax[:, None]), absmax[:, None])
    return torch.cat([absmax[:, None], x], dim=1).flatten()


def test_near_ties_match_the_exact_division():
    x = _near_ties(4096, seed=3)
    codes, scales = _quantize(x.cuda())
    ref_codes, ref_scales = reference.quantize_int8(x, 64)
    _assert_bitwise(scales, ref_scales)
    _assert_bitwise(codes, ref_codes)
    # the test must reach the cases it is for: quotients within 2^-14 of a half-integer
    q = x.view(-1, 64) / torch.where(ref_scales == 0, 1.0, ref_scales)[:, None]
    assert ((q - q.floor() - 0.5).abs() < 2.0**-14).sum() > 10000


# Largest positive finite bit pattern of each 16-bit format.
_TOP_BITS = {torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF}


def _every_pair(dtype: torch.dtype, a_lo: int, a_hi: int) -> torch.Tensor:
    """On CUDA: groups of 64 holding, for every absmax bit pattern a in [a_lo, a_hi) of the format,
    a itself (the group's absmax) and every x with |x| <= a (bit patterns 0..a and their negatives,
    63 per group, zero padded): every (x, scale) pair a 16-bit group can hold."""
    a = torch.arange(a_lo, a_hi, device="cuda", dtype=torch.int64)
    values = 2 * (a + 1)
    groups_per_a = (values + 62) // 63
    owner = torch.repeat_interleave(torch.arange(a.numel(), device="cuda"), groups_per_a)
    first_group = torch.cumsum(groups_per_a, 0) - groups_per_a
    k = torch.arange(owner.numel(), device="cuda") - first_group[owner]  # group index within its a
    t = k[:, None] * 63 + torch.arange(63, device="cuda")  # value index within its a
    a_g = a[owner][:, None]
    bits = torch.where(t <= a_g, t, torch.where(t < 2 * (a_g + 1), 0x8000 | (t - a_g - 1), 0))
    bits = torch.cat([a[owner][:, None], bits], dim=1)
    return bits.to(torch.int32).to(torch.int16).view(dtype).flatten()  # 0x8000.. wraps to negative int16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pair_matches_reference(dtype):
    """Every x of bfloat16 / float16 against every absmax >= |x| of the same format (1.1e9 elements
    each, about a second): the kernels' codes and scales against the reference on CUDA and against
    float64 arithmetic (one correct rounding to float32: an independent model). Covers the exact
    ties that 16-bit data has often, bfloat16's subnormal scales (below the kernels' threshold for
    the branch-free quotient: exact division there), and tiny quotients."""
    top, step = _TOP_BITS[dtype], 2048
    checked = 0
    for a_lo in range(1, top + 1, step):
        x = _every_pair(dtype, a_lo, min(a_lo + step, top + 1))
        if a_lo == 1:
            x = torch.cat([torch.zeros(64, dtype=dtype, device="cuda"), x])  # an all-zero group
        codes, scales = _quantize(x)
        ref_codes, ref_scales = reference.quantize_int8(x, 64)
        assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))
        mismatch = (codes != ref_codes).nonzero().flatten()
        assert mismatch.numel() == 0, (
            f"{mismatch.numel()} codes differ from the reference, first x = "
            f"{x[mismatch[:5]].tolist()} in groups with absmax {x[mismatch[:5] // 64 * 64].tolist()}"
        )
        groups = x.double().view(-1, 64)
        model_scales = (groups.abs().amax(dim=1) / 127).float()
        assert torch.equal(scales.view(torch.int32), model_scales.view(torch.int32))
        divisors = torch.where(model_scales == 0, 1.0, model_scales.double())
        quotients = (groups / divisors[:, None]).float()  # exact quotient, rounded once
        model_codes = quotients.round().clamp(-127, 127).to(torch.int8).flatten()  # half to even
        assert torch.equal(codes, model_codes)
        checked += x.numel()
        del x, codes, scales, ref_codes, ref_scales, groups, divisors, quotients, model_codes
    assert checked > 1_000_000_000
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_groups", NUM_GROUPS)
def test_pack_and_unpack_match_reference(dtype, num_groups):
    x = _data(num_groups * 64, dtype, seed=7 + num_groups)
    packed = ops.quantize_pack_int8(x.cuda())
    ref_packed = torch.empty(ops.packed_nbytes(x.numel()), dtype=torch.uint8)
    reference.quantize_pack_int8(x, 64, ref_packed)
    _assert_bitwise(packed, ref_packed)
    for out_dtype in DTYPES:
        out = torch.full((x.numel(),), float("nan"), dtype=out_dtype, device="cuda")
        ops.unpack_dequantize_int8(packed, out)
        ref_out = torch.empty(x.numel(), dtype=out_dtype)
        reference.unpack_dequantize_int8(ref_packed, 64, ref_out)
        _assert_bitwise(out, ref_out)


def _assert_same_decode(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """NaN exactly where the reference has NaN, and the same bits everywhere else.

    A NaN's sign and payload are not part of the format (GPU arithmetic makes 0x7fffffff where
    x86 keeps the operand's NaN), so only NaN positions are compared there.
    """
    actual, expected = actual.cpu(), expected.cpu()
    nan = expected.isnan()
    mismatched = (actual.isnan() != nan).nonzero().flatten()
    assert mismatched.numel() == 0, f"NaN at other positions, first {mismatched[:5].tolist()}"
    _assert_bitwise(actual[~nan], expected[~nan])


def _poisoned(numel: int, group_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """_data with non-finite values planted: one NaN, -NaN, +inf or -inf in about one group in
    three (at a random position), one all-NaN group and one group mixing them; other groups finite."""
    x = _data(numel, torch.float32, seed).view(-1, group_size)
    gen = torch.Generator().manual_seed(seed + 1)
    num_groups = x.shape[0]
    bad = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    for g in range(0, num_groups, 3):
        x[g, torch.randint(group_size, (1,), generator=gen)] = bad[g % 4]
    if num_groups > 4:
        x[1] = float("nan")
        x[4, :4] = bad
    return x.flatten().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_non_finite_groups_match_reference(dtype, group_size):
    """Every kernel path (one chunk per lane, several, every team size) propagates NaN and inf as
    the reference does: scale NaN (0x7fc00000), codes 0, the whole group decodes to NaN."""
    x = _poisoned(group_size * 37, group_size, dtype, seed=group_size)
    packed = ops.quantize_pack_int8(x.cuda(), group_size=group_size)
    ref_packed = torch.empty(ops.packed_nbytes(x.numel(), group_size), dtype=torch.uint8)
    reference.quantize_pack_int8(x, group_size, ref_packed)
    _assert_bitwise(packed, ref_packed)
    n = x.numel()
    non_finite = ~x.float().view(-1, group_size).isfinite().all(dim=1)
    assert non_finite.sum() >= 13  # the test reaches what it is for
    assert (ref_packed[n:].view(torch.int32)[non_finite] == 0x7FC00000).all()
    for out_dtype in DTYPES:
        out = torch.zeros(n, dtype=out_dtype, device="cuda")
        ops.unpack_dequantize_int8(packed, out, group_size=group_size)
        ref_out = torch.empty(n, dtype=out_dtype)
        reference.unpack_dequantize_int8(ref_packed, group_size, ref_out)
        assert torch.equal(ref_out.view(-1, group_size).isnan().all(dim=1), non_finite)
        _assert_same_decode(out, ref_out)


@pytest.mark.parametrize("offset", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_groups_on_the_unaligned_path(offset, dtype):
    n = 64 * 301
    x = _poisoned(n, 64, dtype, seed=offset)
    x_buf = torch.zeros(n + 8, dtype=dtype, device="cuda")
    x_cuda = x_buf[offset : offset + n]
    x_cuda.copy_(x)
    nbytes = ops.packed_nbytes(n)
    packed = torch.zeros(nbytes + 8, dtype=torch.uint8, device="cuda")[offset : offset + nbytes]
    ops.quantize_pack_int8(x_cuda, packed)
    ref_packed = torch.empty(nbytes, dtype=torch.uint8)
    reference.quantize_pack_int8(x, 64, ref_packed)
    _assert_bitwise(packed, ref_packed)
    for out_dtype in DTYPES:
        out = torch.zeros(n + 8, dtype=out_dtype, device="cuda")[offset : offset + n]
        ops.unpack_dequantize_int8(packed, out)
        ref_out = torch.empty(n, dtype=out_dtype)
        reference.unpack_dequantize_int8(ref_packed, 64, ref_out)
        _assert_same_decode(out, ref_out)


def test_reference_on_cuda_propagates_non_finite_like_on_cpu():
    x = _poisoned(64 * 100, 64, torch.bfloat16, seed=9)
    codes, scales = reference.quantize_int8(x.cuda(), 64)
    ref_codes, ref_scales = reference.quantize_int8(x, 64)
    _assert_bitwise(codes, ref_codes)
    _assert_bitwise(scales, ref_scales)


@pytest.mark.parametrize("offset", [1, 2, 4, 8])
def test_unaligned_buffers_take_the_fallback_kernels(offset):
    """Slices at odd offsets (input, packed buffer, output) give the same bits as aligned ones."""
    n = 64 * 1001
    x = _data(n, torch.bfloat16, seed=offset)
    x_buf = torch.zeros(n + 8, dtype=torch.bfloat16, device="cuda")
    x_cuda = x_buf[offset % 8 : offset % 8 + n]
    x_cuda.copy_(x)
    nbytes = ops.packed_nbytes(n)
    packed_buf = torch.zeros(nbytes + 8, dtype=torch.uint8, device="cuda")
    packed = packed_buf[offset : offset + nbytes]
    ops.quantize_pack_int8(x_cuda, packed)
    ref_packed = torch.empty(nbytes, dtype=torch.uint8)
    reference.quantize_pack_int8(x, 64, ref_packed)
    _assert_bitwise(packed, ref_packed)
    for out_dtype in DTYPES:
        out_buf = torch.zeros(n + 8, dtype=out_dtype, device="cuda")
        out = out_buf[offset % 8 : offset % 8 + n]
        ops.unpack_dequantize_int8(packed, out)
        ref_out = torch.empty(n, dtype=out_dtype)
        reference.unpack_dequantize_int8(ref_packed, 64, ref_out)
        _assert_bitwise(out, ref_out)


def test_gathered_buffer_slices_decode_per_rank():
    """World size 3, odd group count per rank: rank slices are only 4-byte aligned."""
    shards = [_data(64 * 333, torch.bfloat16, seed=r).cuda() for r in range(3)]
    nbytes = ops.packed_nbytes(shards[0].numel())
    gathered = torch.empty(3 * nbytes, dtype=torch.uint8, device="cuda")
    for r, shard in enumerate(shards):
        ops.quantize_pack_int8(shard, gathered[r * nbytes : (r + 1) * nbytes])
    full = torch.empty(3 * shards[0].numel(), dtype=torch.bfloat16, device="cuda")
    for r, part in enumerate(full.chunk(3)):
        ops.unpack_dequantize_int8(gathered[r * nbytes : (r + 1) * nbytes], part)
    expected = torch.cat(
        [reference.dequantize_int8(*reference.quantize_int8(s.cpu(), 64), 64, torch.bfloat16) for s in shards]
    )
    _assert_bitwise(full, expected)


def test_reference_on_cuda_matches_reference_on_cpu():
    """The CUDA fallback (the reference run on CUDA tensors) gives the CPU reference's bits."""
    x = _data(64 * 1000, torch.bfloat16, seed=3)
    codes, scales = reference.quantize_int8(x.cuda(), 64)
    ref_codes, ref_scales = reference.quantize_int8(x, 64)
    _assert_bitwise(codes, ref_codes)
    _assert_bitwise(scales, ref_scales)


def test_runs_on_the_current_stream_and_device():
    x = _data(64 * 4096, torch.float16, seed=11).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        packed = ops.quantize_pack_int8(x)
        out = ops.unpack_dequantize_int8(packed, dtype=torch.float16)
    stream.synchronize()
    expected = reference.dequantize_int8(*reference.quantize_int8(x.cpu(), 64), 64, torch.float16)
    _assert_bitwise(out, expected)


def test_errors_on_cuda_are_value_errors():
    x = torch.zeros(100, device="cuda")
    packed = torch.empty(136, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="not a multiple of group_size 64"):
        torch.ops.zeroq.quantize_pack_int8(x, 64, packed)
    with pytest.raises(ValueError, match="got 12"):
        torch.ops.zeroq.quantize_pack_int8(torch.zeros(96, device="cuda"), 12, packed)
    with pytest.raises(ValueError, match="decodes to 128 elements, but out has 100"):
        torch.ops.zeroq.unpack_dequantize_int8(packed, 64, x)
    with pytest.raises(ValueError, match="136"):
        torch.ops.zeroq.quantize_pack_int8(
            torch.zeros(128, device="cuda"), 64, torch.empty(135, dtype=torch.uint8, device="cuda")
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_groups", [0, 3, 1000])
def test_opcheck_on_cuda(dtype, num_groups):
    x = _data(num_groups * 64, dtype, seed=5).cuda()
    packed = ops.quantize_pack_int8(x)
    cases = [
        (torch.ops.zeroq.quantize_pack_int8.default, (x, 64, torch.empty_like(packed))),
        (torch.ops.zeroq.unpack_dequantize_int8.default, (packed, 64, torch.empty_like(x))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
