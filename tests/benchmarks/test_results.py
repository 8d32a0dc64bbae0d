"""The stored benchmark results (``benchmarks/results/``): every file there is cited by the docs (the README,
``docs/*.md``, ``benchmarks/README.md``), every results file the docs name exists, and no file carries a
temporary (``/tmp``, tmpfs), home or environment path of the machine that measured it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# A results file's name as the docs write it: <benchmark>_<what>_<hardware>_<date>.<ext>
CITED = re.compile(r"\b[a-z0-9_]+_(?:cpu|\d+x[a-z0-9]+)_\d{4}-\d{2}-\d{2}\.(?:jsonl|txt|log|md)\b")
# The measuring machine's own paths: temp folders (tmpfs too), home folders, its checkouts and environments; and
# a Python environment's packages named by where that machine keeps them (a result writes $VENV/lib/...).
MACHINE_PATH = re.compile(r"(?<![\w$.])(?:/tmp/|/var/tmp/|/var/folders/|/private/|/root\b|/home/|/Users/|/work/|/opt/"
                          r"|/scratch/|/mnt/|/dev/shm\b|/run/user/)"
                          r"|(?:^|[\s\"'(=:])(?!\$)[^\s\"'()=:$]*lib/python3\.\d+/site-packages/")


def _cited() -> set[str]:
    return {name for doc in DOCS for name in CITED.findall(doc.read_text())}


def test_every_stored_result_is_cited_by_the_docs():
    stored = {p.name for p in RESULTS.iterdir()}
    uncited = sorted(stored - _cited())
    assert not uncited, f"results no doc cites (cite each where it backs a claim, or delete it): {uncited}"


def test_every_results_file_the_docs_name_exists():
    stored = {p.name for p in RESULTS.iterdir()}
    # Names of results a suite writes, quoted as examples of the naming, are not stored files.
    missing = sorted(n for n in _cited() - stored if not n.startswith(("<", "step_time_cpu_")))
    assert not missing, f"the docs cite results that are not in benchmarks/results/: {missing}"


def test_no_result_carries_a_path_of_the_measuring_machine():
    found = []
    for path in sorted(RESULTS.iterdir()):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = MACHINE_PATH.search(line)
            if match:
                found.append(f"{path.name}:{number}: {line[max(0, match.start() - 20):match.end() + 40]}")
    assert not found, "use $OUT / $SCRATCH / $VENV instead:\n" + "\n".join(found)


def test_the_path_check_finds_what_a_machine_leaves():
    for line in ("--dir /tmp/ckpt", "--dir /dev/shm/ckio", "(/dev/shm: memory-speed)", "cd /work/repo",
                 "stream 0: torch/.venv/lib/python3.12/site-packages/torch/optim/adam.py:178",
                 '"/usr/lib/python3.11/site-packages/x.py"'):
        assert MACHINE_PATH.search(line), line
    for line in ("--dir $SCRATCH/ckpt", "$VENV/lib/python3.12/site-packages/lightning/x.py:21", "benchmarks/step_time.py",
                 "lightning_zeroq/zero/step.py:80 run", "NCCL_SOCKET_IFNAME=lo", "tmpfs ($SCRATCH)"):
        assert not MACHINE_PATH.search(line), line
