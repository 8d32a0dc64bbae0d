"""Host update throughput of torch's CPU optimizers, the step that CPU/NVMe offload runs on the host.

For each total size (``--params``, split into ``--tensors`` flat fp32 tensors of equal size, random
values and gradients) and each optimizer variant, a fresh optimizer takes ``--warmup`` steps (the
first creates its state) and then ``--steps`` timed steps; throughput = parameters / median step
time. Ratios are against plain AdamW (``foreach=False, fused=False``), the per-tensor loop.

Variants: AdamW ``fused=True`` (what the engine uses), AdamW ``foreach=True``, AdamW plain, Adam
``fused=True`` and ``foreach=True``, SGD with momentum ``foreach=True`` and ``fused=True``. Usage
(repository root)::

    python -m benchmarks.cpu_optimizer                        # 10M and 100M parameters, 32 tensors
    python -m benchmarks.cpu_optimizer --params 10e6 30e6 --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

VARIANTS: dict[str, OptimizerFactory] = {
    "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True),
    "AdamW plain": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=False, fused=False),
    "Adam fused": lambda ps: torch.optim.Adam(ps, lr=1e-4, fused=True),
    "Adam foreach": lambda ps: torch.optim.Adam(ps, lr=1e-4, foreach=True),
    "SGD momentum foreach": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, foreach=True),
    "SGD momentum fused": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, fused=True),
}
BASELINE = "AdamW plain"


class Measurement(NamedTuple):
    variant: str
    params: int
    step_s: float  # median
    params_per_s: float


def make_parameters(total: int, tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    size = total // tensors
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(size, generator=generator))
        p.grad = torch.randn(size, generator=generator) * 1e-3
        params.append(p)
    return params


def measure(name: str, params: list[torch.nn.Parameter], warmup: int, steps: int) -> Measurement:
    optimizer = VARIANTS[name](params)
    for _ in range(warmup):
        optimizer.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in params)
    median = statistics.median(times)
    del optimizer  # frees the state before the next variant allocates its own
    return Measurement(name, numel, median, numel / median)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=[10e6, 100e6], help="total parameters per run")
    parser.add_argument("--tensors", type=int, default=32, help="tensors the parameters are split into")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(f"# command: python -m benchmarks.cpu_optimizer {shlex.join(sys.argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads), Python {platform.python_version()}")
    print(f"# load average at start (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other processes share the cores)")
    print(f"# fp32 parameters split into {args.tensors} tensors; median of {args.steps} steps after {args.warmup} warm-up steps")
    print(f"{'params':>8} {'variant':<22} {'step ms':>9} {'Mparams/s':>10} {'vs ' + BASELINE:>16} {'vs AdamW fused':>15}")
    with torch.no_grad():
        tiny = make_parameters(4096, 4)
        for name in args.variants:  # first-call costs (thread pool start, dispatch) out of the figures
            measure(name, tiny, warmup=2, steps=1)
        for total in (int(n) for n in args.params):
            params = make_parameters(total, args.tensors)
            results = {name: measure(name, params, args.warmup, args.steps) for name in args.variants}
            baseline = results.get(BASELINE)
            fused = results.get("AdamW fused")
            for r in results.values():
                vs_base = f"{r.params_per_s / baseline.params_per_s:16.2f}" if baseline else f"{'-':>16}"
                vs_fused = f"{r.params_per_s / fused.params_per_s:15.2f}" if fused else f"{'-':>15}"
                print(f"{r.params / 1e6:7.0f}M {r.variant:<22} {r.step_s * 1e3:9.1f} {r.params_per_s / 1e6:10.1f} {vs_base} {vs_fused}")
            del params
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
