"""LoRA fine-tuning step time and memory on one GPU: ZeroQ stage 3 against FSDP2 and DeepSpeed ZeRO-3.

The model is Llama-shaped (``--shape 8b``: dim 4096, 32 layers, 32 heads, 8 KV heads, SwiGLU 14336, vocab
128256; ``30b``, ``70b`` likewise), its base in bf16 and frozen, with LoRA factors of rank ``--rank`` (16) on
every linear of every block (q, k, v, o, gate, up, down), trainable, in bf16 for every arm (each engine keeps
its own optimizer state: ZeroQ fp32 masters and AdamW moments, FSDP2 and DeepSpeed AdamW on the bf16
factors). The embedding and head are frozen. Every block recomputes its forward in the backward
(``torch.utils.checkpoint``, non-reentrant, called inside the block: the same for every arm). A step is one
micro-batch of ``--tokens`` tokens (one sequence), forward, backward, AdamW step.

Arms (world size 1; each arm run in a process of its own, so that its peaks and its host memory are its own
and nothing an earlier arm left behind counts; the arms run in turn, then again in the reverse order, and
the first run is a warm-up of the first arm whose figures are dropped):

- ``zeroq3``: stage 3, the frozen base sharded in its own dtype (at one rank: whole) on the device.
- ``zeroq3+offload``: ``offload_parameters=True``: the base rests in pinned host memory and crosses to the
  device at each gather. ``+int8``: ``frozen_dtype="int8"`` (the base stored as INT8 groups).
- ``fsdp2``: ``fully_shard`` per block and at the root; ``fsdp2+offload``: ``CPUOffloadPolicy``.
- ``ds3``: DeepSpeed ZeRO-3 (bf16, torch AdamW); ``ds3+offload``: ``offload_param`` to pinned CPU memory.

Per arm: median step time over ``--steps`` after ``--warmup``, tokens/s, MFU (FLOPs per token: 4 x frozen +
6 x trainable parameters, plus causal attention 6 x layers x tokens x dim; the recomputation not counted),
peak allocated and reserved device memory (from the first timed step on), host RSS at the end and pinned
host memory as torch's host allocator counts it (ZeroQ pins its buffers itself: its pinned bytes are in the
RSS). One JSON line per arm run::

    python benchmarks/lora_step.py --shape 8b --tokens 4096 --arms zeroq3,zeroq3+offload,fsdp2,fsdp2+offload,ds3,ds3+offload
    python benchmarks/lora_step.py --shape 70b --tokens 4096 --arms zeroq3+offload+int8 --steps 3 --no-repeat

``--layers N`` overrides the shape's depth (a quick check of the script on a small model).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

SHAPES = {  # dim, layers, heads, kv heads, ffn, vocab
    "tiny": (256, 2, 4, 2, 512, 1024),
    "8b": (4096, 32, 32, 8, 14336, 128256),
    "30b": (6656, 60, 52, 52, 17920, 32000),
    "70b": (8192, 80, 64, 8, 28672, 128256),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


class LoraLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in), requires_grad=False)
        self.lora_a = nn.Parameter(torch.empty(rank, d_in))
        self.lora_b = nn.Parameter(torch.empty(d_out, rank))
        self.scale = 2.0

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        nn.init.normal_(self.lora_a, std=0.02)
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv: int, ffn: int, rank: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.q = LoraLinear(dim, dim, rank)
        self.k = LoraLinear(dim, kv * self.hd, rank)
        self.v = LoraLinear(dim, kv * self.hd, rank)
        self.o = LoraLinear(dim, dim, rank)
        self.gate = LoraLinear(dim, ffn, rank)
        self.up = LoraLinear(dim, ffn, rank)
        self.down = LoraLinear(ffn, dim, rank)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Llama(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(dim, heads, kv, ffn, rank) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def build(args: argparse.Namespace, device: torch.device) -> Llama:
    dim, layers, heads, kv, ffn, vocab = SHAPES[args.shape]
    layers = args.layers or layers
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(dim, layers, heads, kv, ffn, vocab, args.rank).to(torch.bfloat16)
    return model


def init_real(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def counts(model: nn.Module) -> tuple[int, int]:
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return frozen, sum(p.numel() for p in model.parameters() if p.requires_grad)


def zeroq_arm(args, options: set[str], dev):
    from lightning_zeroq import ZeroConfig, ZeroEngine

    model = build(args, torch.device("meta"))
    fields: dict = {"stage": 3}
    if "offload" in options:
        fields["offload_parameters"] = True
    if "int8" in options:
        fields["frozen_dtype"] = "int8"
    engine = ZeroEngine(model, ZeroConfig(**fields), param_dtype=torch.bfloat16, device=dev)
    engine.attach_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                              fused=True))

    def step(tokens):
        engine.backward(model(tokens))
        engine.step()

    return model, step, lambda: engine.close()


def fsdp2_arm(args, options: set[str], dev):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = build(args, torch.device("meta"))
    kwargs = {"offload_policy": CPUOffloadPolicy()} if "offload" in options else {}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device="cpu" if "offload" in options else dev)
    if "offload" in options:  # the values do not change the time; a host-side normal_ of 8B elements would
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.001)
    else:
        init_real(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=True)

    def step(tokens):
        model(tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step, lambda: None


def ds3_arm(args, options: set[str], dev):
    import deepspeed

    zero: dict = {"stage": 3}
    if "offload" in options:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": zero, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    model = build(args, dev)
    init_real(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)

    def step(tokens):
        engine.backward(engine(tokens))
        engine.step()

    return model, step, lambda: engine.destroy() if hasattr(engine, "destroy") else None


ARMS: dict[str, Callable] = {"zeroq3": zeroq_arm, "fsdp2": fsdp2_arm, "ds3": ds3_arm}


ONE_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "NCCL_NVLS_ENABLE": "0"}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_rss_gib(key: str = "VmRSS") -> float:
    """The process's resident host memory now (``VmHWM``: its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def pinned_gib() -> float:
    try:
        return torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0) / 2**30
    except Exception:
        return float("nan")


