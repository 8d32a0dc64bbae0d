"""Write the checkpoints of Lightning's own ``FSDPStrategy`` (``state_dict_type="sharded"`` and
``"full"``) and ``DeepSpeedStrategy`` (ZeRO stage 3, bf16) that the tests resume into ZeroQ
(``tests/integration/checkpoint/test_lightning_peers.py``): a small model, 3 steps of AdamW, then
``trainer.save_checkpoint``; beside each checkpoint ``reference.pt``: every parameter's fp32 value and
Adam moments whole, as the strategy's own API gives them (FSDP: ``summon_full_params`` and
``FSDP.optim_state_dict``; DeepSpeed: ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``),
and the optimizer's step count. Lightning wants a GPU for both strategies, so this runs on a GPU machine
(one process per configuration, ``RANKS`` GPUs each, default 1), from the repository root::

    python tests/data/lightning/make_fixtures.py

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
CONFIGS = ["fsdp_sharded", "fsdp_full", "deepspeed_stage3_bf16"]
# Not here: DeepSpeedStrategy at stage 2 under Lightning 2.6.6 and DeepSpeed 0.19.8 on one GPU, whose
# safe_get_full_fp32_param fails (an all-reduce of a CPU tensor on NCCL); DeepSpeed's own stage-2 checkpoints,
# fp16 among them, are in tests/data/deepspeed.
VOCAB, DIM = 32, 16


def train(name: str) -> None:
    import lightning as L
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.Sequential(nn.Linear(DIM, 24), nn.GELU(), nn.Linear(24, DIM))
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens):
            return self.head(self.norm(self.blocks(self.embed(tokens))))

        def training_step(self, batch, batch_idx):
            tokens = batch[0]
            return nn.functional.cross_entropy(self(tokens).float().reshape(-1, VOCAB), tokens.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)

    tokens = torch.randint(0, VOCAB, (6, 8), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
    ranks = int(os.environ.get("RANKS", "1"))
    if name.startswith("fsdp"):
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = FSDPStrategy(state_dict_type=name.split("_")[1])
        precision = "32-true"
    else:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        stage = int(name.split("_")[1][-1])
        strategy = DeepSpeedStrategy(stage=stage, **({"initial_scale_power": 8} if name.endswith("fp16") else {}))
        precision = "bf16-mixed" if name.endswith("bf16") else "16-mixed"
    trainer = L.Trainer(accelerator="cuda", devices=ranks, strategy=strategy, precision=precision, max_steps=3,
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = Lit()
    trainer.fit(model, loader)
    out = HERE / name
    trainer.save_checkpoint(str(out) + (".ckpt" if name == "fsdp_full" else ""))
    reference: dict = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "global_step": trainer.global_step}
    optimizer = trainer.optimizers[0]
    if name.startswith("fsdp"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

        wrapped = trainer.strategy.model
        with FSDP.summon_full_params(wrapped, writeback=False, rank0_only=False):
            reference["params"] = {n.replace("_fsdp_wrapped_module.", ""): p.detach().float().cpu().clone()
                                   for n, p in wrapped.named_parameters()}
        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            osd = FSDP.optim_state_dict(wrapped, optimizer)
        for n, state in osd["state"].items():
            key = n.replace("_fsdp_wrapped_module.", "")
            reference["exp_avg"][key] = state["exp_avg"].float().cpu().clone()
            reference["exp_avg_sq"][key] = state["exp_avg_sq"].float().cpu().clone()
            reference["step"] = float(state["step"])
    else:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for n, p in model.named_parameters():
            reference["params"][n] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                reference[key][n] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    if trainer.global_rank == 0:
        torch.save(reference, str(out) + ".reference.pt")
        if out.is_dir():
            for script in out.glob("*.py"):  # DeepSpeed copies its conversion scripts beside the checkpoint
                script.unlink()


def main() -> int:
    if len(sys.argv) > 1:  # one configuration, inside its own process
        train(sys.argv[1])
        return 0
    import lightning
    import torch

    only = os.environ.get("FIXTURES", "")
    made = {}
    for name in CONFIGS:
        if only and name not in only.split(","):
            continue
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            if name.startswith("deepspeed"):
                print(f"{name}: skipped (DeepSpeed is not installed)")
                continue
        result = subprocess.run([sys.executable, __file__, name], env={**os.environ, "OMP_NUM_THREADS": "1"})
        made[name] = "written" if result.returncode == 0 else f"failed ({result.returncode})"
        print(name, made[name], flush=True)
    versions = {"lightning": lightning.__version__, "torch": torch.__version__, "ranks": int(os.environ.get("RANKS", "1")),
                "fixtures": made}
    try:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    (HERE / "VERSIONS.json").write_text(json.dumps(versions) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
