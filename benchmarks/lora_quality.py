"""What storing a frozen base in bf16 or INT8 (``frozen_dtype``) does to a LoRA fine-tune, on a base the
project trains itself (nothing is downloaded): the loss curves side by side.

1. Pretrain the demo GPT (``lightning_zeroq.cli.gpt``: byte tokens, the pydoc text that ships with Python)
   for ``--pretrain-steps`` steps on the first 90% of the text, plain PyTorch AdamW, fp32.
2. Freeze it, put LoRA factors of rank ``--rank`` on every linear of its blocks (``add_lora``), and fine-tune
   them for ``--steps`` steps on the held-out 10% with ZeroQ stage 3 (one process, CPU, gloo), once per
   storage of the frozen base: ``fp32`` (the base as it is: the reference), ``bf16``, ``int8``; every arm
   sees the same batches in the same order and starts from the same factors.
3. Report each arm's training loss per step, and its loss on a fixed held-out evaluation set (windows the
   fine-tune never trains on) before and after.

Prints one JSON line per arm (``losses``: every step's) and a summary line::

    python benchmarks/lora_quality.py --out benchmarks/results/lora_quality_int8_cpu_2026-12-07.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.cli.data import encode_bytes, load_text
from lightning_zeroq.cli.gpt import GPTConfig, GPTModel, add_lora

STORAGE = {"fp32": None, "bf16": "bf16", "int8": "int8"}


def windows(tokens: torch.Tensor, seq: int) -> torch.Tensor:
    n = (tokens.numel() - 1) // (seq + 1)
    return tokens[: n * (seq + 1)].view(n, seq + 1)


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def pretrain(cfg: GPTConfig, data: torch.Tensor, steps: int, batch: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = GPTModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        rows = data[torch.randint(0, data.shape[0], (batch,), generator=g)]
        loss = loss_of(model, rows)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(json.dumps({"pretrain_step": step, "loss": round(loss.item(), 4)}), flush=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def evaluate(model: torch.nn.Module, engine: ZeroEngine, held: torch.Tensor) -> float:
    return sum(loss_of(model, held[i: i + 16]).item() for i in range(0, held.shape[0], 16)) / -(-held.shape[0] // 16)


def fine_tune(cfg: GPTConfig, base: dict, storage: str, train: torch.Tensor, held: torch.Tensor,
              args: argparse.Namespace) -> dict:
    model = GPTModel(cfg)
    model.load_state_dict(base)
    torch.manual_seed(args.seed + 1)  # the same factors in every arm
    add_lora(model, args.rank, args.alpha)
    exact = {"quantized_weights_exact_numel": args.exact_numel} if storage == "int8" else {}
    config = ZeroConfig(stage=3, frozen_dtype=STORAGE[storage], **exact)
    engine = ZeroEngine(model, config)
    engine.attach_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr))
    before = evaluate(model, engine, held)
    g = torch.Generator().manual_seed(args.seed + 2)  # the same batches in every arm
    losses = []
    started = time.perf_counter()
    for _ in range(args.steps):
        rows = train[torch.randint(0, train.shape[0], (args.batch,), generator=g)]
        loss = loss_of(model, rows)
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 5))
    after = evaluate(model, engine, held)
    stored = engine.parts.frozen.stored_bytes if engine.parts.frozen is not None else 0
    engine.close()
    return {"storage": storage, "frozen_stored_bytes": stored, "eval_before": round(before, 5),
            "eval_after": round(after, 5), "final_train_loss": losses[-1], "losses": losses,
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--exact-numel", type=int, default=1024,
                        help="quantized_weights_exact_numel: tensors this small stay exact (the biases, norms)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    tokens = encode_bytes(load_text())
    cut = int(tokens.numel() * 0.9)
    pre, post = windows(tokens[:cut], args.seq), windows(tokens[cut:], args.seq)
    held, train = post[:32], post[32:]  # the evaluation windows: never trained on
    cfg = GPTConfig(block_size=args.seq, n_layer=4, n_embd=128, n_head=4)
    base = pretrain(cfg, pre, args.pretrain_steps, args.batch, args.seed)
    results = [fine_tune(cfg, base, storage, train, held, args) for storage in STORAGE]
    lines = [json.dumps({"benchmark": "lora_quality", **vars(args), **r}) for r in results]
    reference = results[0]["losses"]
    summary = {"summary": True, **{r["storage"]: {"eval_before": r["eval_before"], "eval_after": r["eval_after"],
                                                  "max_step_loss_diff_vs_fp32": round(max(abs(a - b) for a, b in zip(r["losses"], reference)), 5)}
                                   for r in results}}
    lines.append(json.dumps(summary))
    for line in lines:
        print(line if len(line) < 400 else line[:400] + "...", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
