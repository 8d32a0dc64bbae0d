"""``offload="auto"`` against the best hand-picked configuration under the same device memory budget.

One model and micro-batch, stage 3 (or ``--stage``). First the grid of hand-picked configurations: the
share of the optimizer on the host (0, 0.25, 0.5, 0.75, 1) x every block recomputing or none, and at
stage 3 the parameters on the host too (with all of the optimizer, with and without recomputing): 12
points, each measured (peak allocated and reserved, host, median step). The budgets are shares
(``--budgets``, default 90/70/50/35%) of the no-offload configuration's measured peak allocated. Under
each budget: the best hand-picked point (the fastest whose measured peak fits) and ``offload="auto"``
with ``activation_checkpointing_policy="auto"`` and ``offload_memory_budget`` set to it (its choice, its
measured peak and step). Every run is a process of its own (``lightning_zeroq.cli.measure``), the
``auto`` runs interleaved with the grid's.

    python benchmarks/auto_offload.py --dim 2048 --layers 16 --heads 16 --ffn 5632 --batch 8 --seq 1024 \\
        --out results.jsonl

``--replay FILE`` runs nothing: it plans the grid points of an earlier ``--out FILE`` with this version
and prints the planned peaks beside the measured ones, and what ``offload="auto"`` would choose under
that file's budgets with the rates given (``--block-ms`` and the like, as ``zeroq-plan`` takes them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_zeroq.cli.measure import measure  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
