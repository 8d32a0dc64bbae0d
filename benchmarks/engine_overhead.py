"""The engine's own cost per unit and step, where compute is negligible: a deep, narrow model (``--units``
residual blocks of ``--linears`` ``--width``-square Linears, each block a unit) on the CPU, one thread, one rank
(gloo), so a step is the engine's Python and its small per-unit kernels. Arms: ``plain`` (no engine:
the model with torch's foreach AdamW), ``zeroq2``, ``zeroq3`` (every block a transient unit). The
overhead per unit is an arm's step time less ``plain``'s, over the units.

Two checkouts side by side (``--repos BEFORE,AFTER``): each round runs one process per checkout, in
alternating order, every arm in each; the table gives the medians over rounds and AFTER / BEFORE.

    python benchmarks/engine_overhead.py --repos /tmp/before,. --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ARMS = ("plain", "zeroq2", "zeroq3")


def _worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.abspath(args.repo))
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_zeroq import ZeroConfig, ZeroEngine

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    width = args.width

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(args.linears))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x
            for layer in self.layers:
                h = torch.tanh(layer(h))
            return x + h

    def step_fn(arm: str):
        torch.manual_seed(0)
        model = nn.Sequential(*[Block() for _ in range(args.units)])
        x = torch.randn(8, width)
        if arm == "plain":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

            def plain() -> None:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            return plain
        stage = int(arm[-1])
        options = ({"stage3_wrap_classes": ["Block"], "stage3_param_persistence_threshold": 0} if stage == 3
                   else {"reduce_bucket_size": args.linears * (width * width + width)})
        engine = ZeroEngine(model, ZeroConfig(stage=stage, **options))
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))

        def zeroq() -> None:
            engine.backward(model(x).pow(2).mean())
            engine.step()
        return zeroq

    out = {}
    for arm in args.arms.split(","):
        step = step_fn(arm)
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out[arm] = statistics.median(times)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repos", default=".", help="comma-separated checkouts to compare, alternating")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--units", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--linears", type=int, default=1, help="Linears per block (two parameters each)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repo", default=".", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29571, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("units", "width", "linears", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be at least 1")
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        parser.error(f"--arms: {unknown} unknown; use some of {', '.join(ARMS)}")
    if args.worker:
        _worker(args)
        return
    repos = args.repos.split(",")
    missing = [r for r in repos if not os.path.isdir(os.path.join(r, "lightning_zeroq"))]
    if missing:
        parser.error(f"--repos: {missing} hold no lightning_zeroq package; pass checkouts of this repository")
    runs: dict[str, dict[str, list[float]]] = {r: {a: [] for a in args.arms.split(",")} for r in repos}
    for round_ in range(args.rounds):
        order = repos if round_ % 2 == 0 else list(reversed(repos))
        for repo in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--repo", repo, "--arms", args.arms,
                   "--units", str(args.units), "--width", str(args.width), "--linears", str(args.linears),
                   "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--port", str(args.port + round_)]
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            line = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
            for arm, seconds in json.loads(line).items():
                runs[repo][arm].append(seconds)
            print(f"round {round_ + 1}/{args.rounds} {repo}: {line}", file=sys.stderr, flush=True)
    medians = {r: {a: statistics.median(v) for a, v in arms.items()} for r, arms in runs.items()}
    for repo in repos:
        m = medians[repo]
        row = {"repo": repo, "units": args.units, "linears": args.linears, **{f"{a}_ms": round(v * 1e3, 3) for a, v in m.items()}}
        if "plain" in m:
            row.update({f"{a}_per_unit_us": round((v - m["plain"]) / args.units * 1e6, 1)
                        for a, v in m.items() if a != "plain"})
        print(json.dumps(row))
    if len(repos) == 2:
        before, after = medians[repos[0]], medians[repos[1]]
        print(json.dumps({"after_over_before": {a: round(after[a] / before[a], 3) for a in before}}))


if __name__ == "__main__":
    main()
