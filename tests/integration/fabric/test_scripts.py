"""The Fabric example and the Fabric-vs-Trainer benchmark run as users run them: as scripts, with
Fabric's own subprocess launcher and with torchrun, 2 processes on CPU (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zeroq.checkpoint.convert import lightning_checkpoint
from tests.launch_env import launch_env

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier

REPO = Path(__file__).resolve().parents[3]


def _run(args: list[str], cwd: Path) -> str:
    env = launch_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_example_pretrains_with_fabrics_launcher(tmp_path):
    out = _run([str(REPO / "examples" / "fabric_pretrain.py"), "--stage", "3", "--max-steps", "6", "--accumulate",
                "2", "--log-interval", "3", "--save-interval", "3", "--out-dir", str(tmp_path / "out")], tmp_path)
    assert "on meta;" in out and "iter 12 step 6 | loss train:" in out, out
    first, last = (float(line.split("loss train: ")[1].split(" ")[0]) for line in out.splitlines()
                   if "loss train:" in line)
    assert last < first
    for step in (3, 6):  # fabric.save's directories: weights consolidated in one process, counters beside them
        saved = lightning_checkpoint(tmp_path / "out" / f"step-{step:06d}")
        assert saved["items"]["step_count"] == step and saved["items"]["iter_num"] == 2 * step
        assert torch.equal(saved["state_dict"]["head.weight"], saved["state_dict"]["tok_emb.weight"])  # tied
    # Resume from step 3 in stage 2 at 3 processes: the counters continue and training goes on to step 6.
    out = _run([str(REPO / "examples" / "fabric_pretrain.py"), "--stage", "2", "--devices", "3", "--max-steps", "6",
                "--accumulate", "2", "--log-interval", "3", "--save-interval", "0",
                "--resume", str(tmp_path / "out" / "step-000003")], tmp_path)
    assert "at step 3 (iter 6)" in out and "iter 12 step 6 | loss train:" in out, out
    assert "Trained 6 steps (3 in this run, 6 micro-batches)" in out, out  # the rate counts this run's work only


def test_benchmark_runs_fabric_and_trainer_alike_under_torchrun(tmp_path):
    tiny = ["--dim", "64", "--layers", "2", "--heads", "2", "--ffn", "128", "--vocab", "256", "--seq", "32",
            "--batch", "2", "--steps", "2", "--warmup", "1", "--arms", "zeroq2", "--loops", "fabric,trainer"]
    out = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(REPO / "benchmarks" / "step_time.py"), *tiny], tmp_path)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    fabric, trainer, summary = lines
    assert (fabric["mode"], trainer["mode"], summary["summary"]) == ("fabric", "trainer", True)
    # same model, data and optimizer: the two front doors train identically
    assert (fabric["first_loss"], fabric["final_loss"]) == (trainer["first_loss"], trainer["final_loss"])
    assert summary["fabric_over_trainer"] > 0
