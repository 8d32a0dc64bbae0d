"""The runnable examples of the docs run as written (each a script of its own: Lightning starts its ranks by
running the script again)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.launch


def _example(page: str, heading: str) -> str:
    text = (ROOT / page).read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_fine_tuning_example_runs_and_shards_the_base(tmp_path) -> None:
    script = tmp_path / "finetune.py"
    script.write_text(_example("docs/finetuning.md", "A worked example on the CPU"))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # the two ranks share one pipe, so their lines may interleave: find the reports, not the lines
    reports = sorted(re.findall(r"rank (\d): (\d+) frozen parts, ([\d.]+) MiB", done.stdout))
    assert [rank for rank, _, _ in reports] == ["0", "1"], done.stdout[-2000:]
    for _, parts, mib in reports:
        assert int(parts) == 4
        # 4 blocks x 197,632 weights (+ biases, norms) at about 1.06 bytes, halved: about 0.4 MiB per rank
        assert 0.3 < float(mib) < 0.6, mib
