"""``benchmarks/step_time.py``'s activation arms on the CPU with a tiny GPT (one process, gloo): every block
recomputing, the plan's mix, a mix given by flags and every activation kept, alternating over two rounds;
each arm's line names its blocks, the summary has a line per arm over its rounds, and the arms train alike
(the same final loss: recomputing and offloading change nothing). The figures mean nothing here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--dim", "64", "--layers", "4", "--heads", "2", "--ffn", "128", "--vocab", "256", "--seq", "32", "--batch", "2"]


def test_the_activation_arms_run_alternating_and_train_alike(tmp_path):
    arms = "zeroq3+recompute,zeroq3+actauto,zeroq3+actoff,zeroq3"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29547", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_time.py"), *TINY, "--steps", "2",
                           "--warmup", "1", "--repeat", "2", "--drop-first-round", "--act-offload", "1",
                           "--act-recompute", "2", "--act-inputs-cpu", "--arms", arms],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    runs = [line for line in lines if "arm" in line]
    assert [(r["arm"], r["round"]) for r in runs] == [(a, n) for n in (1, 2) for a in arms.split(",")]
    mix = next(r for r in runs if r["arm"] == "zeroq3+actoff")
    assert mix["activation_offloading_policy"] == ["blocks.0", "blocks.1", "blocks.2"]  # one offloaded, two with inputs
    assert mix["activation_checkpointing_policy"] == ["blocks.1", "blocks.2"]
    assert "plan" in next(r for r in runs if r["arm"] == "zeroq3+actauto")
    assert len({r["final_loss"] for r in runs}) == 1
    summaries = [line for line in lines if "summary" in line]
    assert [s["summary"] for s in summaries] == arms.split(",") and all(s["rounds"] == [2] for s in summaries)
    assert all(len(s["tokens_per_s"]) == 1 and "peak_reserved_GiB" in s and "host_rss_GiB" in s for s in summaries)


def test_bad_activation_flags_are_one_line():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_time.py"), *TINY, "--act-offload", "3",
                           "--act-recompute", "3", "--arms", "zeroq2+actoff"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "add up to at most --layers (4)" in proc.stderr
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_time.py"), *TINY,
                           "--arms", "zeroq2+actoff+recompute"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown arm 'zeroq2+actoff+recompute'" in proc.stderr
