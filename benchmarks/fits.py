"""What fits on one GPU and its host: the largest GPT each engine trains (a search over depth), and
``offload="auto"`` under device memory budgets against the best of a grid of hand-picked configurations. Each
trial and each run a process of its own, so one that runs out of memory ends only itself. One command each
(``--help`` after it says what it measures and how)::

    python benchmarks/fits.py largest --arms zeroq3+offload_params,fsdp2+offload_optimizer --checkpoint
    python benchmarks/fits.py auto-offload --batch 16 --seq 1024 --stage 3 --steps 3 --warmup 2

(``largest`` was ``largest_model.py`` and ``auto-offload`` ``auto_offload.py``; their stored results keep those
names.) The configurations the plan proposes are measured by the package itself, ``zeroq-plan --measure`` (and
``--against`` an earlier measurement); ``auto-offload`` runs that harness (``lightning_zeroq.cli.measure``) on what
``zeroq-plan`` does not run: ``offload="auto"`` under a budget, and a grid that holds shares of the optimizer the
plan does not list.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import commands  # noqa: E402
from benchmarks.commands import Command  # noqa: E402
from lightning_zeroq.cli.measure import measure  # noqa: E402


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# ---------------------------------------------------------------------------------------------- largest

LARGEST = """The largest GPT each engine trains on this machine: a search over depth at a fixed width.

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

    python benchmarks/fits.py largest --arms zeroq3+offload_params,fsdp2+offload_optimizer --checkpoint
    python benchmarks/fits.py largest --arms zeroq3+offload_params+nvme --nvme-path /local/swap --checkpoint

``--dry-run N`` replaces the trials by a rule (a depth trains while it is at most N) to check the search.
"""

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
    command = [sys.executable, str(HERE / "step_time.py"), "--arms", arm, "--layers", str(layers), "--dim", str(args.dim),
               "--heads", str(args.heads),
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


def largest_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", required=True, help="comma-separated step_time.py arms")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=at_least_one, default=1)
    parser.add_argument("--seq", type=at_least_one, default=4096)
    parser.add_argument("--steps", type=at_least_one, default=5)
    parser.add_argument("--start", type=at_least_one, default=16, help="the first depth tried")
    parser.add_argument("--max-layers", type=at_least_one, default=128)
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    parser.add_argument("--nvme-path", default=None, help="for +nvme arms")
    parser.add_argument("--trial-timeout", type=at_least_one, default=900, help="seconds per trial")
    parser.add_argument("--dry-run", type=int, default=None, metavar="N", help="no launches: a depth trains while <= N")


def largest(args: argparse.Namespace) -> int:
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



# ---------------------------------------------------------------------------------------------- auto-offload

AUTO_OFFLOAD = """``offload="auto"`` against the best hand-picked configuration under the same device memory budget.

One model and micro-batch, stage 3 (or ``--stage``). First the grid of hand-picked configurations: the
share of the optimizer on the host (0, 0.25, 0.5, 0.75, 1) x every block recomputing or none, and at
stage 3 the parameters on the host too (with all of the optimizer, with and without recomputing): 12
points, each measured (peak allocated and reserved, host, median step). The budgets are shares
(``--budgets``, default 90/70/50/35%) of the no-offload configuration's measured peak allocated. Under
each budget: the best hand-picked point (the fastest whose measured peak fits) and ``offload="auto"``
with ``activation_checkpointing_policy="auto"`` and ``offload_memory_budget`` set to it (its choice, its
measured peak and step). Every run is a process of its own (``lightning_zeroq.cli.measure``), the
``auto`` runs interleaved with the grid's.

    python benchmarks/fits.py auto-offload --dim 2048 --layers 16 --heads 16 --ffn 5632 --batch 8 --seq 1024 \
        --out results.jsonl

