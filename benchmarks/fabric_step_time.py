"""Step time of ZeroQ through Fabric against the Trainer, on the 953M GPT of ``step_time.py``, in one launch.

Modes run one after another in one launch (same machine state, same link), alternating by default so
that drift shows up as a difference between repeats of the same mode::

    torchrun --nproc-per-node 2 benchmarks/fabric_step_time.py --stage 2 --modes fabric,trainer,fabric,trainer

Every mode builds ``step_time.GPT`` (d=2048, 16 layers, SwiGLU, untied head: 953M parameters) from the
same seed, with ``precision="bf16-mixed"`` (bf16 working weights, fp32 master shards, autocast),
``ZeroQ{Fabric,}Strategy(stage=--stage)``, torch AdamW (fused), random tokens (micro-batch
``--batch`` x ``--seq`` per rank, the same samples in both modes), one micro-batch per step. A step is
forward, backward, optimizer step and ``zero_grad``, timed with a device synchronization on both
sides: in the Fabric loop around those calls, in the Trainer from ``on_train_batch_start`` to
``on_train_batch_end`` (the batch is on the device before either). The median of ``--steps`` steps
after ``--warmup``, the slowest rank's, is the mode's figure.

Rank 0 prints one JSON line per mode, then one ``summary`` line: the mean of each mode's medians and
``fabric_over_trainer`` (1.00 = the same; the target is within 3%). Without CUDA this runs on gloo
and the CPU, as a smoke test of the script (pass a small model, e.g. ``--dim 64 --layers 2 --heads 2
--ffn 128 --vocab 256 --seq 32 --batch 2``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from lightning_zeroq import ZeroQFabricStrategy, ZeroQStrategy
from step_time import GPT, ON_GPU, add_model_arguments, allocated_gib, sync

MODES = ("fabric", "trainer")


class RandomTokens(Dataset):
    """Sample ``i`` is the same random token sequence in every mode and on every run."""

    def __init__(self, n: int, vocab: int, seq: int) -> None:
        self.n, self.vocab, self.seq = n, vocab, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))


def build_model(args: argparse.Namespace) -> GPT:
    """On the host, from one seed, in both modes; the engine moves it to the GPU unit by unit."""
    torch.manual_seed(0)
    return GPT(args.vocab, args.dim, args.layers, args.heads, args.ffn)


def loader(args: argparse.Namespace) -> DataLoader:
    """The same samples on the same rank in both modes (the Trainer would shuffle with its own sampler)."""
    n = (args.warmup + args.steps) * args.batch * dist.get_world_size()
    data = RandomTokens(n, args.vocab, args.seq)
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False)
    return DataLoader(data, batch_size=args.batch, sampler=sampler)


def run_fabric(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    accelerator = "cuda" if ON_GPU else "cpu"
    fabric = L.Fabric(accelerator=accelerator, devices=dist.get_world_size(), precision="bf16-mixed",
                      strategy=ZeroQFabricStrategy(stage=args.stage, reduce_bucket_size=int(args.bucket)))
    fabric.launch()
    model = fabric.setup(build_model(args))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    times, losses = [], []
    for tokens in fabric.setup_dataloaders(loader(args), use_distributed_sampler=False):
        sync()
        t0 = time.perf_counter()
        loss = model(tokens)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    fabric.strategy.teardown()
    return times, losses


class _Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self.t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        sync()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sync()
        self.times.append(time.perf_counter() - self.t0)
        self.losses.append(float(outputs["loss"]))


class _LitGPT(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.model = build_model(args)

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(tokens)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


def run_trainer(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    timer = _Timer()
    trainer = L.Trainer(accelerator="cuda" if ON_GPU else "cpu", devices=dist.get_world_size(),
                        precision="bf16-mixed",
                        strategy=ZeroQStrategy(stage=args.stage, reduce_bucket_size=int(args.bucket)),
                        max_steps=args.warmup + args.steps, callbacks=[timer], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(_LitGPT(args), loader(args))
    return timer.times, timer.losses


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    leftover = allocated_gib()
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    times, losses = (run_fabric if mode == "fabric" else run_trainer)(args)
    gc.collect()
    peak = allocated_gib(peak=True)
    if ON_GPU:
        torch.cuda.empty_cache()
    dev = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    stats = torch.tensor([statistics.median(times[args.warmup:]), peak, leftover], device=dev)
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    return {
        "mode": mode, "stage": args.stage, "link": args.link,
        "step_s_median": round(max(float(s[0]) for s in gathered), 4),
        "peak_alloc_GiB_per_rank": [round(float(s[1]), 2) for s in gathered],
        "leftover_GiB": round(max(float(s[2]) for s in gathered), 3),
        "first_loss": round(losses[0], 4), "final_loss": round(losses[-1], 4),
        "steps": args.steps, "warmup": args.warmup, "world_size": dist.get_world_size(), "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="fabric,trainer,fabric,trainer", help="comma-separated, run in order")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    add_model_arguments(parser, steps=20, warmup=5)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        raise SystemExit(f"unknown mode in {args.modes!r}: use {', '.join(MODES)}")
    if ON_GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if ON_GPU else "gloo")  # Fabric and the Trainer join it
    results = []
    for mode in modes:
        results.append(run_mode(mode, args))
        if dist.get_rank() == 0:
            print(json.dumps(results[-1]), flush=True)
    medians = {m: [r["step_s_median"] for r in results if r["mode"] == m] for m in MODES}
    if dist.get_rank() == 0 and all(medians.values()):
        fabric, trainer = (statistics.mean(medians[m]) for m in MODES)
        print(json.dumps({"summary": True, "stage": args.stage, "fabric_step_s": round(fabric, 4),
                          "trainer_step_s": round(trainer, 4), "fabric_over_trainer": round(fabric / trainer, 4),
                          "within_3pct": abs(fabric / trainer - 1) <= 0.03, "repeats": medians}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
