"""The one build module (``lightning_zeroq/ops/_build.py``): it knows every source in ``csrc/``, says what is missing
in one line, and builds once per cache key under its lock, for ``setup.py`` and the first use alike."""

from __future__ import annotations

import subprocess

import pytest
import torch

from lightning_zeroq.ops import _build, _load
from lightning_zeroq.ops import host_adam as H
from lightning_zeroq.ops._build import CUDA_KERNELS, HOST_ADAM, NATIVE


def test_every_source_in_csrc_is_built_and_carried() -> None:
    csrc = _build.source_dir()
    assert csrc == (_build.CHECKOUT / "csrc").resolve()
    on_disk = {p.name for p in csrc.iterdir() if p.suffix in (".c", ".cpp", ".cu", ".h")}
    assert on_disk == {name for native in NATIVE for name in native.files()}
    patterns = _build.DATA["lightning_zeroq.csrc"][1]
    assert {f"*{p.suffix}" for p in csrc.iterdir() if p.name in on_disk} <= set(patterns)


def test_a_missing_c_compiler_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    said = "no C compiler (no-such-cc) on the PATH; install one or set CC"
    assert _build.missing(HOST_ADAM, jit=True) == said
    assert H._load() == (None, said)


def test_missing_sources_are_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_build, "source_dir", lambda: None)
    monkeypatch.setattr(_build, "c_compiler", lambda: "/usr/bin/cc")
    said = _build.missing(HOST_ADAM, jit=True)
    assert said is not None and said.startswith("its sources ['host_adam.c'] are not found") and "\n" not in said


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch")
def test_the_cuda_build_without_a_cuda_torch_says_so_ahead_of_time_and_at_first_use() -> None:
    said = f"torch {torch.__version__} is not a CUDA build"
    assert _build.missing(CUDA_KERNELS, jit=False) == said
    assert _load._jit_unavailable_reason() == said


def test_a_failed_build_is_one_line() -> None:
    error = subprocess.CalledProcessError(1, ["cc", "-O3"], stderr="host_adam.c:1: error: x\nhost_adam.c:2: error: y\n")
    said = _build.failed(HOST_ADAM, error)
    assert "\n" not in said and said.startswith("compiling lightning_zeroq's host Adam kernel failed: Command")
    assert said.endswith("host_adam.c:1: error: x host_adam.c:2: error: y")


def test_one_cache_directory_for_every_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("ZEROQ_EXT_CACHE", str(tmp_path))
    assert _load.cache_dir() == _build.cache_dir() == tmp_path


def test_a_build_compiles_once_and_again_where_the_cached_library_is_broken(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path, capfd) -> None:
    monkeypatch.setenv("ZEROQ_EXT_CACHE", str(tmp_path))
    made = []

    def make(folder, library):
        made.append(library)
        library.write_text("ok")

    def load(library):
        if library.read_text() != "ok":
            raise OSError("not a library")
        return library

    first = _build.build(HOST_ADAM, "k", make, load)
    assert first == tmp_path / f"{HOST_ADAM.name}_k" / f"{HOST_ADAM.name}_k.so" and len(made) == 1
    assert _build.build(HOST_ADAM, "k", make, load) == first and len(made) == 1  # cached
    first.write_text("truncated")
    assert _build.build(HOST_ADAM, "k", make, load) == first and len(made) == 2
    said = capfd.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in said if "compiling" in line] == [
        "compiling lightning_zeroq's host Adam kernel once"] * 2
    assert any("fails to load (not a library); building it again" in line for line in said)


def test_the_host_kernel_key_follows_sources_flags_and_settings() -> None:
    key = _build.build_key(HOST_ADAM, "cc", "-DZQ_PROBE")
    assert key == _build.build_key(HOST_ADAM, "cc", "-DZQ_PROBE") != _build.build_key(HOST_ADAM, "cc", "-DZQ_BODY=1")
    assert key != _build.build_key(CUDA_KERNELS, "cc", "-DZQ_PROBE")
