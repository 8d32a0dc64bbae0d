"""Accuracy of INT8 weight synchronization: the same training with and without ``quantized_weights``.

A byte-level GPT of 135M parameters (d=1024, 8 layers, 16 heads, SwiGLU 4096; see the ``--*`` flags)
on the text of Python's own documentation (``pydoc_data.topics``, shipped with every CPython), ZeRO
stage 2 (``--stage 3`` for stage 3), bf16 working weights, AdamW, identical seeds and data in both
runs. Reports the final loss of both (mean of the last 10 steps), their relative difference, and the
relative L2 difference of the final fp32 parameters.

    torchrun --nproc-per-node 2 benchmarks/quant_accuracy.py --steps 300 [--stage 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from pydoc_data.topics import topics

sys.path.insert(0, os.path.dirname(__file__))
from step_time import GPT  # noqa: E402

from lightning_zeroq import ZeroConfig, ZeroEngine  # noqa: E402


def train(quantized: bool, args: argparse.Namespace, data: torch.Tensor, dev: torch.device):
    torch.manual_seed(0)
    model = GPT(256, args.dim, args.layers, args.heads, args.ffn).to(dev)
    engine = ZeroEngine(model, ZeroConfig(stage=args.stage, quantized_weights=quantized), param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
    g = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=g)
        tokens = torch.stack([data[s : s + args.seq] for s in starts.tolist()]).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens)
        engine.backward(loss, boundary=True)
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(float(loss))
    return losses, engine.full_state_dict(), sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    text = "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()

    plain, plain_params, n = train(False, args, data, dev)
    quant, quant_params, _ = train(True, args, data, dev)
    num = sum(float((plain_params[k] - quant_params[k]).pow(2).sum()) for k in plain_params)
    den = sum(float(plain_params[k].pow(2).sum()) for k in plain_params)
    final_plain, final_quant = sum(plain[-10:]) / 10, sum(quant[-10:]) / 10
    if dist.get_rank() == 0:
        print(json.dumps({
            "stage": args.stage, "params_M": round(n / 1e6, 1), "steps": args.steps, "text_bytes": data.numel(),
            "first_loss": round(plain[0], 4),
            "final_loss_plain": round(final_plain, 4), "final_loss_int8": round(final_quant, 4),
            "final_loss_rel_diff": round(abs(final_quant - final_plain) / final_plain, 5),
            "param_rel_l2_diff": round((num / den) ** 0.5, 5),
            "loss_curve_every_50_plain": [round(x, 3) for x in plain[::50]],
            "loss_curve_every_50_int8": [round(x, 3) for x in quant[::50]],
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
