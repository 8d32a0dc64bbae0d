"""The docs' reference and migration tables (``docs/options.md``, ``docs/migrating.md``) against the
code they describe: every ``ZeroConfig`` field and strategy argument is in the options section, every registered name is listed, and every
DeepSpeed/FSDP option the migration guide maps exists in Lightning's own strategy signatures (so
the guide is redone when Lightning renames one)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from datetime import timedelta
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


def _documented_default(text: str) -> object:
    """A default as the options table writes it: a Python literal (``2``, ``2e8``, ``True``, ``None``) or a
    backticked string (```cpu```)."""
    text = text.strip()
    if text.startswith("`") and text.endswith("`"):
        return text.strip("`")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a word that is no literal (a default the code does not have) fails the comparison


def _same_default(documented: object, actual: object) -> bool:
    if isinstance(documented, bool) or isinstance(actual, bool):
        return type(documented) is type(actual) and documented == actual
    return documented == actual


def test_every_option_in_the_table_exists_with_its_documented_default():
    """Each row of the options table (``docs/options.md``) names ``ZeroConfig`` fields or strategy arguments, and
    its default column gives each one's default in the same order: the dataclass's field default (or the
    signature's)."""
    rows = _table_after(_section("Options"), "| option (`ZeroConfig` field) | default | meaning |")
    fields = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
    arguments = {p.name: p.default for cls in (ZeroQStrategy, ZeroQFabricStrategy)
                 for p in inspect.signature(cls.__init__).parameters.values()}
    assert len(rows) >= 25
    wrong = []
    for row in rows:
        names = re.findall(r"`([a-z_][a-z0-9_]*)`", row[0])
        defaults = [_documented_default(d) for d in row[1].split(", ")]
        if len(names) != len(defaults):
            wrong.append(f"{names}: {len(defaults)} defaults for {len(names)} options ({row[1]!r})")
            continue
        for name, documented in zip(names, defaults):
            if name not in fields and name not in arguments:
                wrong.append(f"{name}: neither a ZeroConfig field nor a strategy argument")
                continue
            actual = fields[name] if name in fields else arguments[name]
            if not _same_default(documented, actual):
                wrong.append(f"{name}: documented default {documented!r}, the code's {actual!r}")
    assert not wrong, wrong


def test_the_strategy_arguments_defaults_in_the_options_prose():
    """The defaults the options section states in prose (``timeout``, ``start_method``, ``async_checkpoint``,
    ``exclude_frozen_parameters``) are the signatures' defaults."""
    options = _section("Options")
    signature = inspect.signature(ZeroQStrategy.__init__).parameters
    fabric = inspect.signature(ZeroQFabricStrategy.__init__).parameters
    minutes = re.search(r"`timeout` \([^)]*default (\d+) minutes", options)
    assert minutes is not None
    assert signature["timeout"].default == fabric["timeout"].default == timedelta(minutes=int(minutes.group(1)))
    start = re.search(r'`start_method` \(`"(\w+)"`, the default', options)
    assert start is not None and signature["start_method"].default == start.group(1)
    asynchronous = re.search(r"`async_checkpoint` \(default (\w+)", options)
    assert asynchronous is not None and signature["async_checkpoint"].default is ast.literal_eval(asynchronous.group(1))
    exclude = re.search(r"`exclude_frozen_parameters` \(default (\w+)", options)
    assert exclude is not None
    assert signature["exclude_frozen_parameters"].default is fabric["exclude_frozen_parameters"].default is \
        ast.literal_eval(exclude.group(1))


def _test_commands(page: Path) -> list[str]:
    """The commands of the first ``bash`` block under a page's tests heading that run a check (``python -m
    pytest``, ``ruff``, ``mypy``), each without its comment and the install before an ``&&``."""
    text = page.read_text()
    heading = re.search(r"^#{1,2} Tests?\n", text, re.M)
    assert heading is not None, page
    block = re.search(r"```bash\n(.*?)```", text[heading.end():], re.S)
    assert block is not None, page
    commands = []
    for line in block.group(1).splitlines():
        for part in line.split("#")[0].split("&&"):
            part = part.strip()
            if part.startswith(("python -m pytest", "ruff ", "mypy ")):
                commands.append(part)
    return commands


def test_the_test_commands_the_readmes_give_are_cis():
    """The README's and tests/README.md's test commands are the commands of CI's tiers (``.ci/run``), and CI runs
    no pytest command they leave out."""
    ci = (ROOT / ".ci" / "run").read_text()
    ci_pytest = set(re.findall(r"python -m pytest[^\n]*?(?= *(?:\n|$))", ci))
    for page in (ROOT / "README.md", ROOT / "tests" / "README.md"):
        commands = _test_commands(page)
        assert any("not launch and not slow" in c for c in commands) and "mypy lightning_zeroq" in commands, page
        missing = [c for c in commands if c not in ci]
        assert not missing, f"{page.relative_to(ROOT)} gives commands .ci/run does not run: {missing}"
        unlisted = sorted(ci_pytest - set(commands))
        assert not unlisted, f".ci/run runs pytest commands {page.relative_to(ROOT)} does not give: {unlisted}"


def test_the_pre_commit_hooks_pin_the_test_extras_versions():
    """``.pre-commit-config.yaml`` installs the ruff that ``pyproject.toml``'s test extra pins, and runs the
    environment's mypy (the test extra's)."""
    extra = re.search(r"^test = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra is not None
    pins = dict(re.findall(r'"([a-z-]+)==([0-9.]+)"', extra.group(1)))
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    ruff = set(re.findall(r'"ruff==([0-9.]+)"', config))
    assert ruff == {pins["ruff"]}, (ruff, pins["ruff"])
    mypy = re.search(r"- id: mypy\n(?:\s+\w+:.*\n)*?\s+language: (\w+)", config)
    assert mypy is not None and mypy.group(1) == "system" and "mypy" in pins
