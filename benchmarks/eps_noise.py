"""Why the parity tests use AdamW ``eps=1e-3``: the default eps turns last-bit noise into visible drift.

Three data-parallel trainings of the parity model (``tests/models.py``) run in lockstep on the same
micro-batches: DDP as is; DDP whose gradient all-reduce sums the ranks in reverse order (a DDP comm
hook: all-gather the bucket, add from the last rank to the first, divide), which changes nothing but
the last bits of the averaged gradient; and the ZeRO engine. After every step the largest parameter
difference of "DDP reversed" and of "ZeRO" against DDP is printed as a JSON line, for each ``eps``.
If ZeRO's differences at the default eps are of the size of DDP's own against itself, they are
reduction-order noise amplified by Adam (a first step moves an element by about lr * g / (|g| + eps),
so where |g| is near eps a last-bit change in g moves the update by up to lr / eps times as much),
not an engine error.

    python benchmarks/eps_noise.py --world-size 3 --stage 3                 # CPU, gloo
    python benchmarks/eps_noise.py --world-size 2 --stage 3 --device cuda   # one GPU per rank, NCCL
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_zeroq import ZeroConfig, ZeroEngine  # noqa: E402
from tests.models import RichModel, make_batch, param_groups  # noqa: E402

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


def run(rank: int, world_size: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
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
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-8, 1e-3])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    port = 29500 + os.getpid() % 1000
    mp.spawn(run, args=(args.world_size, args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
