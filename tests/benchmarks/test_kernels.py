"""benchmarks/kernels.py host-muon on the CPU, tiny: a line per arm, the kernel's parts bitwise torch's ops'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.host_kernel import require

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.launch
def test_host_muon_prints_both_arms_bitwise_equal():
    kernel = require()
    if not kernel.muon:
        pytest.skip("the host kernel's Muon parts do not match torch's ops here")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernels.py"), "host-muon", "--numel", "40000",
                          "--tensors", "3", "--threads", "2", "--steps", "1", "--rounds", "1"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["arm"] for r in rows] == ["torch_ops", "zeroq_kernel"]
    assert all(r["bitwise_equal"] and r["median_s"] >= 0 and r["numel"] == 40000 for r in rows)
