"""The host AdamW step at offload size: torch's fused CPU AdamW, torch's foreach AdamW and DeepSpeed's
DeepSpeedCPUAdam (AVX, JIT-built) on the same tensors, in one process, alternating.

One rank's share of the 953M GPT under stage-2 optimizer offload on 2 ranks is about 476M fp32
elements (``--numel``). Each arm steps ``--steps`` times after one warm-up step over the same
parameter/gradient/state values (copies), with ``--threads`` intra-op threads; the median step time and
the effective bandwidth (7 fp32 arrays read or written per element: param, grad, exp_avg, exp_avg_sq
read; param, exp_avg, exp_avg_sq written) are printed as JSON lines. The arms also agree on the result:
the largest difference of the updated parameters against the fused arm is reported.

    python benchmarks/host_adam.py --threads 16 --numel 476000000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _arms(threads: int) -> dict:
    arms = {
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True),
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        arms["deepspeed_cpu_adam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, weight_decay=0.1, adamw_mode=True)
    except Exception as error:  # DeepSpeed absent or its op does not build here
        print(json.dumps({"arm": "deepspeed_cpu_adam", "error": f"{type(error).__name__}: {error}"[:300]}), flush=True)
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=476_000_000)
    parser.add_argument("--tensors", type=int, default=8, help="split the elements into this many tensors")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the arms this many times")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sizes = [args.numel // args.tensors] * args.tensors
    base = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    arms = _arms(args.threads)
    results: dict[str, list[float]] = {name: [] for name in arms}
    finals: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.rounds):
        for name, make in arms.items():
            params = [torch.nn.Parameter(b.clone()) for b in base]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt = make(params)
            opt.step()  # warm-up: creates the state (and builds DeepSpeed's op on first use)
            for _ in range(args.steps):
                start = time.perf_counter()
                opt.step()
                results[name].append(time.perf_counter() - start)
            finals[name] = [p.detach() for p in params]
            del opt
    reference = finals.get("torch_fused")
    for name, times in results.items():
        median = statistics.median(times)
        diff = max((a - b).abs().max().item() for a, b in zip(finals[name], reference)) if reference else None
        print(json.dumps({"arm": name, "numel": args.numel, "threads": args.threads, "median_s": round(median, 4),
                          "all_s": [round(t, 4) for t in times], "GB_per_s": round(7 * 4 * args.numel / median / 1e9, 2),
                          "max_abs_diff_vs_fused": diff}), flush=True)


if __name__ == "__main__":
    main()
