"""The checkpoint fault matrix as a table: runs ``tests/integration/checkpoint/test_fault_matrix.py`` (CPU, gloo,
2 and 3 ranks) and prints every cell's outcome, the time to it and the error text, as Markdown::

    python benchmarks/fault_matrix.py                 # the whole matrix and the SIGKILL cells
    python benchmarks/fault_matrix.py -k "not sigkill" > fault_matrix_cpu_<date>.md

Times: Trainer resume and Fabric load, the slowest rank's time inside ``fit``/``fabric.load`` to the
error; one-process readers, the call's time; SIGKILL cells, the victim's death to the last survivor's
exit plus the load of what is left. The error text is the first rank's line (every rank raises the
same ``CheckpointError``), with the temporary directory shortened to ``CKPT``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cells.jsonl"
        env = {**os.environ, "ZEROQ_FAULT_MATRIX_OUT": str(out),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:logging", "tests/integration/checkpoint/test_fault_matrix.py",
               *sys.argv[1:]]
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sys.stderr).returncode
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    print(f"Command: `{' '.join(['python', 'benchmarks/fault_matrix.py', *sys.argv[1:]])}` (pytest exit {code}, "
          f"{len(rows)} cells)\n")
    print("| ranks | reader | damage | outcome | s | message |")
    print("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["world_size"], r["reader"], r["damage"])):
        message = re.sub(r"/\S*?/(ckpt|last\.ckpt|\.last\.ckpt\.zeroq-tmp-\w+)\b", r"CKPT", r["message"])
        lines = [l.strip() for l in message.splitlines() if l.strip()]
        text = (lines[1] if len(lines) > 1 else lines[0]) if lines else ""
        print(f"| {r['world_size']} | {r['reader']} | {r['damage']} | {r['outcome']} | {r['seconds']:.2f} | "
              f"{text.replace('|', '/')} |")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
