"""How far the engine's numbers move from an exact training's: INT8 weight gathers (final loss and parameters
against the same training without), a frozen base stored in bf16 or INT8 (a LoRA fine-tune's loss curves against
the fp32 base's), and the reduction order at AdamW's default eps (ZeRO against DDP beside DDP against itself
summed in reverse rank order). One command each (``--help`` after it says what it measures and how)::

    torchrun --nproc-per-node 2 benchmarks/accuracy.py int8-weights --steps 300 [--stage 3]
    python benchmarks/accuracy.py frozen-dtype --out $OUT/lora_quality.jsonl
    python benchmarks/accuracy.py eps-noise --world-size 3 --stage 3

(``int8-weights`` was ``quant_accuracy.py``, ``frozen-dtype`` ``lora_quality.py`` and ``eps-noise``
``eps_noise.py``; their stored results keep those names.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from pydoc_data.topics import topics
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import commands  # noqa: E402
from benchmarks.commands import Command  # noqa: E402
from benchmarks.step_time import GPT  # noqa: E402
from lightning_zeroq import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zeroq.cli.data import encode_bytes, load_text  # noqa: E402
from lightning_zeroq.cli.gpt import GPTConfig, GPTModel, add_lora  # noqa: E402
from tests.models import RichModel, make_batch, param_groups  # noqa: E402

# ---------------------------------------------------------------------------------------------- int8-weights

INT8_WEIGHTS = """Accuracy of INT8 weight synchronization: the same training with and without ``quantized_weights``.

A byte-level GPT of 135M parameters (d=1024, 8 layers, 16 heads, SwiGLU 4096; see the ``--*`` flags)
on the text of Python's own documentation (``pydoc_data.topics``, shipped with every CPython), ZeRO
stage 2 (``--stage 3`` for stage 3), bf16 working weights, AdamW, identical seeds and data in both
runs. Reports the final loss of both (mean of the last 10 steps), their relative difference, and the
relative L2 difference of the final fp32 parameters.

    torchrun --nproc-per-node 2 benchmarks/accuracy.py int8-weights --steps 300 [--stage 3]
"""

def train_int8(quantized: bool, args: argparse.Namespace, data: torch.Tensor, dev: torch.device):
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


def int8_weights_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)


def int8_weights(args: argparse.Namespace) -> int:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    text = "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()

    plain, plain_params, n = train_int8(False, args, data, dev)
    quant, quant_params, _ = train_int8(True, args, data, dev)
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
    return 0


# ---------------------------------------------------------------------------------------------- frozen-dtype

FROZEN_DTYPE = """What storing a frozen base in bf16 or INT8 (``frozen_dtype``) does to a LoRA fine-tune, on a base the
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

    python benchmarks/accuracy.py frozen-dtype --out benchmarks/results/lora_quality_int8_cpu_2026-12-07.jsonl
"""

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


def frozen_dtype_arguments(parser: argparse.ArgumentParser) -> None:
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


def frozen_dtype(args: argparse.Namespace) -> int:
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
    flags = {k: v for k, v in vars(args).items() if k != "command"}
    lines = [json.dumps({"benchmark": "lora_quality", **flags, **r}) for r in results]
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
    return 0


# ---------------------------------------------------------------------------------------------- eps-noise

EPS_NOISE = """Why the parity tests use AdamW ``eps=1e-3``: the default eps turns last-bit noise into visible drift.

Three data-parallel trainings of the parity model (``tests/models.py``) run in lockstep on the same
micro-batches: DDP as is; DDP whose gradient all-reduce sums the ranks in reverse order (a DDP comm
hook: all-gather the bucket, add from the last rank to the first, divide), which changes nothing but
the last bits of the averaged gradient; and the ZeRO engine. After every step the largest parameter
difference of "DDP reversed" and of "ZeRO" against DDP is printed as a JSON line, for each ``eps``.
If ZeRO's differences at the default eps are of the size of DDP's own against itself, they are
reduction-order noise amplified by Adam (a first step moves an element by about lr * g / (|g| + eps),
so where |g| is near eps a last-bit change in g moves the update by up to lr / eps times as much),
not an engine error.

    python benchmarks/accuracy.py eps-noise --world-size 3 --stage 3                 # CPU, gloo
    python benchmarks/accuracy.py eps-noise --world-size 2 --stage 3 --device cuda   # one GPU per rank, NCCL
