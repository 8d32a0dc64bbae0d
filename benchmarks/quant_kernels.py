"""Effective bandwidth of the INT8 quantization kernels against a device-to-device copy.

For each input dtype and shard size, measured in the same run:

- ``copy``: ``dst.copy_(src)`` of the input shard (reads and writes ``n * itemsize`` bytes);
- ``quantize_pack``: reads ``n * itemsize``, writes ``n + 4 n / G`` bytes;
- ``unpack_dequantize``: reads ``n + 4 n / G``, writes ``n * itemsize`` bytes.

Effective bandwidth = (bytes read + bytes written) / median time (CUDA events, after warm-up);
``vs copy`` is that bandwidth over the copy's. Usage (on a CUDA machine)::

    python -m benchmarks.quant_kernels                      # 64 Mi and 256 Mi elements (repo root)
    python -m benchmarks.quant_kernels --numel 100000000 --iters 200 --reference
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch

import lightning_zeroq.ops as ops
from lightning_zeroq.ops import reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Row(NamedTuple):
    op: str
    dtype: str
    numel: int
    bytes_moved: int
    median_ms: float

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.median_ms * 1e-3) / 1e9


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each timed by its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def bench(
    numel: int, dtype_name: str, group_size: int, warmup: int, iters: int, with_reference: bool
) -> list[Row]:
    dtype = DTYPES[dtype_name]
    zeroq = torch.ops.zeroq
    numel -= numel % group_size
    x = torch.randn(numel, device="cuda", dtype=torch.float32).to(dtype)
    copy_dst = torch.empty_like(x)
    packed = torch.empty(ops.packed_nbytes(numel, group_size), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(x)
    in_bytes = numel * x.element_size()
    packed_bytes = packed.numel()

    cases: list[tuple[str, Callable[[], object], int]] = [
        ("copy", lambda: copy_dst.copy_(x), 2 * in_bytes),
        # The ops directly, without the wrappers' Python argument checks, to time the kernels.
        (
            "quantize_pack",
            lambda: zeroq.quantize_pack_int8.default(x, group_size, packed),
            in_bytes + packed_bytes,
        ),
        (
            "unpack_dequantize",
            lambda: zeroq.unpack_dequantize_int8.default(packed, group_size, out),
            packed_bytes + in_bytes,
        ),
    ]
    if with_reference:
        cases += [
            (
                "ref quantize_pack",
                lambda: reference.quantize_pack_int8(x, group_size, packed),
                in_bytes + packed_bytes,
            ),
            (
                "ref unpack_dequantize",
                lambda: reference.unpack_dequantize_int8(packed, group_size, out),
                packed_bytes + in_bytes,
            ),
        ]
    rows = []
    for name, fn, nbytes in cases:
        n_iters = iters if not name.startswith("ref") else max(3, iters // 10)
        rows.append(Row(name, dtype_name, numel, nbytes, time_ms(fn, warmup, n_iters)))
    del x, copy_dst, packed, out
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--numel", type=int, nargs="+", default=[64 << 20, 256 << 20], help="shard sizes (elements)"
    )
    parser.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=list(DTYPES))
    parser.add_argument("--group-size", type=int, default=ops.DEFAULT_GROUP_SIZE)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument(
        "--reference", action="store_true", help="also time the PyTorch reference on CUDA"
    )
    args = parser.parse_args()

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    backend = ops.load_cuda_backend()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, zeroq: {backend.value}")
    print(f"group_size {args.group_size}; median of {args.iters} iterations after {args.warmup} warm-up")
    print()
    header = (
        f"{'op':<22} {'dtype':<9} {'numel':>12} {'MB moved':>10} {'ms':>9} {'GB/s':>8} {'vs copy':>8}"
    )
    print(header)
    print("-" * len(header))
    for numel in args.numel:
        for dtype_name in args.dtype:
            rows = bench(numel, dtype_name, args.group_size, args.warmup, args.iters, args.reference)
            copy_gbps = rows[0].gbps
            for row in rows:
                print(
                    f"{row.op:<22} {row.dtype:<9} {row.numel:>12} {row.bytes_moved / 1e6:>10.1f} "
                    f"{row.median_ms:>9.4f} {row.gbps:>8.0f} {row.gbps / copy_gbps:>8.2f}"
                )
            print()


if __name__ == "__main__":
    main()
