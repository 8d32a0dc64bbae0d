"""The host AdamW step at offload size: torch's fused CPU AdamW, torch's foreach AdamW, DeepSpeed's
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

``--dma`` (CUDA): while each arm steps, a side stream copies a gradient-sized buffer from the GPU to
pinned host memory and the masters back, again and again, as an offload step's PCIe traffic lands in
host memory beside the host step; the copies' bandwidth is reported per arm.

    python benchmarks/host_adam.py --threads 16 --numel 953223168 --dma
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch


def _arms(threads: int) -> dict:
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
    import sys

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sizes = [args.numel // args.tensors] * args.tensors
    base = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    arms = _arms(args.threads)
    if args.bind:
        from lightning_zeroq.ops.host_adam import host_adam

        kernel = host_adam()
        if kernel is not None:
            kernel.bind(list(range(args.threads)))
    if args.arms:
        arms = {k: v for k, v in arms.items() if k in args.arms.split(",")}
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
    reference = finals.get("torch_fused")
    for name, times in results.items():
        median = statistics.median(times)
        diff = max((a - b).abs().max().item() for a, b in zip(finals[name], reference)) if reference else None
        line = {"arm": name, "numel": args.numel, "threads": args.threads, "median_s": round(median, 4),
                "all_s": [round(t, 4) for t in times], "GB_per_s": round(7 * 4 * args.numel / median / 1e9, 2),
                "max_abs_diff_vs_fused": diff}
        if traffic is not None:
            line["dma_GB_per_s"] = round(statistics.median(dma[name]), 1)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