"""

BACKWARDS = [2, 5, 3, 1]
STAGE3 = {"stage3_wrap_classes": ["Sequential", "Linear"], "stage3_param_persistence_threshold": 20}


def reverse_order_hook(_state, bucket):  # no annotations: DDP checks them, and these would be strings
    t = bucket.buffer()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    total = parts[-1].clone()
    for part in reversed(parts[:-1]):
        total += part
    total /= len(parts)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(total)
    return fut


def _ddp_loss(ddp: DistributedDataParallel, batch) -> torch.Tensor:
    import torch.nn.functional as F

    tokens, targets, use_sometimes = batch
    logits = ddp(tokens, use_sometimes)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def eps_noise_rank(rank: int, world_size: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    kept: list = []
    for eps in args.eps:
        torch.manual_seed(1234 + rank)
        model = RichModel().to(dev)
        refs = [copy.deepcopy(model), copy.deepcopy(model)]
        ddps = [DistributedDataParallel(r, device_ids=[rank] if cuda else None, find_unused_parameters=True)
                for r in refs]
        ddps[1].register_comm_hook(None, reverse_order_hook)
        opts = [torch.optim.AdamW(param_groups(r), eps=eps) for r in refs]
        engine = ZeroEngine(model, ZeroConfig(stage=args.stage, reduce_bucket_size=300,
                                              **(STAGE3 if args.stage == 3 else {})))
        engine.attach_optimizer(torch.optim.AdamW(param_groups(model), eps=eps))
        for step in range(args.steps):
            n = BACKWARDS[step % len(BACKWARDS)]
            for micro in range(n):
                tokens, targets, use = make_batch(step, micro, rank, uniform=args.stage == 3)
                batch = (tokens.to(dev), targets.to(dev), use)
                engine.backward(model.loss(batch) / n, boundary=micro == n - 1)
                for ddp in ddps:
                    if micro == n - 1:
                        (_ddp_loss(ddp, batch) / n).backward()
                    else:
                        with ddp.no_sync():
                            (_ddp_loss(ddp, batch) / n).backward()
            engine.clip_grad_norm_(0.5)
            for ref, opt in zip(refs, opts):
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
            engine.step()
            full = engine.full_state_dict()
            base = {k: p.detach().cpu() for k, p in refs[0].named_parameters()}
            reversed_diff = max((p.detach().cpu() - base[k]).abs().max().item() for k, p in refs[1].named_parameters())
            diffs = {k: (full[k] - p).abs().max().item() for k, p in base.items()}
            worst = max(diffs, key=diffs.get)
            if rank == 0:
                print(json.dumps({"device": args.device, "eps": eps, "stage": args.stage, "world_size": world_size, "step": step,
                                  "ddp_reversed_vs_ddp": reversed_diff, "zeroq_vs_ddp": diffs[worst],
                                  "zeroq_worst_param": worst}), flush=True)
        engine.close()
        kept.append(ddps)  # never destroyed: see below
    dist.destroy_process_group()
    # DDP's reducers hold the process group; destroying one joins gloo's threads while holding the GIL, and
    # a gloo thread still finishing the comm hook's all-gather waits for the GIL (a torch deadlock, seen on
    # every few runs at exit). The rank has printed all it had: it leaves without running destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def eps_noise_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-8, 1e-3])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")


def eps_noise(args: argparse.Namespace) -> int:
    port = 29500 + os.getpid() % 1000
    mp.spawn(eps_noise_rank, args=(args.world_size, args, port), nprocs=args.world_size)
    return 0


# ---------------------------------------------------------------------------------------------- the commands

COMMANDS: dict[str, Command] = {"int8-weights": (INT8_WEIGHTS, int8_weights_arguments, int8_weights),
                                "frozen-dtype": (FROZEN_DTYPE, frozen_dtype_arguments, frozen_dtype),
                                "eps-noise": (EPS_NOISE, eps_noise_arguments, eps_noise)}


def main(argv: list[str] | None = None) -> int:
    return commands.run(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
