"""The parts a step is built from, each alone and without a model: the host AdamW step of optimizer offload,
offloaded Muon's host parts, torch's CPU optimizers, the INT8 kernels of the quantized gathers, and the flags an
offload step reads back while its gradients cross to the host. One command each (``--help`` after it says what it measures and how)::

    python benchmarks/kernels.py host-adam --threads 16 --numel 953223168 --dma
    python benchmarks/kernels.py host-muon --threads 16 --numel 953223168 --triad
    python benchmarks/kernels.py cpu-optimizers --params 10e6 30e6 --threads 1
    python benchmarks/kernels.py int8 --numel 268435456          # on a CUDA machine
    python benchmarks/kernels.py readback --gib 3.5 --units 8    # on a CUDA machine

(``host-adam`` was ``host_adam.py``, ``cpu-optimizers`` ``cpu_optimizer.py``, ``int8`` ``quant_kernels.py`` and
``readback`` ``d2h_readback.py``; their stored results keep those names.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning_zeroq.ops as ops  # noqa: E402
from benchmarks import commands  # noqa: E402
from benchmarks.commands import Command  # noqa: E402
from lightning_zeroq.ops import reference  # noqa: E402

# ---------------------------------------------------------------------------------------------- host-adam

HOST_ADAM = """The host AdamW step at offload size: torch's fused CPU AdamW, torch's foreach AdamW, DeepSpeed's
DeepSpeedCPUAdam (AVX, JIT-built) and lightning_zeroq's host kernel (``csrc/host_adam.c``, in place and
out of place, as a speculative step writes; and as the offload engine steps bf16 training,
``_EngineStep``: bf16 gradients, a bf16 copy written, in pageable or pinned memory, with the given
threads or one fewer, the threads taking chunks or fixed parts, the bf16 copy streamed past the
caches or stored plainly), on the same tensors, in one process, alternating.

