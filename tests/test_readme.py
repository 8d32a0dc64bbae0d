"""The docs' reference and migration tables (``docs/options.md``, ``docs/migrating.md``) against the
code they describe: every ``ZeroConfig`` field and strategy argument is in the options section, every registered name is listed, and every
DeepSpeed/FSDP option the migration guide maps exists in Lightning's own strategy signatures (so
the guide is redone when Lightning renames one)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed
from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, StrategyRegistry

from lightning_zeroq import ZeroConfig, ZeroQFabricStrategy, ZeroQStrategy

ROOT = Path(__file__).resolve().parents[1]
# The README and the topic pages, each page's title (``# Title``) read as a section (``## Title``).
README = "\n".join("\n" + re.sub(r"^# ", "## ", path.read_text())
                   for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def _parameters(*classes: type) -> set[str]:
    names: set[str] = set()
    for cls in classes:
        names |= {p.name for p in inspect.signature(cls.__init__).parameters.values()
                  if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name != "self"}
    return names


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells) of the Markdown table whose header line is ``marker``, its rule left out."""
    rows = []
    for line in text[text.index(marker):].split("\n")[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
        elif rows:
            break
    return rows[1:]


def _names(cell: str) -> set[str]:
    """Option names in a cell: backticked identifiers, and the left side of backticked ``name=...``."""
    names = set(re.findall(r"`([a-z_][a-z0-9_]*)`", cell))
    names |= set(re.findall(r"`([a-z_][a-z0-9_]*)=", cell))
    return names


def test_every_option_and_strategy_argument_is_in_the_options_section():
    options = _section("Options")
    fields = [f.name for f in dataclasses.fields(ZeroConfig)]
    missing = [name for name in fields if f"| `{name}`" not in options and f", `{name}`" not in options]
    assert not missing, f"ZeroConfig fields missing from the README's options table: {missing}"
    arguments = _parameters(ZeroQStrategy, ZeroQFabricStrategy) - {"config"}
    missing = sorted(name for name in arguments if f"`{name}`" not in options)
    assert not missing, f"strategy arguments missing from the README's options section: {missing}"
    assert "`ZeroQStrategy(config=None, **options)`" in options


def test_every_registered_name_is_listed():
    names = _table_after(_section("Options"), "| name | options |")
    listed = {n for row in names for n in re.findall(r'`"([a-z0-9_]+)"`', row[0])}
    registered = {name for name, entry in StrategyRegistry.items() if entry["strategy"] is ZeroQStrategy}
    assert listed == registered and len(registered) >= 6


@pytest.mark.parametrize(("marker", "peers"), [
    ("| DeepSpeed option | ZeroQ |", (DeepSpeedStrategy, FabricDeepSpeed)),
    ("| FSDP option | ZeroQ |", (FSDPStrategy, FabricFSDP)),
])
def test_the_migration_guide_names_only_options_lightning_has(marker, peers):
    rows = _table_after(_section("Migrating from DeepSpeed or FSDP"), marker)
    theirs = _parameters(*peers)
    named = set()
    for row in rows:
        if row[0].startswith("`**kwargs`"):
            continue  # FSDP's own keyword arguments, passed through by Lightning
        named |= _names(row[0])
    unknown = sorted(named - theirs)
    assert not unknown, f"the README maps options Lightning's {peers[0].__name__} does not have: {unknown}"
    unmapped = sorted(theirs - named)
    assert not unmapped, f"options of Lightning's {peers[0].__name__} the README's migration guide leaves out: {unmapped}"


def _slug(title: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_resolves():
    """The README, the pages of ``docs/`` and the tests' and benchmarks' READMEs link to files that exist
    and to headings those files have."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md",
             ROOT / "benchmarks" / "README.md"]
    anchors = {p.resolve(): {_slug(m.group(1)) for m in re.finditer(r"^#{1,4} (.*)$", p.read_text(), re.M)}
               for p in pages}
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page.resolve()
            if not resolved.exists() or (anchor and resolved in anchors and anchor not in anchors[resolved]):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_opens_with_the_quick_start_and_installs_a_cpu_torch_for_the_tests():
    """A newcomer reads how to install and run before any measurement, and the tests' install line takes
    torch's CPU build (a bare ``pip install torch`` on Linux brings the CUDA build and its libraries)."""
    text = (ROOT / "README.md").read_text()
    assert text.index("\n## Quick start\n") < text.index("\n|"), "Quick start must come before the first table"
    tests = text[text.index("\n## Tests\n"):]
    install = next(line for line in tests.splitlines() if line.startswith("pip install torch"))
    assert "--index-url https://download.pytorch.org/whl/cpu" in install, install


def test_the_readmes_plan_example_names_the_stage_the_plan_ranks_first(capsys):
    """The sentence under the README's ``zeroq-plan`` example names the configuration the tool prints first."""
    from lightning_zeroq.cli import plan

    section = _section("Before launch: what fits")
    command = re.search(r"```bash\n(zeroq-plan [^\n]*)\n```", section)
    assert command is not None
    assert plan.main(command.group(1).split()[1:]) == 0
    best = re.search(r"fastest that fits: zeroq(\d)", capsys.readouterr().out)
    assert best is not None
    said = re.search(r"Fastest that fits, as planned[^:]*:\s*stage (\d)", section)
    assert said is not None and said.group(1) == best.group(1), (said and said.group(0), best.group(0))
