"""A real two-process launch (Lightning's subprocess launcher, CPU) with activation offload: stage 3, one block
offloading what it saves, one recomputing with its input on the host, one kept; each rank fits once without and
once with it, and every loss and the weights after ``fit`` are bitwise the same."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.launch_env import launch_env

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier


SCRIPT = textwrap.dedent("""
    import torch
    import lightning as L
    from lightning_zeroq import ZeroQStrategy
    from tests.integration.engine.test_recompute import Net
    from tests.models import TokenDataset, make_token_lit

    def fit(**extra):
        torch.manual_seed(0)
        module = make_token_lit(Net())
        torch.manual_seed(1)  # dropout's draws
        strategy = ZeroQStrategy(stage=3, stage3_wrap_classes=["Block"], stage3_param_persistence_threshold=0, **extra)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, torch.utils.data.DataLoader(TokenDataset(32), batch_size=2))
        return module.losses, {k: v.detach().clone() for k, v in module.model.state_dict().items()}, trainer.global_rank

    plain = fit()
    # qualified names are the LightningModule's: its Net is "model"
    ours = fit(activation_offloading_policy=["model.blocks.0", "model.blocks.1"],
               activation_checkpointing_policy=["model.blocks.1"],
               activation_offloading_min_bytes=0)
    assert ours[0] == plain[0], (ours[0], plain[0])
    assert all(torch.equal(ours[1][k], plain[1][k]) for k in plain[1])
    print(f"rank {ours[2]}: {len(ours[0])} losses and the weights bitwise", flush=True)
""")


def test_a_launch_with_activation_offload_trains_bitwise_as_without(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=launch_env(), capture_output=True,
                          text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "rank 0: 4 losses and the weights bitwise" in output and "rank 1: 4 losses and the weights bitwise" in output
