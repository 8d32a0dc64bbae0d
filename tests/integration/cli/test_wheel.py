"""The built wheel carries ``conf/``, ``recipes/`` and ``csrc/``, its ``zeroq-train`` works from any directory and
its host Adam kernel builds from the sources it carries.

Steps (about half a minute on 2 cores): copy the source tree to a temporary directory (so the build
leaves nothing in the checkout), ``pip wheel --no-deps`` it (without build isolation when setuptools is
importable: no network, and the outer torch is visible to a setup.py that wants it), create a fresh
virtual environment that sees the outer environment's packages (torch, lightning, hydra) through a
``.pth`` file, install only the wheel into it, then run its ``zeroq-train`` console script from an
empty directory outside the repository. ``python -m venv --system-site-packages`` alone would not do:
run from inside a virtual environment it exposes the base interpreter's site-packages, not this one's.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from lightning_zeroq.cli.train import CHILD_ENV, SUMMARY_PREFIX
from lightning_zeroq.ops import _build
from lightning_zeroq.ops import host_adam as H
from tests.integration.cli.test_cli import run_command

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier

REPO_ROOT = Path(__file__).resolve().parents[3]
SKIP_DIRS = {".git", ".venv", ".ci-venv", "build", "dist", "outputs", "multirun", "lightning_logs",
             "__pycache__", ".pytest_cache", ".whl"}


def _clean_env() -> dict[str, str]:
    drop = {"PYTHONPATH", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", CHILD_ENV}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["ZEROQ_BUILD_EXT"] = "0"  # never compile the CUDA extension for this test
    return env


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in SKIP_DIRS or n.endswith(".egg-info")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the lightning_zeroq wheel installed; returns its bin directory."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    shutil.copytree(REPO_ROOT, source, symlinks=True, ignore=_ignore)
    build = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(root / "dist")]
    if importlib.util.find_spec("setuptools") is not None:
        build.append("--no-build-isolation")
    subprocess.run(build, cwd=source, env=_clean_env(), check=True, timeout=300)
    (wheel,) = (root / "dist").glob("lightning_zeroq-*.whl")

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   env=_clean_env(), check=True, timeout=300)
    return venv / "bin"


def test_wheel_contains_conf_recipes_sources_and_every_module(installed: Path) -> None:
    (wheel,) = installed.parent.parent.glob("dist/*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"lightning_zeroq/cli/conf/{p.relative_to(REPO_ROOT / 'conf').as_posix()}"
                for p in (REPO_ROOT / "conf").rglob("*.yaml")}
    expected |= {f"lightning_zeroq/cli/recipes/{p.name}" for p in (REPO_ROOT / "recipes").iterdir() if p.is_file()}
    expected |= {f"lightning_zeroq/csrc/{name}" for native in _build.NATIVE for name in native.files()}
    expected |= {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "lightning_zeroq").rglob("*.py")
                 if "__pycache__" not in p.parts}
    assert expected - names == set(), f"missing from the wheel: {sorted(expected - names)}"


def test_installed_package_builds_its_host_kernel_from_the_sources_it_carries(installed: Path, tmp_path: Path) -> None:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the host kernel")
    code = ("from lightning_zeroq.ops import _build, host_adam as H; H.host_adam(); "
            "print(_build.source_dir(), H.unavailable_reason() or 'loaded', sep=' | ')")
    env = _clean_env() | {"ZEROQ_EXT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([str(installed / "python"), "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, _, said = proc.stdout.strip().splitlines()[-1].partition(" | ")
    assert where.startswith(str(installed.parent)), f"sources from {where}, not the installed package"
    assert said in ("loaded", H.NO_MATCH), said


def test_installed_zeroq_train_trains_from_any_directory(installed: Path, tmp_path: Path) -> None:
    where = subprocess.run([str(installed / "python"), "-c",
                            "import importlib.util; print(importlib.util.find_spec('lightning_zeroq').origin)"],
                           cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(installed.parent)), f"lightning_zeroq imported from {where}, not the wheel"
    proc = run_command([str(installed / "zeroq-train"), "trainer.max_steps=3"], tmp_path, _clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (summary,) = [line for line in proc.stdout.splitlines() if line.startswith(SUMMARY_PREFIX)]
    assert "gpt1m_zero2_cpu" in summary and "3 steps on 2 ranks" in summary and "tokens/s" in summary
    assert "peak memory per rank (max RSS)" in summary
    # One run directory, shared by both ranks.
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]
    assert len([p for p in tmp_path.glob("outputs/*/*") if p.is_dir()]) == 1


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("zero.stage=5", "zeroq-train: error: ZeroConfig.stage=5 is not a ZeRO stage"),
        ("zero.stagee=2", "Key 'stagee' not in 'ZeroConfig'"),
    ],
)
def test_installed_zeroq_train_rejects_bad_overrides(installed: Path, tmp_path: Path, override: str,
                                                     expected: str) -> None:
    proc = run_command([str(installed / "zeroq-train"), override], tmp_path, _clean_env())
    assert proc.returncode != 0
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
