"""benchmarks/accuracy.py eps-noise on the CPU: a line per step with ZeRO's and reversed DDP's distance
from DDP, and every rank exits (DDP's comm hook once left a rank joining gloo's threads at exit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.launch
def test_eps_noise_prints_its_lines_and_every_rank_exits():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "accuracy.py"), "eps-noise", "--world-size", "2",
                          "--stage", "3", "--steps", "2", "--eps", "1e-3"], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["eps"] == 1e-3 and r["zeroq_vs_ddp"] < 1e-5 and r["ddp_reversed_vs_ddp"] < 1e-5 for r in rows)
