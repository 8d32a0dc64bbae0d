"""The largest GPT each engine trains on this machine: a search over depth at a fixed width.

Each trial is one launch of ``step_time.py`` with one arm and one depth (one rank, ``--steps`` steps after
one warm-up step, bf16, AdamW), in a process of its own, so a trial that runs out
of memory (the device's, the host's: our engine's one-line ``HostMemoryError``, or the kernel's OOM killer
for an engine that does not check) ends only itself. A trial trains if it prints its result line; else
its reason is read from its output (``device memory``, ``host memory``, ``killed`` (SIGKILL: the OOM
killer), ``disk``, ``timeout``, or the last line it printed).

Per arm: start at ``--start`` layers, double while it trains, then bisect between the deepest that
trained and the shallowest that did not (``--max-layers`` bounds the search). Prints one JSON line per
trial and one per arm: the deepest that trained, its parameters, tokens/s and MFU, and why the next
depth failed. The width defaults to a Llama-7B-like block (dim 4096, 32 heads, SwiGLU 11008, vocab 32000:
about 202M parameters per layer; 32 layers are 6.7B parameters).

    python benchmarks/largest_model.py --arms zeroq3+offload_params,fsdp2+offload_optimizer --checkpoint
    python benchmarks/largest_model.py --arms zeroq3+offload_params+nvme --nvme-path /local/swap --checkpoint

``--dry-run N`` replaces the trials by a rule (a depth trains while it is at most N) to check the search.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
REASONS = (  # (text in a failed trial's output, the reason reported); the first that matches
    ("HostMemoryError", "host memory (checked before launch)"),
    ("OutOfMemoryError", "device memory"),
    ("CUDA out of memory", "device memory"),
    ("NvmeSwapper", "disk"),
    ("No space left", "disk"),
    ("MemoryError", "host memory"),
)


# One rank without torchrun: the trial's own output and exit status come back as they are.
ONE_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "NCCL_NVLS_ENABLE": "0"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def params_of(layers: int, dim: int, ffn: int, vocab: int) -> int:
    """The step_time GPT's parameters: per block attention 4 dim^2, SwiGLU 3 dim ffn, two RMSNorm
    weights; token embedding and an untied head; the final norm."""
    return layers * (4 * dim * dim + 3 * dim * ffn + 2 * dim) + 2 * vocab * dim + dim


def trial_command(arm: str, layers: int, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, str(HERE / "step_time.py"), "--arms", arm, "--layers", str(layers), "--dim", str(args.dim), "--heads", str(args.heads),
               "--ffn", str(args.ffn), "--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq),
               "--steps", str(args.steps), "--warmup", "1"]
    if args.checkpoint:
        command.append("--checkpoint")
    if arm.startswith("zeroq"):
        command.append("--meta")  # never the whole model on the device: the engine materializes unit by unit
    if args.nvme_path:
        command += ["--nvme-path", args.nvme_path]
    return command


def run_trial(arm: str, layers: int, args: argparse.Namespace) -> dict:
    """One launch; its result line, or why it did not train."""
    started = time.perf_counter()
    try:
        done = subprocess.run(trial_command(arm, layers, args), capture_output=True, text=True,
                              timeout=args.trial_timeout, env={**os.environ, **ONE_RANK, "MASTER_PORT": str(free_port())})
    except subprocess.TimeoutExpired:
        return {"trains": False, "reason": "timeout", "wall_s": round(time.perf_counter() - started, 1)}
    wall = round(time.perf_counter() - started, 1)
    for line in done.stdout.splitlines():
        if line.startswith("{") and f'"arm": "{arm}"' in line:
            return {"trains": done.returncode == 0, "wall_s": wall, **json.loads(line)}
    output = done.stdout + done.stderr
    if done.returncode in (-9, 137):
        reason = "killed (SIGKILL: the OOM killer?)"
    else:
        reason = next((r for text, r in REASONS if text in output), None) or \
            (output.strip().splitlines() or ["no output"])[-1][-300:]
    return {"trains": False, "reason": reason, "returncode": done.returncode, "wall_s": wall}


def search(trains: Callable[[int], dict], start: int, most: int) -> tuple[Optional[int], dict[int, dict]]:
    """The deepest depth in [1, ``most``] that trains, assuming training is monotone in depth: double from
    ``start``, then bisect; every trial's result by depth."""
    tried: dict[int, dict] = {}

    def ok(layers: int) -> bool:
        if layers not in tried:
            tried[layers] = trains(layers)
        return bool(tried[layers]["trains"])

    low, high = 0, None  # deepest that trained, shallowest that did not
    layers = max(1, min(start, most))
    while high is None:
        if ok(layers):
            low = layers
            if layers >= most:
                return low, tried
            layers = min(2 * layers, most)
        else:
            high = layers
    if low == 0:  # the start failed: bisect below it
        while high > 1 and not ok(high // 2):
            high //= 2
        if high == 1:
            return None, tried
        low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        if ok(middle):
            low = middle
        else:
            high = middle
    return low, tried


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", required=True, help="comma-separated step_time.py arms")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--start", type=int, default=16, help="the first depth tried")
    parser.add_argument("--max-layers", type=int, default=128)
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    parser.add_argument("--nvme-path", default=None, help="for +nvme arms")
    parser.add_argument("--trial-timeout", type=int, default=900, help="seconds per trial")
    parser.add_argument("--dry-run", type=int, default=None, metavar="N", help="no launches: a depth trains while <= N")
    args = parser.parse_args(argv)
    for name in ("start", "max_layers", "steps", "trial_timeout", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    for arm in args.arms.split(","):
        def trains(layers: int, arm: str = arm) -> dict:
            if args.dry_run is not None:
                result = {"trains": layers <= args.dry_run, "reason": None if layers <= args.dry_run else "dry run"}
            else:
                result = run_trial(arm, layers, args)
            params = params_of(layers, args.dim, args.ffn, args.vocab)
            print(json.dumps({"trial": arm, "layers": layers, "params_B": round(params / 1e9, 2), **result}), flush=True)
            return result

        deepest, tried = search(trains, args.start, args.max_layers)
        above = tried.get(deepest + 1 if deepest else 1) or next(
            (tried[d] for d in sorted(tried) if deepest is None or d > deepest), {})
        best = tried.get(deepest, {}) if deepest else {}
        print(json.dumps({
            "arm": arm, "deepest_layers": deepest,
            "params_B": round(params_of(deepest, args.dim, args.ffn, args.vocab) / 1e9, 2) if deepest else None,
            "tokens_per_s": best.get("tokens_per_s"), "mfu": best.get("mfu"),
            "peak_reserved_GiB": best.get("peak_reserved_GiB_per_rank"), "host_rss_GiB": best.get("host_rss_GiB_per_rank"),
            "next_fails_because": above.get("reason"), "trials": len(tried),
            "width": {"dim": args.dim, "heads": args.heads, "ffn": args.ffn, "vocab": args.vocab},
            "tokens_per_step": args.batch * args.seq, "checkpoint": args.checkpoint,
        }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