``--replay FILE`` runs nothing: it plans the grid points of an earlier ``--out FILE`` with this version
and prints the planned peaks beside the measured ones, and what ``offload="auto"`` would choose under
that file's budgets with the rates given (``--block-ms`` and the like, as ``zeroq-plan`` takes them).
"""

GIB = 2**30


def grid(stage: int) -> list[tuple[str, dict, bool]]:
    points = []
    for share in (0.0, 0.25, 0.5, 0.75, 1.0):
        for ckpt in (False, True):
            fields = {"stage": stage}
            if share:
                fields.update(offload_optimizer=True, offload_optimizer_ratio=share)
            points.append((f"optimizer {share:.0%} host{' +ckpt' if ckpt else ''}", fields, ckpt))
    if stage == 3:
        for ckpt in (False, True):
            points.append((f"params+optimizer host{' +ckpt' if ckpt else ''}",
                           {"stage": 3, "offload_optimizer": True, "offload_parameters": True}, ckpt))
    return points


def auto_offload_arguments(parser: argparse.ArgumentParser) -> None:
    for name, default in (("dim", 2048), ("layers", 16), ("heads", 16), ("ffn", 5632), ("vocab", 32000),
                          ("batch", 8), ("seq", 1024), ("stage", 3), ("steps", 3), ("warmup", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--budgets", default="90,70,50,35", help="shares of the no-offload peak, in per cent")
    parser.add_argument("--out", default=None, help="write every row as JSON lines")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--peak-gib", type=float, default=None,
                        help="the no-offload peak measured before: run only the auto arms (the grid is in an earlier file)")
    parser.add_argument("--replay", default=None, metavar="FILE",
                        help="plan the grid and the auto arms of FILE with this version beside its measurements")
    parser.add_argument("--block-ms", default=None, help="with --replay: one block's forward,forward+backward ms")
    for name, default in (("tflops", 400.0), ("device-tbs", 3.0), ("host-elements-per-s", 5.0e9), ("pcie-gbs", 40.0)):
        parser.add_argument(f"--{name}", type=float, default=default, help="with --replay: the rate to plan with")


def auto_offload(args: argparse.Namespace) -> int:
    gpt = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.dim,
               ffn_hidden=args.ffn, norm="rmsnorm", mlp="swiglu", bias=False, learned_positions=False,
               tie_embeddings=False, init="torch")
    if args.replay:
        return replay(args, gpt)
    base = {"gpt": gpt, "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "steps": args.steps}
    out = open(args.out, "a") if args.out else None

    def run(name: str, fields: dict, ckpt: bool, **extra) -> dict:
        print(f"... {name}", file=sys.stderr, flush=True)
        got = measure({**base, "config": fields, "checkpointing": ckpt}, timeout=args.timeout)
        row = {"arm": name, **extra, **{k: v for k, v in got.items() if k != "chosen_line"}}
        for k in ("allocated_bytes", "reserved_bytes", "host_bytes", "predicted_allocated_bytes"):
            if k in row:
                row[k.replace("_bytes", "_GiB")] = round(row.pop(k) / GIB, 2)
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        return row

    points = grid(args.stage)
    if args.peak_gib is not None:
        points = [points[0]] + [points[0]] * len(args.budgets.split(","))  # placeholders: no grid runs
    measured = [run(*points[0])] if args.peak_gib is None else [{"allocated_GiB": args.peak_gib}]
    peak = measured[0].get("allocated_GiB")
    if peak is None:
        print(f"the no-offload configuration failed: {measured[0].get('error')}", file=sys.stderr)
        return 1
    budgets = [int(b) for b in args.budgets.split(",")]
    autos = []
    for i, point in enumerate(points[1:]):
        if args.peak_gib is None:
            measured.append(run(*point))
        if i < len(budgets):  # interleaved with the grid
            share = budgets[i]
            fields = {"stage": args.stage, "offload": "auto", "activation_checkpointing_policy": "auto",
                      "offload_memory_budget": round(share / 100 * peak, 3)}
            autos.append(run(f"auto {share}%", fields, False, budget_GiB=round(share / 100 * peak, 3)))
    print("\n| budget | auto: choice | auto peak GiB alloc / reserved | auto step s | best hand-picked | its step s | auto / best |")
    print("|---|---|---|---|---|---|---|")
    for auto in autos:
        budget = auto["budget_GiB"]
        fitting = [m for m in measured if "step_s" in m and m["allocated_GiB"] <= budget]
        best = min(fitting, key=lambda m: m["step_s"]) if fitting else None
        if "step_s" not in auto:
            print(f"| {budget} | failed: {auto.get('error')} | | | {best and best['arm']} | | |")
            continue
        ratio = f"{auto['step_s'] / best['step_s']:.3f}" if best else "-"
        print(f"| {budget} | {auto.get('chosen')} | {auto['allocated_GiB']} / {auto['reserved_GiB']} | {auto['step_s']:.4f} | "
              f"{best['arm'] if best else 'none fits'} | {best['step_s'] if best else '-'} | {ratio} |")
    return 0


def replay(args: argparse.Namespace, gpt: dict) -> int:
    """The grid's points planned by this version beside their measured peaks, and ``offload="auto"``'s choice
    under each budget of the file beside the choice measured then."""
    import torch

    from lightning_zeroq import ZeroConfig, choose
    from lightning_zeroq.cli.gpt import GPTConfig
    from lightning_zeroq.cli.plan import gpt_on_meta
    from lightning_zeroq.zero.unit_plan import repeated_blocks
    from lightning_zeroq.planning.estimate import Machine, estimate_config, trace_activations

    rows = [json.loads(line) for line in Path(args.replay).read_text().splitlines() if line.strip()]
    model, forward = gpt_on_meta(GPTConfig(**gpt), args.batch, args.seq, torch.bfloat16)

    block = tuple(float(v) / 1e3 for v in args.block_ms.split(",")) if args.block_ms else None
    machine = Machine(matmul_flops=args.tflops * 1e12, host_step_elements_per_s=args.host_elements_per_s,
                      pcie_bytes_per_s=args.pcie_gbs * 1e9, device_bytes_per_s=args.device_tbs * 1e12,
                      block_seconds=block)
    activations = trace_activations(model, forward, repeated_blocks(model))
    points = {name: (fields, ckpt) for name, fields, ckpt in grid(args.stage)}
    print("| point | allocated GiB planned / measured | reserved GiB planned / measured |\n|---|---|---|")
    for row in rows:
        if row["arm"] in points and "allocated_GiB" in row:
            fields, ckpt = points[row["arm"]]
            need = estimate_config(model, ZeroConfig(**fields), activations, name=row["arm"], tokens=args.batch * args.seq,
                               checkpointing=float(ckpt), machine=machine)
            print(f"| {row['arm']} | {_versus(need.device_total / GIB, row['allocated_GiB'])} | "
                  f"{_versus(need.reserved / GIB, row['reserved_GiB'])} |")
    print("\n| budget GiB | auto chose then (measured peak GiB) | this version chooses (planned peak GiB) |\n|---|---|---|")
    for row in rows:
        if row["arm"].startswith("auto") and "budget_GiB" in row:
            config = ZeroConfig(stage=args.stage, offload="auto", activation_checkpointing_policy="auto",
                                offload_memory_budget=row["budget_GiB"])
            picked = choose(model, config, forward, machine=machine, device=torch.device("cpu"),
                            param_dtype=torch.bfloat16, apply=False)
            need = picked.need
            now = f"{need.name} ({need.device_total / GIB:.2f})" if need is not None else picked.line
            print(f"| {row['budget_GiB']} | {row.get('chosen')} ({row.get('allocated_GiB')}) | {now} |")
    return 0


def _versus(planned: float, measured: float) -> str:
    return f"{planned:.2f} / {measured} ({100 * (planned - measured) / measured:+.0f}%)"


# ---------------------------------------------------------------------------------------------- the commands

COMMANDS: dict[str, Command] = {"largest": (LARGEST, largest_arguments, largest),
                                "auto-offload": (AUTO_OFFLOAD, auto_offload_arguments, auto_offload)}


def main(argv: list[str] | None = None) -> int:
    return commands.run(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
