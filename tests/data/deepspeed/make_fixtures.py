"""Write the DeepSpeed checkpoints the tests read (``tests/integration/checkpoint/test_deepspeed.py``), with
the real DeepSpeed: one launch per configuration, 2 ranks (``RANKS``), a small model, 3 steps of AdamW (one
parameter group: DeepSpeed 0.19.8's ``safe_get_full_optimizer_state`` finds no state in a second one), then
``save_checkpoint``; beside each checkpoint ``reference.pt``: every parameter's fp32 value and Adam
moments as DeepSpeed's own API gives them whole (``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``), and the step count. Run from the repository root, where DeepSpeed
is installed (on a machine without a GPU: ``DS_ACCELERATOR=cpu``, gloo)::

    DS_ACCELERATOR=cpu python tests/data/deepspeed/make_fixtures.py

The files are kept in the repository (a few hundred KiB); the versions that wrote them are in
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
]
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

    model = Net()
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero,
                    "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    if dtype != "fp32":
        config[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    optimizer = None
    if offload:  # DeepSpeed's own CPU Adam (its C++ kernel, built on first use)
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           model_parameters=model.parameters())
    rank = torch.distributed.get_rank()
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step * 10 + rank))
        tokens = tokens.to(engine.device)
        loss = nn.functional.cross_entropy(engine(tokens).float().reshape(-1, VOCAB), tokens.reshape(-1))
        engine.backward(loss)
        engine.step()
    out = HERE / name
    engine.save_checkpoint(str(out), tag="global_step3")
    reference = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "global_steps": engine.global_steps}
    for n, p in model.named_parameters():  # collectives in stage 3: every rank
        reference["params"][n] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            reference[key][n] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    if rank == 0:
        torch.save(reference, out / "reference.pt")
        for script in out.glob("*.py"):  # DeepSpeed copies its conversion scripts beside the checkpoint
            script.unlink()


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
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", RANKS, __file__, name],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    versions = json.loads((HERE / "VERSIONS.json").read_text()) if (HERE / "VERSIONS.json").exists() else {}
    written = {name: {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "ranks": int(RANKS),
                      "accelerator": os.environ.get("DS_ACCELERATOR", "cuda")}
               for name, _, dtype, _ in CONFIGS if (not only or name in only.split(","))
               and not (dtype == "fp16" and os.environ.get("DS_ACCELERATOR") == "cpu")}
    versions.setdefault("fixtures", {}).update(written)
    versions["deepspeed"] = deepspeed.__version__
    (HERE / "VERSIONS.json").write_text(json.dumps(versions) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
