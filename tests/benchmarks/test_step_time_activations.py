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

import pytest

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


def _step_time():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step_time_activations", REPO / "benchmarks" / "step_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bad_activation_flags_are_one_line(monkeypatch, capsys):
    step_time = _step_time()
    for flags, says in ((["--act-offload", "3", "--act-recompute", "3", "--arms", "zeroq2+actoff"],
                         "add up to at most --layers (4)"),
                        (["--act-budget", "half", "--arms", "zeroq2+actauto"], "--act-budget half: give GiB"),
                        (["--repeat", "1", "--drop-first-round"], "2 or more with --drop-first-round")):
        monkeypatch.setattr(sys, "argv", ["step_time.py", *TINY, *flags])
        with pytest.raises(SystemExit) as info:
            step_time.main()
        assert info.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"unknown arm 'zeroq2\+actoff\+recompute'"):
        step_time.parse_arm("zeroq2+actoff+recompute")  # one activation option an arm
