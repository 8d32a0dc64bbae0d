"""An independent model of the INT8 group format, in float64 numpy, to test the reference against.

Written from the format's definition (the docstring of ``lightning_zeroq/ops/reference.py``), not
from its code, and sharing no float32 arithmetic with it: every float32 operation of the format is
done here in float64 and then rounded to float32 once. For a quotient of two float32 values that
gives the correctly rounded float32 quotient, because float64 carries 53 >= 2 * 24 + 2 significand
bits, so rounding twice cannot differ from rounding once (also for float32 subnormal results, which
carry even fewer bits). ``code * scale`` is exact in float64 (8 + 24 bits), so it too is rounded
once. Conversions to the output dtype: float16 by numpy (round to nearest even), bfloat16 by hand
on the float32 bits.
"""

from __future__ import annotations

import numpy as np
import torch

QMAX = 127
NAN_SCALE_BITS = 0x7FC00000  # the scale of a group holding NaN or +-inf

_UINT = {torch.float32: np.uint32, torch.bfloat16: np.uint16, torch.float16: np.uint16}
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def as_float64(x: torch.Tensor) -> np.ndarray:
    """``x`` (CPU, float32/bfloat16/float16) as float64: exact, every such value is a float64."""
    if x.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits are a float32's high half
        high = x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << np.uint32(16)
        return high.view(np.float32).astype(np.float64)
    return x.numpy().astype(np.float64)


def quantize(x: torch.Tensor, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes int8 [n], scales float32 [n / group_size])`` of the format, from the definition."""
    groups = as_float64(x).reshape(-1, group_size)
    finite = np.isfinite(groups).all(axis=1)
    groups = np.where(np.isfinite(groups), groups, 0.0)  # non-finite groups get fixed values below
    absmax = np.abs(groups).max(axis=1, initial=0.0)
    scales = (absmax / QMAX).astype(np.float32)  # float32 division: one rounding of the float64 one
    scales[~finite] = np.array(NAN_SCALE_BITS, dtype=np.uint32).view(np.float32)
    divisors = np.where(finite & (scales != 0), scales, np.float32(1)).astype(np.float64)
    quotients = (groups / divisors[:, None]).astype(np.float32)  # again one rounding
    codes = np.clip(np.rint(quotients), -QMAX, QMAX)  # rint: round half to even
    codes[~finite] = 0
    return codes.astype(np.int8).reshape(-1), scales


def decode_bits(
    codes: np.ndarray, scales: np.ndarray, group_size: int, dtype: torch.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """``(bits, is_nan)`` of the decoded values in ``dtype``; bits of NaN elements are not defined."""
    products = codes.reshape(-1, group_size).astype(np.float64) * scales.astype(np.float64)[:, None]
    values = products.astype(np.float32).reshape(-1)  # exact product, rounded once to float32
    is_nan = np.isnan(values)
    if dtype == torch.float32:
        bits = values.view(np.uint32)
    elif dtype == torch.float16:
        with np.errstate(over="ignore"):  # overflow to inf is the conversion's defined result
            bits = values.astype(np.float16).view(np.uint16)
    else:
        wide = values.view(np.uint32).astype(np.uint64)
        # Round to nearest even on the 16 bits dropped; a carry may ripple into the exponent,
        # which is right (up to inf).
        bits = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, is_nan


def packed(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The packed buffer: ``[codes | scales in native byte order]`` as uint8."""
    return np.concatenate([codes.view(np.uint8), scales.view(np.uint8)])


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The bits of a CPU float32/bfloat16/float16 tensor as unsigned ints of its width."""
    return t.view(_INT[t.dtype]).numpy().view(_UINT[t.dtype])


def assert_decodes_to(out: torch.Tensor, codes: np.ndarray, scales: np.ndarray, group_size: int) -> None:
    """``out`` (any supported dtype) is the model's decode: NaN at the same places, else same bits."""
    bits, is_nan = decode_bits(codes, scales, group_size, out.dtype)
    out = out.cpu()
    got_nan = out.isnan().numpy()
    assert np.array_equal(got_nan, is_nan), f"NaN at other places: {np.flatnonzero(got_nan != is_nan)[:5]}"
    got = tensor_bits(out)
    wrong = np.flatnonzero((got != bits) & ~is_nan)
    assert wrong.size == 0, f"{wrong.size} decoded values differ, first at {wrong[:5].tolist()}"


def assert_quantizes_to(
    codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, group_size: int
) -> None:
    """``codes`` / ``scales`` (torch) are the model's for ``x``, bit for bit."""
    want_codes, want_scales = quantize(x.cpu(), group_size)
    got_codes = codes.cpu().numpy()
    wrong = np.flatnonzero(got_codes != want_codes)
    assert wrong.size == 0, (
        f"{wrong.size} codes differ, first at {wrong[:5].tolist()}: "
        f"{got_codes[wrong[:5]].tolist()} instead of {want_codes[wrong[:5]].tolist()}"
    )
    got_scales = scales.cpu().view(torch.int32).numpy().view(np.uint32)
    wrong = np.flatnonzero(got_scales != want_scales.view(np.uint32))
    assert wrong.size == 0, f"{wrong.size} scales differ, first at {wrong[:5].tolist()}"
