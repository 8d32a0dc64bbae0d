"""Pure-PyTorch reference of the INT8 group quantization: the specification.

This file defines the format; the CUDA kernels (``csrc/quant_int8.cu``) must reproduce it bitwise
(codes, scales and decoded values), and it is the implementation of the ``zeroq::`` ops on CPU and
on CUDA when the compiled kernels are absent. It is written to be read, not to be fast.

Format. A 1-D shard ``x`` of ``n`` elements (float32, bfloat16 or float16), ``n`` a multiple of the
group size ``G`` (a positive multiple of 8; the caller pads shards with zeros to whole groups), is
cut into ``n / G`` groups of ``G`` consecutive elements. Per group, in float32 (inputs are upcast,
which is exact; their bytes are never reinterpreted):

    scale = absmax(group) / 127                              one IEEE division
    code  = clamp(round(x / scale), -127, 127)   as int8     IEEE division, round half to even
    value = float32(code) * scale, then cast to the output dtype (round to nearest even)

A group whose scale is 0 (all zeros, or an absmax so small that absmax / 127 underflows) divides by
1 instead, so its codes are 0 and it decodes to zeros: no division by zero, no NaN. For finite
inputs every element decodes to within ``scale / 2`` of its value, plus float32 rounding: about
1e-5 of a scale, and where the scale is subnormal or 0 (absmax below ``127 * 2**-126``, about
1.5e-36) up to ``127 * 2**-150`` (about 9e-44) absolute, because rounding such a scale can make
``absmax / scale`` exceed 127.5, and the clamp then shortens the largest values.

Non-finite input propagates, group by group. A group holding any NaN, +inf or -inf gets

    scale = NaN, exactly the bits 0x7FC00000 (torch's ``float('nan')``)
    code  = 0 for every element

so every element of that group decodes to ``0 * NaN = NaN``, in every output dtype, and so does
nothing else: the neighbouring groups are encoded as if it were not there. A NaN master weight thus
stays visible in the working weights (and the loss) instead of turning into a finite value. The
scale's bits are fixed so that packed buffers are the same bytes on every backend; the decoded
NaNs' sign and payload are not part of the format (GPU arithmetic yields another NaN than x86).

Why a true division and not a multiplication by ``1 / scale``: the reciprocal of a subnormal scale
overflows to inf, and the division needs no special case. The kernels use ``__fdiv_rn``, the same
correctly rounded division, so codes match bitwise. The divisors below are tensors, never Python
scalars, because PyTorch's CUDA division by a scalar multiplies by its reciprocal instead.

Packed layout (one buffer per rank, so that a single ``all_gather_into_tensor`` moves everything):

    uint8[n + 4 * n / G] = [ n int8 codes | n / G float32 scales, native byte order ]

so a packed buffer holds ``(n / G) * (G + 4)`` bytes. The ``check_*`` functions state the argument
rules; every backend raises the same ``ValueError`` for a bad argument.
"""

from __future__ import annotations

import torch

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QMAX",
    "SUPPORTED_DTYPES",
    "check_group_size",
    "dequantize_int8",
    "numel_from_packed",
    "packed_nbytes",
    "quantize_int8",
    "quantize_pack_int8",
    "unpack_dequantize_int8",
    "widen_checked",
]

DEFAULT_GROUP_SIZE = 64
QMAX = 127
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCALE_BYTES = 4  # one float32 per group


# ---- argument rules ---------------------------------------------------------------------------


def check_group_size(group_size: int) -> None:
    """Raises ``ValueError`` unless ``group_size`` is a positive multiple of 8."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, torch.SymInt)):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    if group_size <= 0 or group_size % 8 != 0:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size}")


def check_numel(numel: int, group_size: int, what: str = "x") -> None:
    """Raises ``ValueError`` unless ``numel`` is a whole number of groups."""
    if numel % group_size != 0:
        raise ValueError(
            f"{what} has {numel} elements, not a multiple of group_size {group_size}; "
            "pad the shard with zeros to whole groups"
        )


def check_vector(t: torch.Tensor, what: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raises ``ValueError`` unless ``t`` is a contiguous 1-D tensor of one of ``dtypes``."""
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{what} must be {names}, got {t.dtype}")


def check_same_device(t: torch.Tensor, what: str, anchor: torch.Tensor) -> None:
    if t.device != anchor.device:
        raise ValueError(f"{what} is on {t.device} but the input is on {anchor.device}")


def check_output_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")


