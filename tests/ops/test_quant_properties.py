"""Property-based tests of the INT8 format: the reference and the CPU ops against the independent
float64 model (``tests/ops/quant_model.py``), on shards built to reach the edge cases that
hand-picked examples miss: exact ties, all-zero groups, subnormal scales, NaN and inf, raw bit
patterns, every group size from 8 to 256, one to four groups, all three dtypes.

Hypothesis chooses the structure (dtype, group size, the kind of every group, magnitudes, tie
parameters, which values are non-finite) and a seed for the bulk of the values, so that an example
costs little and a failure still shrinks to a small shard. Bounded and derandomized: a few seconds,
the same examples on every run.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_zeroq.ops as ops
from lightning_zeroq.ops import reference
from tests.ops import quant_model as model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUP_SIZES = list(range(8, 257, 8))
KINDS = ["spread", "bits", "zeros", "tiny", "ties", "non-finite"]
SPECIALS = [float("nan"), -float("nan"), float("inf"), -float("inf")]
NO_CODE = 999  # expected_codes where the example does not predict a code by hand

# (lowest, highest) exponent e of 2^e that keeps values of a group finite in the dtype, with the
# lowest reaching subnormal inputs.
EXPONENTS = {torch.float32: (-149, 126), torch.bfloat16: (-133, 126), torch.float16: (-24, 15)}
# An absmax this small or smaller makes absmax / 127 a float32 subnormal (or zero); float16 has no
# such values, there "tiny" means subnormal inputs.
TINY_EXPONENTS = {torch.float32: (-149, -120), torch.bfloat16: (-133, -120), torch.float16: (-24, -16)}
# Exact ties: scale m * 2^e, absmax 127 * m * 2^e, values (2k + 1) * m * 2^(e - 1). The odd factor
# m and the range of e keep all of them exactly representable in the dtype (255 * m fits its
# significand; the smallest value is a multiple of its smallest subnormal).
TIE_FACTORS = {torch.float32: [1, 3, 5, 77, 4095, 65535], torch.bfloat16: [1], torch.float16: [1, 3, 5, 7]}
TIE_EXPONENTS = {torch.float32: (-148, 100), torch.bfloat16: (-132, 100), torch.float16: (-23, 6)}

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)


class Shard(NamedTuple):
    x: torch.Tensor  # 1-D, dtype, whole groups
    group_size: int
    kinds: list[str]
    expected_codes: torch.Tensor  # int16, NO_CODE where not predicted by hand


def _spread(gen: torch.Generator, group_size: int, exponent: int) -> torch.Tensor:
    return (torch.rand(group_size, generator=gen, dtype=torch.float64) * 2 - 1) * 2.0**exponent


def _even_neighbour(k: int) -> int:
    """round-half-to-even of k + 0.5."""
    return k if k % 2 == 0 else k + 1


@st.composite
def shards(draw) -> Shard:
    dtype = draw(st.sampled_from(DTYPES))
    group_size = draw(st.sampled_from(GROUP_SIZES))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    groups, expected = [], []
    for kind in kinds:
        codes = torch.full((group_size,), NO_CODE, dtype=torch.int16)
        if kind == "spread":
            values = _spread(gen, group_size, draw(st.integers(*EXPONENTS[dtype])))
        elif kind == "bits":
            if dtype == torch.float32:
                bits = torch.randint(-(2**31), 2**31, (group_size,), generator=gen).to(torch.int32)
            else:
                bits = torch.randint(-(2**15), 2**15, (group_size,), generator=gen).to(torch.int16)
            values = bits.view(dtype).double()
        elif kind == "zeros":
            values = torch.where(torch.rand(group_size, generator=gen) < 0.5, 0.0, -0.0).double()
            codes.zero_()
        elif kind == "tiny":
            values = _spread(gen, group_size, draw(st.integers(*TINY_EXPONENTS[dtype])))
        elif kind == "ties":
            m = draw(st.sampled_from(TIE_FACTORS[dtype]))
            e = draw(st.integers(*TIE_EXPONENTS[dtype]))
            ks = torch.randint(-127, 127, (group_size,), generator=gen)  # k + 0.5 in [-126.5, 126.5]
            chosen = draw(st.lists(st.sampled_from([-127, -1, 0, 126]) | st.integers(-127, 126), max_size=4))
            ks[: len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
            values = (2 * ks + 1).double() * m * 2.0 ** (e - 1)
            codes = torch.tensor([_even_neighbour(k) for k in ks.tolist()], dtype=torch.int16)
            top = draw(st.integers(0, group_size - 1))
            sign = draw(st.sampled_from([1.0, -1.0]))
            values[top] = sign * 127 * m * 2.0**e  # the absmax: scale = m * 2^e exactly
            codes[top] = int(sign * 127)
            assert torch.equal(values.to(dtype).double(), values), "tie values must be exact in dtype"
        else:  # non-finite: a spread group with 1..G of its values replaced by NaN / inf
            values = _spread(gen, group_size, draw(st.integers(*EXPONENTS[dtype])))
            count = draw(st.integers(1, group_size))
            specials = draw(st.lists(st.sampled_from(SPECIALS), min_size=1, max_size=3))
            where = torch.randperm(group_size, generator=gen)[:count]
            values[where] = torch.tensor(specials, dtype=torch.float64).repeat(count)[:count]
            codes.zero_()
        if kind != "non-finite":
            values = values.to(dtype).double()
            values = torch.where(values.isfinite(), values, 0.0)  # bit patterns may hold inf / NaN
        groups.append(values)
        expected.append(codes)
    x = torch.cat(groups).to(dtype)
    return Shard(x, group_size, kinds, torch.cat(expected))


@SETTINGS
@given(shard=shards())
def test_quantize_matches_the_model_and_hand_worked_codes(shard):
    x, group_size = shard.x, shard.group_size
    codes, scales = reference.quantize_int8(x, group_size)
    model.assert_quantizes_to(codes, scales, x, group_size)
    predicted = shard.expected_codes != NO_CODE
    assert torch.equal(codes.to(torch.int16)[predicted], shard.expected_codes[predicted])
    non_finite = ~x.double().view(-1, group_size).isfinite().all(dim=1)
    assert (scales.view(torch.int32)[non_finite] == model.NAN_SCALE_BITS).all()
    for g, kind in enumerate(shard.kinds):
        if kind == "zeros":
            assert scales[g] == 0 and not torch.signbit(scales[g])
        if kind == "tiny" and x.dtype != torch.float16 and scales[g] != 0:
            assert scales[g] < 2.0**-126  # a subnormal scale (float16 inputs are too large for one)


@SETTINGS
@given(shard=shards(), offset=st.integers(0, 7))
def test_pack_unpack_round_trip(shard, offset):
    """[codes | scales in native byte order] at any byte offset, decoded into every dtype."""
    x, group_size, n = shard.x, shard.group_size, shard.x.numel()
    nbytes = ops.packed_nbytes(n, group_size)
    assert nbytes == n + 4 * n // group_size and ops.numel_from_packed(nbytes, group_size) == n
    buffer = torch.zeros(offset + nbytes + 3, dtype=torch.uint8)
    packed = buffer[offset : offset + nbytes]
    assert ops.quantize_pack_int8(x, packed, group_size) is packed
    want_codes, want_scales = model.quantize(x, group_size)
    assert np.array_equal(packed.numpy(), model.packed(want_codes, want_scales))
    assert not buffer[:offset].any() and not buffer[offset + nbytes :].any()  # nothing written outside
    assert np.array_equal(packed[:n].numpy().view(np.int8), want_codes)
    assert np.array_equal(packed[n:].numpy().copy().view(np.float32).view(np.uint32), want_scales.view(np.uint32))
    for out_dtype in DTYPES:
        out = ops.unpack_dequantize_int8(packed, dtype=out_dtype, group_size=group_size)
        model.assert_decodes_to(out, want_codes, want_scales, group_size)


@SETTINGS
@given(shard=shards())
def test_finite_groups_decode_within_half_a_scale_and_non_finite_ones_to_nan(shard):
    x, group_size = shard.x, shard.group_size
    codes, scales = reference.quantize_int8(x, group_size)
    decoded = reference.dequantize_int8(codes, scales, group_size, torch.float32).double().view(-1, group_size)
    exact = x.double().view(-1, group_size)
    finite = exact.isfinite().all(dim=1)
    # float32 rounding of the quotient and of code * scale adds at most ~1.5e-5 scales; a subnormal
    # scale (rounded to a coarse step) can make absmax / scale exceed 127.5, and the clamp then
    # costs up to 127 * 2^-150 more; 128 * 2^-150 covers that and the rounding of the decode.
    bound = scales.double()[:, None] * 0.5 * (1 + 1e-4) + 2.0**-143
    assert ((decoded - exact).abs()[finite] <= bound.expand_as(exact)[finite]).all()
    assert decoded[~finite].isnan().all()


def test_the_strategy_reaches_every_case():
    """Guards the strategy: a change that stopped producing some case would otherwise go unnoticed."""
    seen: set = set()

    @settings(max_examples=150, deadline=None, derandomize=True, database=None)
    @given(shard=shards())
    def collect(shard):
        seen.add(shard.x.dtype)
        seen.update(shard.kinds)
        seen.add(("groups", shard.x.numel() // shard.group_size))
        seen.add(("group_size", shard.group_size))

    collect()
    wanted = set(DTYPES) | set(KINDS) | {("groups", g) for g in (1, 2, 3, 4)}
    wanted |= {("group_size", 8), ("group_size", 256)}
    assert wanted <= seen, wanted - seen
