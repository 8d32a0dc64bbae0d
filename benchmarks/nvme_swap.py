"""Throughput of ``NvmeSwapper`` against the disk's own ``O_DIRECT`` bandwidth (``dd``), same run.

``--total-mib`` of fp32 regions in units of ``--unit-mib`` are written and read back through one
swapper in a fresh temporary directory under ``--dir`` (default: the system temp dir; pick one on
the disk you will swap to). Measured, each the median of ``--repeats`` passes over all units:

- ``dd write`` / ``dd read``: ``dd bs=1M oflag=direct`` / ``iflag=direct`` of the same total size,
  and the same with ``bs=<buffer size>``; the ratios below are against ``bs=1M``;
- ``write sync, aligned src``: ``write()`` per unit from a 4096-aligned tensor (no bounce copies);
- ``write async, unaligned src``: ``write_async()`` of every unit from an ordinary torch tensor
  (64-byte aligned, so every chunk goes through a bounce buffer), then ``wait_all()``;
- ``read sync, aligned out``: ``read()`` per unit, no read-ahead;
- ``read-ahead staged, unaligned out``: ``prefetch(i+1)`` then ``read(i, out)`` (staging buffer, then
  a copy into ``out``), the engine's default pattern;
- ``read-ahead into out``: ``prefetch(i+1, out=buf[(i+1)%2])`` then ``read(i, buf[i%2])``.

Read-back is checked bitwise against the source. With ``O_DIRECT`` the page cache is not involved;
with buffered I/O (``--direct-io off``, or a filesystem without ``O_DIRECT``) the write passes end
with ``os.sync()`` and the page cache is dropped before each read pass when the kernel lets us,
and the output says whether it did. Usage (repository root)::

    python -m benchmarks.nvme_swap                            # 2 GiB in 256 MiB units, /tmp
    python -m benchmarks.nvme_swap --dir /local_nvme --total-mib 8192 --unit-mib 512
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from lightning_zeroq.swap.buffers import aligned_empty
from lightning_zeroq.swap.io import filesystem_type
from lightning_zeroq.swap.swapper import NvmeSwapper, human_bytes

MiB = 1024 * 1024


class Result(NamedTuple):
    name: str
    kind: str  # "write" or "read"
    gbps: float  # 1e9 bytes per second, median over passes


def drop_page_cache() -> str:
    """Try to drop the page cache (needs root and a kernel that allows it); say what happened."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
        return "dropped (echo 3 > /proc/sys/vm/drop_caches accepted)"
    except OSError as e:
        return f"could not drop ({e})"


def run_dd(args: list[str]) -> float:
    """Run ``dd`` and return its throughput in GB/s, computed from its own byte count and time."""
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", proc.stderr, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"cannot parse dd output: {proc.stderr!r}")
    return int(match.group(1)) / float(match.group(2)) / 1e9


def dd_bandwidth(directory: Path, total_mib: int, block_mib: int, repeats: int) -> tuple[float, float]:
    path = directory / "dd.bin"
    count = total_mib // block_mib
    writes, reads = [], []
    for _ in range(repeats):
        writes.append(run_dd(["if=/dev/zero", f"of={path}", f"bs={block_mib}M", f"count={count}", "oflag=direct"]))
        drop_page_cache()
        reads.append(run_dd([f"if={path}", "of=/dev/null", f"bs={block_mib}M", "iflag=direct"]))
    path.unlink()
    return statistics.median(writes), statistics.median(reads)