def run_arm(arm: str, args: argparse.Namespace, dev: torch.device, warm_up: bool) -> dict:
    base, *opts = arm.split("+")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, step, close = ARMS[base](args, set(opts), dev)
    built_s = time.perf_counter() - t0
    frozen, trainable = counts(model) if base != "ds3" else ds_counts(model)
    g = torch.Generator(device="cpu").manual_seed(1)
    vocab = SHAPES[args.shape][5]
    times = []
    steps = 1 if warm_up else args.warmup + args.steps
    for i in range(steps):
        tokens = torch.randint(0, vocab, (1, args.tokens), generator=g).to(dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if i == args.warmup - 1:
            torch.cuda.reset_peak_memory_stats()
    timed = times[args.warmup:] if not warm_up else times
    median = sorted(timed)[len(timed) // 2]
    dim, layers = SHAPES[args.shape][0], args.layers or SHAPES[args.shape][1]
    flops = (4 * frozen + 6 * trainable + 6 * layers * args.tokens * dim) * args.tokens
    name = torch.cuda.get_device_name(dev)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), 989e12)
    out = {"arm": arm, "shape": args.shape, "layers": layers, "tokens": args.tokens, "rank": args.rank,
           "frozen_params": frozen, "trainable_params": trainable, "step_s_median": round(median, 4),
           "steps_s": [round(t, 4) for t in timed], "tokens_per_s": round(args.tokens / median, 1),
           "mfu": round(flops / median / peak, 4), "peak_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2), "host_rss_GiB": round(host_rss_gib(), 2),
           "host_peak_rss_GiB": round(host_rss_gib("VmHWM"), 2),
           "pinned_GiB": round(pinned_gib(), 2), "build_s": round(built_s, 1), "device": name,
           "warm_up": warm_up}
    close()
    del model, step, close
    gc.collect()
    torch.cuda.empty_cache()
    return out


def ds_counts(model: nn.Module) -> tuple[int, int]:
    frozen = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if not p.requires_grad)
    return frozen, sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--arms", default="zeroq3,fsdp2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-repeat", action="store_true", help="each arm once (no reverse pass)")
    parser.add_argument("--no-warm", action="store_true", help="no warm-up run of the first arm")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one arm run, in this process
    args = parser.parse_args()
    arms = args.arms.split(",")
    for arm in arms:
        if arm.split("+")[0] not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}: use {sorted(ARMS)} with +offload (+int8 for zeroq3)")
    if args.one is None:
        order = ([] if args.no_warm else [arms[0] + ":warm"]) + arms + ([] if args.no_repeat else arms[::-1])
        for entry in order:
            command = [sys.executable, __file__, *sys.argv[1:], "--one", entry]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ONE_RANK,
                                                                                  "MASTER_PORT": str(free_port())})
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if lines:
                print(lines[-1], flush=True)
            else:
                tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
                print(json.dumps({"arm": entry, "shape": args.shape, "tokens": args.tokens,
                                  "error": f"exit {done.returncode}: " + " | ".join(tail)[-400:]}), flush=True)
        return
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    for entry in [args.one]:
        arm, _, tag = entry.partition(":")
        try:
            result = run_arm(arm, args, dev, warm_up=tag == "warm")
        except torch.OutOfMemoryError as error:
            result = {"arm": arm, "shape": args.shape, "tokens": args.tokens, "error": "device memory: " + str(error).split("\n")[0][:200]}
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as error:  # one arm's failure (a peer's limit) is a result, not the end of the launch
            result = {"arm": arm, "shape": args.shape, "tokens": args.tokens, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