def packed_nbytes(numel: int, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Bytes of the packed buffer for ``numel`` elements: ``numel + 4 * numel / group_size``."""
    check_group_size(group_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    check_numel(numel, group_size, what="the shard")
    return numel // group_size * (group_size + _SCALE_BYTES)


def numel_from_packed(nbytes: int, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Inverse of :func:`packed_nbytes`; ``ValueError`` unless ``nbytes`` is whole groups."""
    check_group_size(group_size)
    if nbytes % (group_size + _SCALE_BYTES) != 0:
        raise ValueError(
            f"a packed buffer of {nbytes} bytes is not a whole number of groups of {group_size} "
            f"(each group takes {group_size + _SCALE_BYTES} bytes)"
        )
    return nbytes // (group_size + _SCALE_BYTES) * group_size


def check_quantize_args(x: torch.Tensor, group_size: int) -> None:
    check_group_size(group_size)
    check_vector(x, "x", SUPPORTED_DTYPES)
    check_numel(x.numel(), group_size)


def check_dequantize_args(codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> None:
    check_group_size(group_size)
    check_vector(codes, "codes", (torch.int8,))
    check_vector(scales, "scales", (torch.float32,))
    check_same_device(scales, "scales", codes)
    check_output_dtype(dtype)
    check_numel(codes.numel(), group_size, what="codes")
    if scales.numel() != codes.numel() // group_size:
        raise ValueError(
            f"expected {codes.numel() // group_size} scales for {codes.numel()} codes with "
            f"group_size {group_size}, got {scales.numel()}"
        )


def check_pack_args(x: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    check_quantize_args(x, group_size)
    check_vector(out, "out", (torch.uint8,))
    check_same_device(out, "out", x)
    expected = packed_nbytes(x.numel(), group_size)
    if out.numel() != expected:
        raise ValueError(
            f"out must hold exactly {expected} bytes for {x.numel()} elements with group_size "
            f"{group_size}, got {out.numel()}"
        )


def check_unpack_args(packed: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    check_group_size(group_size)
    check_vector(packed, "packed", (torch.uint8,))
    check_vector(out, "out", SUPPORTED_DTYPES)
    check_same_device(out, "out", packed)
    numel = numel_from_packed(packed.numel(), group_size)
    if out.numel() != numel:
        raise ValueError(
            f"a packed buffer of {packed.numel()} bytes decodes to {numel} elements, but out has {out.numel()}"
        )


# ---- the format -------------------------------------------------------------------------------


def quantize_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(codes, scales)``: int8 ``[n]`` and float32 ``[n / group_size]``.

    The core of the format, which :func:`quantize_pack_int8` lays out in one buffer (the packed
    form is the only one registered as a ``zeroq::`` op).
    """
    check_quantize_args(x, group_size)
    groups = x.to(torch.float32).view(-1, group_size)  # [num_groups, G]; exact upcast
    absmax = groups.abs().amax(dim=1)  # [num_groups]; NaN if the group holds a NaN, inf if an inf
    finite = absmax.isfinite()
    scales = absmax / torch.full_like(absmax, QMAX)
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    divisors = torch.where(scales == 0, torch.ones_like(scales), scales)
    quotients = groups / divisors[:, None]
    # Non-finite groups are zeroed before the cast: converting NaN to int8 is undefined.
    quotients = torch.where(finite[:, None], quotients, torch.zeros_like(quotients))
    codes = torch.round(quotients).clamp(-QMAX, QMAX).to(torch.int8)
    return codes.view(-1), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Returns ``float32(codes) * scale`` per group, cast to ``dtype``, shape ``[n]``."""
    check_dequantize_args(codes, scales, group_size, dtype)
    values = codes.view(-1, group_size).to(torch.float32) * scales[:, None]
    return values.view(-1).to(dtype)


def quantize_pack_int8(x: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    """Writes ``[codes | scales]`` of ``x`` into the uint8 buffer ``out`` (see module docstring)."""
    check_pack_args(x, group_size, out)
    codes, scales = quantize_int8(x, group_size)
    n = x.numel()
    out[:n].copy_(codes.view(torch.uint8))
    out[n:].copy_(scales.view(torch.uint8))


def unpack_dequantize_int8(packed: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    """Decodes one packed buffer into ``out`` (its dtype is the output dtype)."""
    check_unpack_args(packed, group_size, out)
    n = out.numel()
    codes = packed[:n].view(torch.int8)
    # A rank's slice of a gathered buffer may start at any byte; viewing bytes as float32 needs a
    # 4-byte aligned offset, so the (small) scale bytes are copied first.
    scales = packed[n:].clone().view(torch.float32)
    out.copy_(dequantize_int8(codes, scales, group_size, out.dtype))


# ---- the gradient widening (not part of the INT8 format) -------------------------------------


def check_widen_args(x: torch.Tensor, out: torch.Tensor, flag: torch.Tensor) -> None:
    check_vector(x, "x", SUPPORTED_DTYPES)
    check_vector(out, "out", (torch.float32,))
    check_vector(flag, "flag", (torch.float32,))
    check_same_device(out, "out", x)
    check_same_device(flag, "flag", x)
    if out.numel() != x.numel():
        raise ValueError(f"out has {out.numel()} elements, x has {x.numel()}; they must be equal")
    if flag.numel() != 1:
        raise ValueError(f"flag must hold one element, got {flag.numel()}")


def widen_checked(x: torch.Tensor, out: torch.Tensor, flag: torch.Tensor) -> None:
    """``out = float32(x) + 0`` (exact but for -0, which becomes +0: the values a zeroed fp32 buffer gets
    when ``x`` is added to it), and ``flag`` set to 1 where any value is NaN or infinite (left as it is
    otherwise): a gradient widened for the optimizer and checked for the step's verdict in one read."""
    check_widen_args(x, out, flag)
    torch.add(x, 0.0, out=out)
    torch.maximum(flag, (~torch.isfinite(out).all()).to(flag.dtype).reshape(flag.shape), out=flag)