def timed_passes(run_pass: Callable[[], None], total_bytes: int, repeats: int, before: Callable[[], None]) -> float:
    rates = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run_pass()
        rates.append(total_bytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def bench_swapper(sw: NvmeSwapper, units: int, numel: int, repeats: int) -> list[Result]:
    keys = [f"u{i}.master" for i in range(units)]
    for key in keys:
        sw.register(key, numel, torch.float32)
    sw.reserve()
    total = units * numel * 4
    buffered = not sw.direct_io

    src_aligned = aligned_empty(numel, torch.float32)
    src_aligned.copy_(torch.randn(numel))  # random, so nothing on the way can compress or skip zeros
    src_plain = src_aligned.clone()
    assert src_plain.data_ptr() % sw.alignment != 0, "expected an unaligned torch allocation"
    out_plain = torch.empty(numel)
    outs = [aligned_empty(numel, torch.float32) for _ in range(2)]

    def flush() -> None:
        if buffered:
            os.sync()

    def write_sync() -> None:
        for key in keys:
            sw.write(key, src_aligned)
        flush()

    def write_async() -> None:
        for key in keys:
            sw.write_async(key, src_plain)
        sw.wait_all()
        flush()

    def read_sync() -> None:
        for key in keys:
            sw.read(key, outs[0])

    def read_ahead_staged() -> None:
        sw.prefetch(keys[0])
        for i, key in enumerate(keys):
            if i + 1 < units:
                sw.prefetch(keys[i + 1])
            sw.read(key, out_plain)

    def read_ahead_into_out() -> None:
        sw.prefetch(keys[0], out=outs[0])
        for i, key in enumerate(keys):
            if i + 1 < units:
                sw.prefetch(keys[i + 1], out=outs[(i + 1) % 2])
            sw.read(key, outs[i % 2])

    nothing = lambda: None  # noqa: E731
    drops: set[str] = set()
    before_read = (lambda: drops.add(drop_page_cache())) if buffered else nothing
    results = [
        Result("write sync, aligned src", "write", timed_passes(write_sync, total, repeats, nothing)),
        Result("write async, unaligned src", "write", timed_passes(write_async, total, repeats, nothing)),
        Result("read sync, aligned out", "read", timed_passes(read_sync, total, repeats, before_read)),
        Result("read-ahead staged, unaligned out", "read", timed_passes(read_ahead_staged, total, repeats, before_read)),
        Result("read-ahead into out", "read", timed_passes(read_ahead_into_out, total, repeats, before_read)),
    ]
    if buffered:
        print(f"# buffered I/O: write passes end with os.sync(); page cache before each read pass: {', '.join(sorted(drops))}")
    for out in (out_plain, outs[(units - 1) % 2]):
        assert torch.equal(out.view(torch.uint8), src_aligned.view(torch.uint8)), "read-back differs from source"
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--unit-mib", type=int, default=256)
    parser.add_argument("--buffer-mib", type=int, default=32, help="NvmeSwapper buffer_bytes, in MiB")
    parser.add_argument("--num-buffers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="NvmeSwapper num_threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--direct-io", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args()
    if args.total_mib % args.unit_mib:
        parser.error(f"--total-mib={args.total_mib} must be a multiple of --unit-mib={args.unit_mib}")

    work = Path(tempfile.mkdtemp(prefix="zeroq_nvme_bench_", dir=args.dir))
    print(f"# command: python -m benchmarks.nvme_swap {shlex.join(sys.argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"Python {platform.python_version()}, kernel {platform.release()}")
    print(f"# directory {work} ({filesystem_type(work)})")
    df = subprocess.run(["df", "-h", str(work)], capture_output=True, text=True).stdout.rstrip()
    print("\n".join(f"#   {line}" for line in df.splitlines()))
    print(f"# page cache drop: {drop_page_cache()}")
    print(f"# load average at start (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        dd_1m = dd_bandwidth(work, args.total_mib, 1, args.repeats)
        dd_big = dd_bandwidth(work, args.total_mib, args.buffer_mib, args.repeats)
        direct = {"auto": None, "on": True, "off": False}[args.direct_io]
        with NvmeSwapper(
            work, num_buffers=args.num_buffers, buffer_bytes=args.buffer_mib * MiB, num_threads=args.threads, direct_io=direct
        ) as sw:
            results = bench_swapper(sw, args.total_mib // args.unit_mib, args.unit_mib * MiB // 4, args.repeats)
            direct_io = sw.direct_io
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"# NvmeSwapper: O_DIRECT={'yes' if direct_io else 'no (buffered I/O)'}, buffer {args.buffer_mib} MiB x "
          f"{args.num_buffers}, {args.threads} I/O threads; {human_bytes(args.total_mib * MiB)} in units of "
          f"{args.unit_mib} MiB; median of {args.repeats} passes")
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'measurement':<36} {'GB/s':>7} {'vs dd bs=1M':>12}")
    print(f"{'dd write bs=1M oflag=direct':<36} {dd_1m[0]:7.3f} {'1.00':>12}")
    print(f"{'dd read  bs=1M iflag=direct':<36} {dd_1m[1]:7.3f} {'1.00':>12}")
    print(f"{f'dd write bs={args.buffer_mib}M oflag=direct':<36} {dd_big[0]:7.3f} {dd_big[0] / dd_1m[0]:12.2f}")
    print(f"{f'dd read  bs={args.buffer_mib}M iflag=direct':<36} {dd_big[1]:7.3f} {dd_big[1] / dd_1m[1]:12.2f}")
    for r in results:
        reference = dd_1m[0] if r.kind == "write" else dd_1m[1]
        print(f"{r.name:<36} {r.gbps:7.3f} {r.gbps / reference:12.2f}")


if __name__ == "__main__":
    main()
