"""Pretrain a small GPT with Lightning Fabric and ZeroQ, the way LitGPT's pretraining script is written.

On CPU with 2 processes (gloo), no download (the text is Python's own pydoc topics, byte-level)::

    python examples/fabric_pretrain.py                          # ZeRO stage 2, 2 processes
    python examples/fabric_pretrain.py --stage 3 --max-steps 30 # stage 3: the model is built on meta
    torchrun --nproc-per-node 2 examples/fabric_pretrain.py     # or let torchrun make the processes

On GPUs: ``--accelerator cuda --devices 8 --precision bf16-mixed``. Switching an existing Fabric script
from DeepSpeed is the strategy line and the import::

    import lightning_zeroq  # registers "zeroq", "zeroq_stage_1/2/3", "zeroq_stage_2_offload", ...
    fabric = L.Fabric(strategy=ZeroQFabricStrategy(stage=3, offload_optimizer=True), ...)

The loop is the usual Fabric one: the script owns it. One iteration is one micro-batch; every
``--accumulate`` iterations the gradients are clipped and the optimizer steps. Every micro-batch but
the last of a window runs inside ``fabric.no_backward_sync(model, enabled=True)``, which ZeroQ reads
as "this backward does not end the window". With ``--unmanaged`` ZeroQ ignores that hint and does all
end-of-window work inside ``optimizer.step()``, so any number of backward passes may precede a step.
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning_zeroq  # noqa: F401  registers strategy="zeroq..." with Fabric (and the Trainer)
from lightning_zeroq import ZeroQFabricStrategy
from lightning_zeroq.cli.data import TokenWindows, encode_bytes, load_text
from lightning_zeroq.cli.gpt import GPTConfig, GPTModel, OptimConfig, lr_factor


def set_initializers(model: GPTModel) -> None:
    """GPT-2's initialization as each module's ``reset_parameters``: stage 3 builds the model on the meta
    device and the engine calls these as it materializes each unit; the other stages call them here."""

    def normal(module: nn.Module, std: float) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    std = model.cfg.init_std
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.Linear)):
            module.reset_parameters = partial(normal, module, std)
    for block in model.blocks:  # residual projections: scaled so the residual stream does not grow with depth
        for proj in (block.attn.proj, block.mlp.proj):
            proj.reset_parameters = partial(normal, proj, std / math.sqrt(2 * model.cfg.n_layer))


def cycle(loader: DataLoader):
    while True:
        yield from loader  # Fabric's loader sets the sampler's epoch on every pass


def save_checkpoint(fabric: L.Fabric, state: dict, path: Path) -> None:
    """Called every ``--save-interval`` steps on every rank (a collective).

    ``fabric.save`` writes ZeroQ's checkpoint directory: model and optimizer sharded (each rank writes
    its part), the counters beside them. It resumes with ``--resume`` at any world size or stage, and
    ``zeroq-convert`` consolidates its weights into one file.
    """
    fabric.save(path, state)
    fabric.print(f"Saved {path}")


def main(args: argparse.Namespace) -> None:
    strategy = ZeroQFabricStrategy(stage=args.stage, offload_optimizer=args.offload_optimizer,
                                   managed_gradient_accumulation=not args.unmanaged)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                      strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(args.seed)

    # the layers' own initialization here; set_initializers makes GPT-2's their reset_parameters
    cfg = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, init="torch")
    t0 = time.perf_counter()
    with fabric.init_module(empty_init=args.stage == 3):
        model = GPTModel(cfg)
    set_initializers(model)
    if args.stage != 3:
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    fabric.print(f"Built the model in {time.perf_counter() - t0:.2f} s on {next(model.parameters()).device.type};"
                 f" {sum(p.numel() for p in model.parameters()):,} parameters")

    model = fabric.setup(model)  # shards the model; the optimizer is made from its (sharded) parameters
    optim = OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps)
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    others = [p for n, p in model.named_parameters() if p.dim() < 2 or "emb" in n]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": optim.weight_decay},
                                   {"params": others, "weight_decay": 0.0}],
                                  lr=optim.lr, betas=(optim.beta1, optim.beta2))
    optimizer = fabric.setup_optimizers(optimizer)

    data = TokenWindows(encode_bytes(load_text()), args.seq_len)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.micro_batch_size, shuffle=True, drop_last=True))
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    if args.resume is not None:
        fabric.load(args.resume, state)  # weights and AdamW state into the shards, the counters in place
        fabric.print(f"Resumed from {args.resume} at step {state['step_count']} (iter {state['iter_num']})")
    fit(fabric, state, cycle(loader), args, optim)


def fit(fabric: L.Fabric, state: dict, batches, args: argparse.Namespace, optim: OptimConfig) -> None:
    model, optimizer = state["model"], state["optimizer"]
    max_iters = args.max_steps * args.accumulate
    tokens_per_iter = args.micro_batch_size * args.seq_len * fabric.world_size
    running_loss = torch.zeros((), device=fabric.device)
    first_iter, first_step = state["iter_num"], state["step_count"]  # after --resume: counted before this run
    fabric.barrier()
    total_t0 = iter_t0 = time.perf_counter()
    while state["iter_num"] < max_iters:
        lr = optim.lr * lr_factor(state["step_count"], args.max_steps, optim)
        for group in optimizer.param_groups:
            group["lr"] = lr
        state["iter_num"] += 1
        batch = next(batches)
        input_ids, targets = batch[:, :-1], batch[:, 1:]

        is_accumulating = state["iter_num"] % args.accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            fabric.backward(loss / args.accumulate)
        running_loss += loss.detach() / args.accumulate

        if is_accumulating:
            continue
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        state["step_count"] += 1

        if state["step_count"] % args.log_interval == 0:
            loss_value = fabric.all_reduce(running_loss, reduce_op="mean").item()
            step_time = (time.perf_counter() - iter_t0) / args.log_interval
            fabric.print(f"iter {state['iter_num']} step {state['step_count']} | loss train: {loss_value:.3f}"
                         f" | grad norm: {float(grad_norm):.3f} | lr: {lr:.2e} | step time: {step_time * 1000:.1f} ms")
            iter_t0 = time.perf_counter()
        running_loss.zero_()
        if args.save_interval and state["step_count"] % args.save_interval == 0:
            save_checkpoint(fabric, state, args.out_dir / f"step-{state['step_count']:06d}")

    elapsed = time.perf_counter() - total_t0
    iters = state["iter_num"] - first_iter  # tokens/s over the micro-batches this run did, not the resumed ones
    fabric.print(f"Trained {state['step_count']} steps ({state['step_count'] - first_step} in this run, {iters} "
                 f"micro-batches) in {elapsed:.2f} s, {iters * tokens_per_iter / elapsed:,.0f} tokens/s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed or bf16-true")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--offload-optimizer", action="store_true", help="fp32 masters and AdamW state on the host")
    p.add_argument("--unmanaged", action="store_true", help="unmanaged gradient accumulation")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--save-interval", type=int, default=20, help="steps between checkpoints (0: none)")
    p.add_argument("--out-dir", type=Path, default=Path("out/fabric_pretrain"))
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint directory written by this script")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


if __name__ == "__main__":
    main(parse_args())
