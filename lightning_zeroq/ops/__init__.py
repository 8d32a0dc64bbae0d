"""INT8 group quantization for the quantized weight gather, and the gradient's widening checked for non-finite
values in the same read: the only names ``zero/`` imports.

Shards are quantized in groups of ``group_size`` (default 64) consecutive elements, symmetric INT8
with one float32 scale per group; :mod:`lightning_zeroq.ops.reference` is the specification. The
functions below validate their arguments (``ValueError`` naming the value) and call the
``torch.ops.zeroq.*`` custom ops, which run the reference on CPU and the compiled kernels on CUDA.

Typical use in a gather, per rank and bucket::

    send = torch.empty(packed_nbytes(shard.numel()), dtype=torch.uint8, device=dev)
    quantize_pack_int8(shard, send)                      # [codes | scales]
    dist.all_gather_into_tensor(recv, send)              # recv: world_size * send.numel() bytes
    for r, chunk in enumerate(recv.chunk(world_size)):
        unpack_dequantize_int8(chunk, full[r * n:(r + 1) * n])

Importing this package defines the ops but initializes no CUDA and compiles nothing; the first
call with a CUDA tensor loads the kernels (see :mod:`lightning_zeroq.ops._load`). Code that calls
``torch.ops.zeroq.*`` directly on CUDA tensors should call :func:`load_cuda_backend` first.
"""

from __future__ import annotations

import torch

from lightning_zeroq.ops import (
    _library,  # noqa: F401  (importing it defines torch.ops.zeroq.*)
    _load,
    reference,
)
from lightning_zeroq.ops._load import Backend, active_backend, has_cuda_kernel, load_cuda_backend
from lightning_zeroq.ops.reference import DEFAULT_GROUP_SIZE, numel_from_packed, packed_nbytes

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "Backend",
    "active_backend",
    "has_cuda_kernel",
    "load_cuda_backend",
    "numel_from_packed",
    "packed_nbytes",
    "quantize_pack_int8",
    "unpack_dequantize_int8",
    "widen_checked",
]


def _prepare(t: torch.Tensor) -> None:
    # A global read is all this costs once resolved, so it also traces cleanly under dynamo.
    if t.is_cuda and _load.active_backend() is Backend.UNRESOLVED:
        _load.load_cuda_backend()


def quantize_pack_int8(
    x: torch.Tensor, out: torch.Tensor | None = None, group_size: int = DEFAULT_GROUP_SIZE
) -> torch.Tensor:
    """Quantizes ``x`` into one uint8 buffer ``[codes | scales]`` and returns it.

    Args:
        x: 1-D float32/bfloat16/float16 shard, length a multiple of ``group_size``.
        out: uint8 buffer of exactly ``packed_nbytes(x.numel(), group_size)`` bytes on ``x``'s
            device (for instance the send buffer of an all-gather); allocated when ``None``.
        group_size: elements per scale, a positive multiple of 8.
    """
    reference.check_quantize_args(x, group_size)
    if out is None:
        out = torch.empty(packed_nbytes(x.numel(), group_size), dtype=torch.uint8, device=x.device)
    reference.check_pack_args(x, group_size, out)
    _prepare(x)
    torch.ops.zeroq.quantize_pack_int8.default(x, group_size, out)
    return out


def unpack_dequantize_int8(
    packed: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> torch.Tensor:
    """Decodes one packed buffer (one rank's ``[codes | scales]``) into ``out`` and returns it.

    Args:
        packed: 1-D uint8 buffer of ``packed_nbytes(n, group_size)`` bytes; may be a slice of a
            gathered buffer at any byte offset.
        out: 1-D float32/bfloat16/float16 tensor of ``n`` elements on ``packed``'s device (for
            instance a rank's slice of the full working buffer); allocated when ``None``.
        dtype: dtype of the allocated ``out`` (default float32); if ``out`` is given, must be
            ``None`` or ``out.dtype``.
        group_size: elements per scale, a positive multiple of 8.
    """
    reference.check_group_size(group_size)
    if out is None:
        out_dtype = torch.float32 if dtype is None else dtype
        reference.check_output_dtype(out_dtype)
        n = numel_from_packed(packed.numel(), group_size)
        out = torch.empty(n, dtype=out_dtype, device=packed.device)
    elif dtype is not None and dtype != out.dtype:
        raise ValueError(f"dtype {dtype} disagrees with out.dtype {out.dtype}; pass one of them")
    reference.check_unpack_args(packed, group_size, out)
    _prepare(packed)
    torch.ops.zeroq.unpack_dequantize_int8.default(packed, group_size, out)
    return out


def widen_checked(x: torch.Tensor, out: torch.Tensor, flag: torch.Tensor) -> None:
    """``out = float32(x) + 0`` (-0 becomes +0, every other value passes exactly) and ``flag`` (one float32
    element) set to 1 where any value is NaN or infinite, in one read of ``x``: a gradient widened for the
    optimizer and checked for the step's verdict. 1-D contiguous tensors on one device; ``x`` float32,
    bfloat16 or float16."""
    reference.check_widen_args(x, out, flag)
    _prepare(x)
    torch.ops.zeroq.widen_checked.default(x, out, flag)
