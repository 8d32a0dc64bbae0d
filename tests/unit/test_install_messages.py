"""What the package and the README tell users to install must be installable: lightning-zeroq is on no
package index (it installs from a checkout), so no message may say ``pip install lightning-zeroq...``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_message_installs_the_package_by_its_name():
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "lightning_zeroq").rglob("*.py"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"pip install[^`\n]*\blightning[-_]zeroq\b", line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_quick_start_says_which_torch_to_install_first():
    quick = (ROOT / "README.md").read_text(encoding="utf-8").split("## Quick start")[1].split("\n## ")[0]
    first_install = quick.index("pip install")
    assert quick.index("torch==2.13.0") <= quick.index("pip install .")
    assert "download.pytorch.org/whl/cpu" in quick[first_install:] and "cu130" in quick
