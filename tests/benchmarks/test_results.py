"""The stored benchmark results (``benchmarks/results/``): every file there is cited by the docs (the README,
``docs/*.md``, ``benchmarks/README.md``), every results file the docs name exists, and no file carries a
temporary or home path of the machine that measured it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# A results file's name as the docs write it: <benchmark>_<what>_<hardware>_<date>.<ext>
CITED = re.compile(r"\b[a-z0-9_]+_(?:cpu|\d+x[a-z0-9]+)_\d{4}-\d{2}-\d{2}\.(?:jsonl|txt|log|md)\b")
# The measuring machine's own paths: temp folders, home folders, its checkouts and environments.
MACHINE_PATH = re.compile(r"(?<![\w$.])(?:/tmp/|/var/tmp/|/var/folders/|/private/|/root\b|/home/|/Users/|/work/|/opt/"
                          r"|/scratch/|/mnt/)")


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