The 953M GPT under optimizer offload at world size 1 steps all of its 953M fp32 elements on the host
(``--numel``); at 2 ranks about 476M each. The elements are split into ``--tensors`` tensors (the
engine steps one unit at a time). Each arm steps ``--steps`` times after one warm-up step over the
same parameter/gradient/state values (copies), with ``--threads`` threads; the median step time and
the effective bandwidth (7 fp32 arrays read or written per element: param, grad, exp_avg, exp_avg_sq
read; param, exp_avg, exp_avg_sq written) are printed as JSON lines, with the
largest difference of the updated parameters against the fused arm (0 for the zeroq kernel: it is
checked bitwise against torch's at load).

``--triad``: first the host's memory bandwidth, STREAM's triad (``a = b + s * c`` over three fp32 arrays of
``--numel`` elements, ``--steps`` times after a warm-up, with the kernel's threads and binding, streaming
stores and plain ones; counted as STREAM counts, 12 bytes per element), at ``--threads`` and at each count of
``--triad-threads``; every arm's line then carries ``of_triad``, its bytes per second over the best triad
at ``--threads``. The host step's roofline is that share: the step moves 28 bytes per element (7 fp32
arrays; the engine's arms: 3 fp32 read and written, a bf16 gradient read and a bf16 copy written).

``--dma`` (CUDA): while each arm steps, a side stream copies a gradient-sized buffer from the GPU to
pinned host memory and the masters back, again and again, as an offload step's PCIe traffic lands in
host memory beside the host step; the copies' bandwidth is reported per arm.

    python benchmarks/kernels.py host-adam --threads 16 --numel 953223168 --dma
    python benchmarks/kernels.py host-adam --threads 16 --numel 476000000 --triad --triad-threads 1,4,8,12,15
"""


def _triad(numel: int, threads: int, steps: int) -> list[dict]:
    """STREAM's triad with the host kernel's threads: one JSON line per store kind."""
    from lightning_zeroq.ops.host_adam import host_adam as kernel_of_this_machine

    kernel = kernel_of_this_machine()
    if kernel is None:
        return [{"arm": "triad", "error": "the host kernel is not available here (see the log)"}]
    a, b, c = (torch.full((numel,), 1.0) for _ in range(3))  # every page written once before timing
    lines = []
    for streaming in (True, False):
        times = []
        for i in range(steps + 1):
            start = time.perf_counter()
            kernel.triad(a, b, c, 3.0, threads, streaming)
            if i:
                times.append(time.perf_counter() - start)
        best, median = min(times), statistics.median(times)
        lines.append({"arm": f"triad_{'streaming' if streaming else 'plain'}", "numel": numel, "threads": threads,
                      "median_s": round(median, 4), "GB_per_s": round(12 * numel / median / 1e9, 2),
                      "best_GB_per_s": round(12 * numel / best / 1e9, 2)})
    return lines


def _host_adam_arms(threads: int) -> dict:
    def fused(ps):
        return torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True)

    arms = {"torch_fused": fused,
            "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True)}
    from lightning_zeroq.ops.host_adam import host_adam

    kernel = host_adam()
    if kernel is not None:
        arms["zeroq_kernel"] = lambda ps: _ZeroqAdamW(ps, kernel, threads, out=False)
        arms["zeroq_kernel_out"] = lambda ps: _ZeroqAdamW(ps, kernel, threads, out=True)
        pin = torch.cuda.is_available()
        arms["zeroq_engine"] = lambda ps: _EngineStep(ps, kernel, threads, pin=False)
        if pin:
            arms["zeroq_engine_pinned"] = lambda ps: _EngineStep(ps, kernel, threads, pin=True)
            arms["zeroq_engine_pinned_less1"] = lambda ps: _EngineStep(ps, kernel, threads - 1, pin=True)
            arms["zeroq_engine_pinned_parts"] = lambda ps: _EngineStep(ps, kernel, threads, pin=True, parts=True)
            arms["zeroq_engine_pinned_plain"] = lambda ps: _EngineStep(ps, kernel, threads, pin=True, plain=True)
    else:
        print(json.dumps({"arm": "zeroq_kernel", "error": "not available (see the log)"}), flush=True)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        arms["deepspeed_cpu_adam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, weight_decay=0.1, adamw_mode=True)
    except Exception as error:  # DeepSpeed absent or its op does not build here
        print(json.dumps({"arm": "deepspeed_cpu_adam", "error": f"{type(error).__name__}: {error}"[:300]}), flush=True)
    return arms


class _ZeroqAdamW:
    """AdamW(lr=1e-4, weight_decay=0.1) through the host kernel, one tensor at a time (as the engine
    steps units); ``out``: out of place into spare buffers (made and touched once), swapped in after
    each step, as a kept speculative step is."""

    def __init__(self, params, kernel, threads: int, out: bool) -> None:
        self.params, self.kernel, self.threads, self.count = params, kernel, threads, 0
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        self.spares = [[torch.zeros_like(p) for _ in range(3)] for p in params] if out else None

    def step(self) -> None:
        self.count += 1
        for i, (p, (m, v)) in enumerate(zip(self.params, self.state)):
            spare = self.spares[i] if self.spares else None
            self.kernel.step(p.data, p.grad, m, v, step=float(self.count), lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=0.1, decoupled=True, out=spare, threads=self.threads)
            if spare is not None:
                for current, other in zip((p, m, v), spare):
                    read = current.data
                    current.data = other.data
                    other.data = read


class _EngineStep:
    """The offload engine's host step of bf16 training: bf16 gradients in, the updated master also written
    rounded to bf16 (the copy that goes back to the device), all tensors of a call in one kernel call per
    tensor; ``pin``: the master, the gradient and the bf16 copy in pinned memory, as the engine holds
    them (the moments in pageable memory, as torch's Adam makes them). Its values differ from the fp32-
    gradient arms' (the gradients are rounded to bf16)."""

    def __init__(self, params, kernel, threads: int, pin: bool, parts: bool = False, plain: bool = False) -> None:
        def place(t):
            return t.pin_memory() if pin else t

        self.kernel, self.threads, self.count, self.parts, self.plain = kernel, threads, 0, parts, plain
        self.params = params
        self.masters = [place(p.detach().clone()) for p in params]
        self.grads = [place(p.grad.to(torch.bfloat16)) for p in params]
        self.working = [place(torch.empty(p.shape, dtype=torch.bfloat16)) for p in params]
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def step(self) -> None:
        self.count += 1
        self.kernel.set_chunk(0 if self.parts else 1 << 18)  # parts: one fixed part per thread
        self.kernel.set_stream_half(not self.plain)  # plain: the bf16 copy stored through the caches
        for master, grad, working, (m, v) in zip(self.masters, self.grads, self.working, self.state):
            self.kernel.run([self.kernel.job(master, grad, m, v, step=float(self.count), lr=1e-4, beta1=0.9,
                                             beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                                             working=working)], threads=self.threads)
        self.kernel.set_chunk(1 << 18)
        self.kernel.set_stream_half(True)
        for p, master in zip(self.params, self.masters):
            p.data = master  # the result the fused arm's is compared with


def _spin():
    """``--busy``: a core kept busy (a process of its own, so this one's GIL is not contended), as by a
    thread spinning in ``torch.cuda.synchronize()``."""
    import atexit
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    atexit.register(proc.kill)
    return proc


class _Traffic:
    """``--dma``: copies device -> pinned host and back on a side stream while the host steps."""

    def __init__(self, numel: int) -> None:
        self.device_buf = torch.empty(numel // 2, dtype=torch.float32, device="cuda")
        self.host_buf = torch.empty(numel // 2, dtype=torch.float32).pin_memory()
        self.stream = torch.cuda.Stream()
        self.bytes, self.running = 0, False

    def __enter__(self) -> "_Traffic":
        self.running, self.bytes, self.start = True, 0, time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        with torch.cuda.stream(self.stream):
            while self.running:
                self.host_buf.copy_(self.device_buf, non_blocking=True)
                self.device_buf.copy_(self.host_buf, non_blocking=True)
                self.stream.synchronize()
                self.bytes += 2 * self.host_buf.numel() * 4

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.gb_per_s = self.bytes / (time.perf_counter() - self.start) / 1e9


def host_adam_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, default=476_000_000)
    parser.add_argument("--tensors", type=int, default=8, help="split the elements into this many tensors")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the arms this many times")
    parser.add_argument("--dma", action="store_true", help="PCIe copies to and from pinned host memory meanwhile (CUDA)")
    parser.add_argument("--arms", default="", help="comma-separated subset of the arms (default: all)")
    parser.add_argument("--busy", action="store_true", help="a process spins on a core meanwhile (as a caller "
                        "waiting for its GPU does)")
    parser.add_argument("--bind", action="store_true", help="pin the zeroq kernel's threads to cores 1..threads-1")
    parser.add_argument("--triad", action="store_true", help="the host's memory bandwidth first (STREAM's triad), "
                        "and each arm's share of it")
    parser.add_argument("--triad-threads", default="", help="with --triad: also these thread counts, e.g. 1,4,8")


def host_adam(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sizes = [args.numel // args.tensors] * args.tensors
    base = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    arms = _host_adam_arms(args.threads)
    if args.bind:
        from lightning_zeroq.ops.host_adam import host_adam as kernel_of_this_machine

        kernel = kernel_of_this_machine()
        if kernel is not None:
            kernel.bind(list(range(args.threads)))
    if args.arms:
        arms = {k: v for k, v in arms.items() if k in args.arms.split(",")}
    triad_gb = None
    if args.triad:
        counts = [args.threads] + [int(t) for t in args.triad_threads.split(",") if t and int(t) != args.threads]
        for count in counts:
            for line in _triad(args.numel, count, args.steps):
                print(json.dumps(line), flush=True)
                if count == args.threads and "best_GB_per_s" in line:
                    triad_gb = max(triad_gb or 0.0, line["GB_per_s"])
    traffic = _Traffic(args.numel) if args.dma and torch.cuda.is_available() else None
    if args.busy:
        _spin()
    results: dict[str, list[float]] = {name: [] for name in arms}
    dma: dict[str, list[float]] = {name: [] for name in arms}
    finals: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.rounds):
        for name, make in arms.items():
            params = [torch.nn.Parameter(b.clone()) for b in base]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt = make(params)
            opt.step()  # warm-up: creates the state (and builds DeepSpeed's op on first use)
            for _ in range(args.steps):
                if traffic is not None:
                    with traffic:
                        start = time.perf_counter()
                        opt.step()
                        results[name].append(time.perf_counter() - start)
                    dma[name].append(traffic.gb_per_s)
                else:
                    start = time.perf_counter()
                    opt.step()
                    results[name].append(time.perf_counter() - start)
            finals[name] = [p.detach() for p in params]
            del opt
    reference_arm = finals.get("torch_fused")
    for name, times in results.items():
        median = statistics.median(times)
        diff = (max((a - b).abs().max().item() for a, b in zip(finals[name], reference_arm))
                if reference_arm else None)
        line = {"arm": name, "numel": args.numel, "threads": args.threads, "median_s": round(median, 4),
                "all_s": [round(t, 4) for t in times], "GB_per_s": round(7 * 4 * args.numel / median / 1e9, 2),
                "max_abs_diff_vs_fused": diff}
        if triad_gb:
            line["of_triad"] = round(line["GB_per_s"] / triad_gb, 3)
        if traffic is not None:
            line["dma_GB_per_s"] = round(statistics.median(dma[name]), 1)
        print(json.dumps(line), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- host-muon

HOST_MUON = """Muon's elementwise parts on the host, as offloaded Muon runs them each step: the momentum blend (the bf16
gradient as it landed, times the clipping multiplier; ``buf.lerp_(g, 1 - momentum)``; Nesterov's
``g.lerp(buf, momentum)`` written rounded to bf16 for the device) and the apply of the orthogonalized bf16
update (``p.mul_(1 - lr * wd).add_(u, alpha=-lr)``), with torch's ops (``torch_ops``: what steps where the
kernel does not load) and with lightning_zeroq's host kernel (``zeroq_kernel``: ``csrc/host_adam.c``'s
``zq_muon_blends`` and ``zq_muon_applies``, one pass each), on the same tensors, in one process, alternating.

``--numel`` fp32 elements split into ``--tensors`` tensors, ``--threads`` threads; each arm takes ``--steps``
steps after a warm-up over copies of the same values. A line per arm: the median step time, its bytes per
second counted as the kernel moves them (22 bytes per element: the blend reads the buffer and the bf16
gradient and writes the buffer and the bf16 update, 12; the apply reads the parameter and the bf16 update
and writes the parameter, 10), ``of_triad`` with ``--triad`` (as ``host-adam``'s), and whether the two arms'
parameters, buffers and updates are equal bit for bit.

    python benchmarks/kernels.py host-muon --threads 16 --numel 953223168 --triad
"""


def host_muon_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, default=476_000_000)
    parser.add_argument("--tensors", type=int, default=8, help="split the elements into this many tensors")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the arms this many times")
    parser.add_argument("--triad", action="store_true", help="the host's memory bandwidth first (STREAM's triad)")


MUON_BYTES_PER_ELEMENT = 22
MUON_HYPER = {"momentum": 0.95, "lr": 0.02, "weight_decay": 0.1, "gmul": 0.5}


def _muon_torch_step(params, bufs, grads, updates, outs) -> None:
    from lightning_zeroq.ops.host_adam import muon_apply_reference, muon_blend_reference

    h = MUON_HYPER
    for p, buf, g, u, out in zip(params, bufs, grads, updates, outs):
        out.copy_(muon_blend_reference(buf, g.float().mul_(h["gmul"]), h["momentum"], True))
        muon_apply_reference(p, u, 1 - h["lr"] * h["weight_decay"], h["lr"])


def _muon_kernel_step(kernel, params, bufs, grads, updates, outs) -> None:
    h = MUON_HYPER
    kernel.run_muon([kernel.muon_blend(buf, g, out, momentum=h["momentum"], nesterov=True, gmul=h["gmul"])
                     for buf, g, out in zip(bufs, grads, outs)])
    kernel.run_muon([kernel.muon_apply(p, u, decay=1 - h["lr"] * h["weight_decay"], lr=h["lr"])
                     for p, u in zip(params, updates)])


def host_muon(args: argparse.Namespace) -> int:
    from lightning_zeroq.ops.host_adam import host_adam as kernel_of_this_machine

    kernel = kernel_of_this_machine()
    if kernel is None or not kernel.muon:
        raise SystemExit("host-muon: the host kernel's Muon parts do not load here (see the log); nothing to compare")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sizes = [args.numel // args.tensors] * args.tensors
    base = {"params": [torch.randn(n, generator=gen) for n in sizes],
            "bufs": [torch.randn(n, generator=gen) * 1e-3 for n in sizes],
            "grads": [(torch.randn(n, generator=gen) * 1e-3).bfloat16() for n in sizes],
            "updates": [(torch.randn(n, generator=gen) * 1e-2).bfloat16() for n in sizes]}
    triad_gb = None
    if args.triad:
        for line in _triad(args.numel, args.threads, args.steps):
            print(json.dumps(line), flush=True)
            if "best_GB_per_s" in line:
                triad_gb = max(triad_gb or 0.0, line["GB_per_s"])
    arms = {"torch_ops": _muon_torch_step, "zeroq_kernel": functools.partial(_muon_kernel_step, kernel)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    finals: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.rounds):
        for name, step in arms.items():
            params, bufs = [t.clone() for t in base["params"]], [t.clone() for t in base["bufs"]]
            outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
            step(params, bufs, base["grads"], base["updates"], outs)  # warm-up (the pool's threads start)
            for _ in range(args.steps):
                start = time.perf_counter()
                step(params, bufs, base["grads"], base["updates"], outs)
                times[name].append(time.perf_counter() - start)
            finals[name] = params + bufs + outs
    same = all(torch.equal(a, b) for a, b in zip(finals["torch_ops"], finals["zeroq_kernel"]))
    for name, measured in times.items():
        median = statistics.median(measured)
        line = {"arm": name, "numel": args.numel, "threads": args.threads, "median_s": round(median, 4),
                "all_s": [round(s, 4) for s in measured],
                "GB_per_s": round(MUON_BYTES_PER_ELEMENT * args.numel / median / 1e9, 2), "bitwise_equal": same}
        if triad_gb:
            line["of_triad"] = round(line["GB_per_s"] / triad_gb, 3)
        print(json.dumps(line), flush=True)
    return 0 if same else 1


# ---------------------------------------------------------------------------------------------- cpu-optimizers

CPU_OPTIMIZERS = """Host update throughput of torch's CPU optimizers, the step that CPU/NVMe offload runs on the host.

For each total size (``--params``, split into ``--tensors`` flat fp32 tensors of equal size, random
values and gradients) and each optimizer variant, a fresh optimizer takes ``--warmup`` steps (the
first creates its state) and then ``--steps`` timed steps; throughput = parameters / median step
time. Ratios are against plain AdamW (``foreach=False, fused=False``), the per-tensor loop.

Variants: AdamW ``fused=True`` (what the engine uses), AdamW ``foreach=True``, AdamW plain, Adam
``fused=True`` and ``foreach=True``, SGD with momentum ``foreach=True`` and ``fused=True``::

    python benchmarks/kernels.py cpu-optimizers                        # 10M and 100M parameters, 32 tensors
    python benchmarks/kernels.py cpu-optimizers --params 10e6 30e6 --threads 1
"""

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


def measure_optimizer(name: str, params: list[torch.nn.Parameter], warmup: int, steps: int) -> Measurement:
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


def cpu_optimizers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=float, nargs="+", default=[10e6, 100e6], help="total parameters per run")
    parser.add_argument("--tensors", type=int, default=32, help="tensors the parameters are split into")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))


def cpu_optimizers(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(f"# command: python benchmarks/kernels.py {shlex.join(sys.argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads), Python {platform.python_version()}")
    print(f"# load average at start (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other processes share the cores)")
    print(f"# fp32 parameters split into {args.tensors} tensors; median of {args.steps} steps after {args.warmup} warm-up steps")
    print(f"{'params':>8} {'variant':<22} {'step ms':>9} {'Mparams/s':>10} {'vs ' + BASELINE:>16} {'vs AdamW fused':>15}")
    with torch.no_grad():
        tiny = make_parameters(4096, 4)
        for name in args.variants:  # first-call costs (thread pool start, dispatch) out of the figures
            measure_optimizer(name, tiny, warmup=2, steps=1)
        for total in (int(n) for n in args.params):
            params = make_parameters(total, args.tensors)
            results = {name: measure_optimizer(name, params, args.warmup, args.steps) for name in args.variants}
            baseline = results.get(BASELINE)
            fused = results.get("AdamW fused")
            for r in results.values():
                vs_base = f"{r.params_per_s / baseline.params_per_s:16.2f}" if baseline else f"{'-':>16}"
                vs_fused = f"{r.params_per_s / fused.params_per_s:15.2f}" if fused else f"{'-':>15}"
                print(f"{r.params / 1e6:7.0f}M {r.variant:<22} {r.step_s * 1e3:9.1f} {r.params_per_s / 1e6:10.1f} {vs_base} {vs_fused}")
            del params
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


# ---------------------------------------------------------------------------------------------- int8

INT8 = """Effective bandwidth of the INT8 quantization kernels against a device-to-device copy.

For each input dtype and shard size, measured in the same run:

- ``copy``: ``dst.copy_(src)`` of the input shard (reads and writes ``n * itemsize`` bytes);
- ``quantize_pack``: reads ``n * itemsize``, writes ``n + 4 n / G`` bytes;
- ``unpack_dequantize``: reads ``n + 4 n / G``, writes ``n * itemsize`` bytes.

Effective bandwidth = (bytes read + bytes written) / median time (CUDA events, after warm-up);
``vs copy`` is that bandwidth over the copy's. On a CUDA machine::

    python benchmarks/kernels.py int8                      # 64 Mi and 256 Mi elements
    python benchmarks/kernels.py int8 --numel 100000000 --iters 200 --reference
"""

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


def int8_rows(numel: int, dtype_name: str, group_size: int, warmup: int, iters: int, with_reference: bool) -> list[Row]:
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
        ("quantize_pack", lambda: zeroq.quantize_pack_int8.default(x, group_size, packed), in_bytes + packed_bytes),
        ("unpack_dequantize", lambda: zeroq.unpack_dequantize_int8.default(packed, group_size, out),
         packed_bytes + in_bytes),
    ]
    if with_reference:
        cases += [
            ("ref quantize_pack", lambda: reference.quantize_pack_int8(x, group_size, packed), in_bytes + packed_bytes),
            ("ref unpack_dequantize", lambda: reference.unpack_dequantize_int8(packed, group_size, out),
             packed_bytes + in_bytes),
        ]
    rows = []
    for name, fn, nbytes in cases:
        n_iters = iters if not name.startswith("ref") else max(3, iters // 10)
        rows.append(Row(name, dtype_name, numel, nbytes, time_ms(fn, warmup, n_iters)))
    del x, copy_dst, packed, out
    torch.cuda.empty_cache()
    return rows


def int8_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, nargs="+", default=[64 << 20, 256 << 20], help="shard sizes (elements)")
    parser.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=list(DTYPES))
    parser.add_argument("--group-size", type=int, default=ops.DEFAULT_GROUP_SIZE)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--reference", action="store_true", help="also time the PyTorch reference on CUDA")


def int8(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    backend = ops.load_cuda_backend()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, zeroq: {backend.value}")
    print(f"group_size {args.group_size}; median of {args.iters} iterations after {args.warmup} warm-up")
    print()
    header = f"{'op':<22} {'dtype':<9} {'numel':>12} {'MB moved':>10} {'ms':>9} {'GB/s':>8} {'vs copy':>8}"
    print(header)
    print("-" * len(header))
    for numel in args.numel:
        for dtype_name in args.dtype:
            rows = int8_rows(numel, dtype_name, args.group_size, args.warmup, args.iters, args.reference)
            copy_gbps = rows[0].gbps
            for row in rows:
                print(f"{row.op:<22} {row.dtype:<9} {row.numel:>12} {row.bytes_moved / 1e6:>10.1f} "
                      f"{row.median_ms:>9.4f} {row.gbps:>8.0f} {row.gbps / copy_gbps:>8.2f}")
            print()
    return 0


# ---------------------------------------------------------------------------------------------- readback

READBACK = """How long a few bytes read back from the device wait behind large device-to-host copies in flight.

The offload step copies every gradient shard to the host (3.8 GB on the 953M model) and reads back a
few flags (the agreement on non-finite gradients) before it may step. If the copies start during the
backward, the read-back may queue behind them on the copy engine. This measures, for several ways of
issuing the copies and the read-back, when the flags are readable on the host, counted from the start
of a "backward" of about 30 ms on the compute stream (one unit reduced, and its copy issued, every
30/units ms), and when every copy has landed. Variants: ``nocopy`` (no copies: the floor),
``pageable`` (``.cpu()`` on the compute stream, as the engine reads back), ``pinned`` (non-blocking
into pinned memory, then an event), ``highprio`` (the read-back on a stream of the highest priority),
``chunk`` (each copy in ``--chunk-mib`` pieces), ``lowprio`` (the copies on a low-priority stream),
``mapped`` (no copy at all: a kernel on the compute stream writes the flags into pinned host memory
through its device address, then an event)::

    python benchmarks/kernels.py readback [--gib 3.5] [--units 8]
"""


def _device_spin(ms: float) -> None:
    """About ``ms`` of work on the current stream (a device-side sleep; cycles at about 1.98 GHz)."""
    torch.cuda._sleep(int(ms * 1.98e6))


def mapped_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the pinned host tensor ``host`` (its device address: the same pointer under
    unified addressing), so a kernel writes the host memory directly over PCIe."""
    from lightning_zeroq.zero.comm import device_alias

    return device_alias(host)


def readback_once(variant: str, grads: list[torch.Tensor], hosts: list[torch.Tensor], chunk: int) -> dict:
    dev = grads[0].device
    compute = torch.cuda.current_stream(dev)
    low = torch.cuda.Stream(dev, priority=0)
    high = torch.cuda.Stream(dev, priority=-1)
    copies = low if "lowprio" in variant else torch.cuda.Stream(dev)
    flags_dev = torch.zeros(16, device=dev)
    flags_host = torch.empty(16).pin_memory()
    flags_mapped = torch.zeros(16, dtype=torch.bool).pin_memory()
    torch.cuda.synchronize()
    t_start = time.perf_counter()
    # the "backward": 8 units reduced one after another, each copied as soon as it is reduced
    per_unit_ms = 30.0 / len(grads)
    for g, h in zip(grads, hosts):
        _device_spin(per_unit_ms)
        if "nocopy" in variant:
            continue
        copies.wait_stream(compute)
        with torch.cuda.stream(copies):
            if "chunk" in variant:
                for s in range(0, g.numel(), chunk):
                    h[s : s + chunk].copy_(g[s : s + chunk], non_blocking=True)
            else:
                h.copy_(g, non_blocking=True)
    flags_dev.add_(1.0)
    if "mapped" in variant:
        torch.gt(flags_dev, 0, out=mapped_view(flags_mapped))
        done = torch.cuda.Event()
        done.record(compute)
        done.synchronize()
        assert bool(flags_mapped.all())
        readable = time.perf_counter()
    elif "pageable" in variant:
        flags_dev.cpu()
        readable = time.perf_counter()
    else:
        stream = high if "highprio" in variant else compute
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            flags_host.copy_(flags_dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        readable = time.perf_counter()
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    # the "backward" ends about 30 ms after the start: a read-back that waits for nothing else lands then
    return {"variant": variant, "readback_after_start_ms": round((readable - t_start) * 1e3, 1),
            "all_copies_after_start_ms": round((t_all - t_start) * 1e3, 1)}


def readback_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=3.5)
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--chunk-mib", type=int, default=32)


def readback(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda", 0)
    numel = int(args.gib * 2**30 / 4 / args.units)
    grads = [torch.randn(numel, device=dev) for _ in range(args.units)]
    hosts = [torch.empty(numel).pin_memory() for _ in range(args.units)]
    chunk = args.chunk_mib * 2**20 // 4
    variants = ["nocopy", "mapped", "pageable", "pinned", "pinned_highprio", "chunk_pinned", "chunk_pinned_highprio",
                "chunk_lowprio_pinned_highprio", "lowprio_pinned_highprio"]
    for _ in range(2):
        for v in variants:
            print(json.dumps(readback_once(v, grads, hosts, chunk)), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- the commands

COMMANDS: dict[str, Command] = {"host-adam": (HOST_ADAM, host_adam_arguments, host_adam),
                                "host-muon": (HOST_MUON, host_muon_arguments, host_muon),
                                "cpu-optimizers": (CPU_OPTIMIZERS, cpu_optimizers_arguments, cpu_optimizers),
                                "int8": (INT8, int8_arguments, int8),
                                "readback": (READBACK, readback_arguments, readback)}


def main(argv: list[str] | None = None) -> int:
    return commands.run(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
