"""benchmarks/engine_overhead.py: two checkouts side by side (here the same one twice, tiny), a row per
checkout with every arm's time and overhead per unit, and the ratio of the two; bad flags refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "benchmarks" / "engine_overhead.py")


@pytest.mark.launch
def test_two_checkouts_give_a_row_each_and_their_ratio():
    out = subprocess.run([sys.executable, SCRIPT, "--repos", f"{REPO},{REPO}", "--units", "3", "--width", "8",
                          "--steps", "2", "--warmup", "1", "--rounds", "1"], capture_output=True, text=True,
                         check=True, cwd=REPO)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r.get("units") for r in rows[:2]] == [3, 3]
    assert all(r["zeroq3_ms"] > 0 and "zeroq2_per_unit_us" in r for r in rows[:2])
    assert set(rows[2]["after_over_before"]) == {"plain", "zeroq2", "zeroq3"}


@pytest.mark.parametrize("flags, message", [(["--units", "0"], "--units=0 must be at least 1"),
                                            (["--arms", "zeroq4"], "'zeroq4'"),
                                            (["--repos", "/nonexistent"], "hold no lightning_zeroq package")])
def test_bad_flags_are_refused_by_name(flags, message):
    out = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and message in out.stderr
