"""The ``zeroq::`` op schemas and their Python-side registrations.

Importing this module (which ``lightning_zeroq.ops`` does) defines the two schemas and registers,
for each op, the reference implementation for ``CPU`` and a fake (meta) implementation, so the ops
run on CPU and trace under ``torch.compile`` / FakeTensor. It touches no CUDA state.

The ``CUDA`` key is filled later, once, by :mod:`lightning_zeroq.ops._load` on first use with a
CUDA tensor: either the compiled extension registers its kernels from C++
(``TORCH_LIBRARY_IMPL(zeroq, CUDA, m)`` in ``csrc/ops.cpp``; the schemas must exist by then, which
importing this module guarantees), or :func:`register_reference_for_cuda` registers the reference.
Nothing is registered for CUDA at import so that the C++ kernels never have to override a Python
one.

Schemas (``Tensor(a!)`` marks the buffer an op writes in place; such ops return nothing):

    quantize_pack_int8(Tensor x, int group_size, Tensor(a!) out) -> ()
        x: 1-D float32/bfloat16/float16, numel a multiple of group_size; out: 1-D uint8 of
        exactly n + 4 * n / group_size bytes: [codes | scales].
    unpack_dequantize_int8(Tensor packed, int group_size, Tensor(a!) out) -> ()
        packed: 1-D uint8 of (n / group_size) * (group_size + 4) bytes; out: 1-D
        float32/bfloat16/float16 of n elements (its dtype is the output dtype).
    widen_checked(Tensor x, Tensor(a!) out, Tensor(b!) flag) -> ()
        x: 1-D float32/bfloat16/float16; out: 1-D float32 of as many elements, made float32(x) + 0;
        flag: one float32 element, set to 1 where any value is NaN or infinite (the gradient's
        widening for the optimizer and its non-finite check in one read).

The quantized gather needs nothing else: codes and scales travel in one buffer. (Ops returning
codes and scales as two tensors existed and were dropped, having no user but their own tests; the
reference keeps ``quantize_int8`` / ``dequantize_int8`` as the readable core of the format.)
"""

from __future__ import annotations

import torch
from torch.library import Library, register_fake

from lightning_zeroq.ops import reference

__all__ = ["NAMESPACE", "OP_NAMES", "SCHEMAS", "cuda_key_has_kernels", "register_reference_for_cuda"]

NAMESPACE = "zeroq"

SCHEMAS: dict[str, str] = {
    "quantize_pack_int8": "quantize_pack_int8(Tensor x, int group_size, Tensor(a!) out) -> ()",
    "unpack_dequantize_int8": ("unpack_dequantize_int8(Tensor packed, int group_size, Tensor(a!) out) -> ()"),
    "widen_checked": "widen_checked(Tensor x, Tensor(a!) out, Tensor(b!) flag) -> ()",
}
OP_NAMES = tuple(SCHEMAS)

_REFERENCE_IMPLS = {
    "quantize_pack_int8": reference.quantize_pack_int8,
    "unpack_dequantize_int8": reference.unpack_dequantize_int8,
    "widen_checked": reference.widen_checked,
}

# FRAGMENT rather than DEF: the C++ extension adds to the namespace (IMPL only), and other
# fragments may follow.
_lib = Library(NAMESPACE, "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _lib.define(_schema)
    _lib.impl(_name, _REFERENCE_IMPLS[_name], "CPU")

# Created by register_reference_for_cuda(); kept alive because a Library unregisters on deletion.
_cuda_fallback_lib: Library | None = None


# ---- fake (meta) implementations: shapes, dtypes and the same argument checks -----------------


@register_fake(f"{NAMESPACE}::quantize_pack_int8", lib=_lib)
def _quantize_pack_int8_fake(x: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    reference.check_pack_args(x, group_size, out)


@register_fake(f"{NAMESPACE}::unpack_dequantize_int8", lib=_lib)
def _unpack_dequantize_int8_fake(packed: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    reference.check_unpack_args(packed, group_size, out)


@register_fake(f"{NAMESPACE}::widen_checked", lib=_lib)
def _widen_checked_fake(x: torch.Tensor, out: torch.Tensor, flag: torch.Tensor) -> None:
    reference.check_widen_args(x, out, flag)


# ---- the CUDA key ------------------------------------------------------------------------------


def cuda_key_has_kernels() -> bool:
    """True when every ``zeroq::`` op has a CUDA kernel (compiled or the registered fallback)."""
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CUDA") for name in OP_NAMES)


def register_reference_for_cuda() -> None:
    """Registers the reference as the CUDA implementation of every op (idempotent).

    Only for a process that has not loaded, and will not load, the compiled kernels: both
    register for the same dispatch key, and the later one would silently override the earlier.
    """
    global _cuda_fallback_lib
    if _cuda_fallback_lib is not None:
        return
    lib = Library(NAMESPACE, "IMPL")
    for name, impl in _REFERENCE_IMPLS.items():
        lib.impl(name, impl, "CUDA")
    _cuda_fallback_lib = lib
