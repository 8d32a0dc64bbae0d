"""Write the DeepSpeed checkpoints the tests read (``tests/integration/checkpoint/test_deepspeed.py``), with
the real DeepSpeed: one launch per configuration, 2 ranks (``RANKS``) unless the configuration names
its own, a small model, 3 steps of AdamW (one parameter group, DeepSpeed 0.19.8's
``safe_get_full_optimizer_state`` having found no state in a second one; two in the stage-3 configuration
below, where it finds both), then
``save_checkpoint``; beside each checkpoint ``reference.pt``: every trained parameter's fp32 value and
Adam moments as DeepSpeed's own API gives them whole (``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``), and the step count.

The configurations with ``FEATURES`` also freeze some parameters (``reference.pt``'s ``frozen``: their
values, gathered whole), tie the head to the embedding (``tied``: the name DeepSpeed does not store and
the one it does), and at stage 3 split the parameters into two groups (``groups``: each one's names,
``lr`` and ``weight_decay``) and each group into sub-groups (DeepSpeed closes one once it holds
``sub_group_size`` elements per rank); beside them ``zero_to_fp32.pt``: what DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``
makes of the checkpoint. Run from the repository root, where DeepSpeed is installed (on a machine
without a GPU: ``DS_ACCELERATOR=cpu``, gloo)::

    DS_ACCELERATOR=cpu python tests/data/deepspeed/make_fixtures.py

The files are kept in the repository (under 1 MiB in all); the versions that wrote them are in
``VERSIONS.json`` beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = [  # (name, stage, dtype, offload)
    ("stage1_fp32", 1, "fp32", False),
    ("stage2_bf16", 2, "bf16", False),
    ("stage2_fp16", 2, "fp16", False),
    ("stage3_bf16", 3, "bf16", False),
    ("stage3_fp32", 3, "fp32", False),
    ("stage2_bf16_offload", 2, "bf16", True),
    ("stage3_bf16_offload", 3, "bf16", True),
    ("stage1_frozen_tied", 1, "fp32", False),
    ("stage2_frozen_tied_3ranks", 2, "bf16", False),
    ("stage3_frozen_tied_subgroups_3ranks", 3, "bf16", False),
]
FEATURES = {  # name -> ranks, frozen parameters, tied head, two parameter groups, sub_group_size
    "stage1_frozen_tied": {"ranks": 2, "frozen": ("blocks.0.weight", "norm.bias"), "tied": True},
    "stage2_frozen_tied_3ranks": {"ranks": 3, "frozen": ("blocks.0.weight", "norm.bias"), "tied": True},
    "stage3_frozen_tied_subgroups_3ranks": {"ranks": 3, "frozen": ("blocks.0.weight", "norm.bias"), "tied": True,
                                            "groups": True, "sub_group_size": 100},
}
VOCAB, DIM = 32, 16
RANKS = os.environ.get("RANKS", "2")
"""Processes per launch (NCCL takes one GPU per process: ``RANKS=1`` on a machine of one GPU)."""


def train(name: str, stage: int, dtype: str, offload: bool) -> None:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from torch import nn

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.Sequential(nn.Linear(DIM, 24), nn.GELU(), nn.Linear(24, DIM))
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens):
            return self.head(self.norm(self.blocks(self.embed(tokens))))

    features = FEATURES.get(name, {})
    model = Net()
    if features:  # the frozen norm.bias not its initial zeros: a reader that leaves it out cannot pass for one that reads it
        with torch.no_grad():
            model.norm.bias.uniform_(-0.5, 0.5)
    if features.get("tied"):
        model.head.weight = model.embed.weight
    for n, p in model.named_parameters():
        p.requires_grad_(n not in features.get("frozen", ()))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if "sub_group_size" in features:
        zero["sub_group_size"] = features["sub_group_size"]
    config: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero,
                    "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    if dtype != "fp32":
        config[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    optimizer = None
    if offload:  # DeepSpeed's own CPU Adam (its C++ kernel, built on first use)
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    elif features.get("groups"):  # matrices with weight decay, the rest with another lr and none
        groups = [{"params": [p for _, p in trained if p.ndim > 1], "lr": 1e-2, "weight_decay": 0.1},
                  {"params": [p for _, p in trained if p.ndim <= 1], "lr": 5e-3, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    else:
        optimizer = torch.optim.AdamW([p for _, p in trained], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    groups_by_name = [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "weight_decay": g["weight_decay"]}
                      for g in (optimizer.param_groups if optimizer is not None else [])]  # before DeepSpeed flattens them
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           model_parameters=[p for _, p in trained])
    rank = torch.distributed.get_rank()
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step * 10 + rank))
        tokens = tokens.to(engine.device)
        loss = nn.functional.cross_entropy(engine(tokens).float().reshape(-1, VOCAB), tokens.reshape(-1))
        engine.backward(loss)
        engine.step()
    out = HERE / name
    engine.save_checkpoint(str(out), tag="global_step3")
    reference: dict = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "global_steps": engine.global_steps}
    for n, p in model.named_parameters():  # collectives in stage 3: every rank
        if not p.requires_grad:
            continue
        reference["params"][n] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            reference[key][n] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    if features:
        reference["frozen"] = {}
        for n, p in model.named_parameters():
            if not p.requires_grad:
                with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                    reference["frozen"][n] = p.detach().cpu().clone()
        reference["tied"] = {"head.weight": "embed.weight"} if features.get("tied") else {}
        reference["groups"] = groups_by_name
    torch.distributed.barrier()  # every rank's files written
    if rank == 0:
        torch.save(reference, out / "reference.pt")
        for script in out.glob("*.py"):  # DeepSpeed copies its conversion scripts beside the checkpoint
            script.unlink()
        if features:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            torch.save(get_fp32_state_dict_from_zero_checkpoint(str(out)), out / "zero_to_fp32.pt")
    torch.distributed.barrier()


def main() -> int:
    if len(sys.argv) > 1:  # one configuration, inside its launch
        name = sys.argv[1]
        _, stage, dtype, offload = next(c for c in CONFIGS if c[0] == name)
        train(name, stage, dtype, offload)
        return 0
    import deepspeed
    import torch

    only = os.environ.get("FIXTURES", "")  # a comma-separated subset, else all
    for name, _, dtype, _ in CONFIGS:
        if only and name not in only.split(","):
            continue
        if dtype == "fp16" and os.environ.get("DS_ACCELERATOR") == "cpu":
            print(f"{name}: skipped (DeepSpeed's CPU accelerator has no fp16; write it on a GPU machine)")
            continue
        ranks = str(FEATURES.get(name, {}).get("ranks", RANKS))
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks, __file__, name],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    versions = json.loads((HERE / "VERSIONS.json").read_text()) if (HERE / "VERSIONS.json").exists() else {}
    written = {name: {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                      "ranks": int(FEATURES.get(name, {}).get("ranks", RANKS)),
                      "accelerator": os.environ.get("DS_ACCELERATOR", "cuda")}
               for name, _, dtype, _ in CONFIGS if (not only or name in only.split(","))
               and not (dtype == "fp16" and os.environ.get("DS_ACCELERATOR") == "cpu")}
    versions.setdefault("fixtures", {}).update(written)
    versions["deepspeed"] = deepspeed.__version__
    (HERE / "VERSIONS.json").write_text(json.dumps(versions) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
