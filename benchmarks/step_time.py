"""Whole-step time and peak memory of ZeroQ against DDP on a GPT-style model (GPU, NCCL).

The model and setting follow ``shared/reference/peers-and-limits.md`` section 9 so the figures line
up with the peers measured there: d=2048, 16 layers, 16 heads of 128, SwiGLU 5632, RMSNorm, vocab
32000, untied head (953M parameters), random tokens, micro-batch 4 x 1024 per GPU, bf16 autocast,
torch AdamW, median of ``--steps`` steps after ``--warmup``.

One launch per arm (so peak memory is the arm's own):

    torchrun --nproc-per-node 2 benchmarks/step_time.py --arm ddp
    torchrun --nproc-per-node 2 benchmarks/step_time.py --arm zeroq2 [--quantized] [--offload optimizer]

Rank 0 prints one JSON line per arm; ``benchmarks/run_step_time.sh`` runs all arms and links.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), tokens.roll(-1, 1).view(-1))


def memory_bound(engine) -> dict:
    """The memory a ZeRO rank must hold, from the engine's own buffers: sharded state (fp32 master and
    gradient shards, AdamW's two fp32 moments, stage 3's working shard or encoded payload), persistent
    units at full width, and for stage 3 the largest transient unit twice (in use + prefetched)."""
    gib = 2**30
    state = 0
    for unit in engine.units:
        state += unit.master.numel() * (4 + 4 + 8)  # master, grad shard, exp_avg + exp_avg_sq
        if unit.persistent:
            state += unit.flat.numel() * unit.flat.element_size()
        elif unit.encoded is not None:
            state += sum(c.numel() for c in unit.encoded.chunks)
        elif unit.shard is not None:
            state += unit.shard.numel() * unit.shard.element_size()
    transient = [u.flat.numel() * u.flat.element_size() for u in engine.units if not u.persistent]
    largest = max(transient, default=0)
    return {"state_GiB": round(state / gib, 2), "largest_unit_GiB": round(largest / gib, 3),
            "bound_GiB": round((state + 2 * largest) / gib, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arm", choices=["ddp", "zeroq1", "zeroq2", "zeroq3"], required=True)
    parser.add_argument("--quantized", action="store_true")
    parser.add_argument("--offload", choices=["none", "optimizer", "params"], default="none",
                        help="optimizer: fp32 masters and AdamW state on the CPU; params: also stage 3 parameters")
    parser.add_argument("--link", default=os.environ.get("BENCH_LINK", "nvlink"))
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket", type=float, default=2e8)
    args = parser.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.ffn).to(dev)
    num_params = sum(p.numel() for p in model.parameters())
    engine = None

    if args.arm == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(tokens: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        from lightning_zeroq import ZeroConfig, ZeroEngine

        config = ZeroConfig(stage=int(args.arm[-1]), reduce_bucket_size=int(args.bucket),
                            quantized_weights=args.quantized, offload_optimizer=args.offload != "none",
                            offload_parameters=args.offload == "params")
        engine = ZeroEngine(model, config, param_dtype=torch.bfloat16)
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))

        def step(tokens: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens)
            engine.backward(loss, boundary=True)
            engine.step()
            return loss

    g = torch.Generator(device=dev).manual_seed(rank)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev, generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(tokens)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30
    stats = torch.tensor([statistics.median(times), peak, float(loss)], device=dev)
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    if rank == 0:
        arm = args.arm + ("+int8" if args.quantized else "") + ("" if args.offload == "none" else f"+offload_{args.offload}")
        print(json.dumps({
            "arm": arm, "link": args.link, "params_M": round(num_params / 1e6, 1),
            "step_s_median": round(max(float(s[0]) for s in gathered), 4),
            "peak_alloc_GiB_per_rank": [round(float(s[1]), 2) for s in gathered],
            "final_loss": round(float(gathered[0][2]), 4),
            "world_size": dist.get_world_size(), "torch": torch.__version__,
            **(memory_bound(engine) if engine is not None else {}),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
