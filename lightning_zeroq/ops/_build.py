"""Every native source of lightning_zeroq and how it is built: ahead of time by ``setup.py``, just in time at first use.

Two libraries come from ``csrc/`` (``NATIVE``):

- ``CUDA_KERNELS``: the ``zeroq::`` ops' kernels. ``setup.py`` builds them ahead of time into
  ``lightning_zeroq/_C*.so`` (``cuda_extension``; it says when), for ``TORCH_CUDA_ARCH_LIST`` (default ``9.0``:
  H100/H200); otherwise the first op call on a CUDA tensor builds them (``ops/_load.py``, which also says what runs
  when neither can).
- ``HOST_ADAM``: the host Adam step of optimizer offload, built at first use only (``ops/host_adam.py``): it
  targets this machine's CPU (``-march=native``) and is checked against this machine's torch.

Both builds at first use go through ``build``: one cache directory (``cache_dir``), one subdirectory per hash of
the sources, flags and toolchain (``build_key``), one file lock in it that lets one process (one rank) compile
while the others wait, each saying so on stderr, and one line on stderr before compiling. What is missing to
build (a compiler, the sources) is one line naming it and the fix (``missing``), for ``setup.py`` and for the first
use alike.

The wheel carries ``csrc/``, ``conf/`` and ``recipes/`` inside the package (``DATA``: ``lightning_zeroq/csrc``,
``lightning_zeroq/cli/conf``, ``lightning_zeroq/cli/recipes``); a checkout keeps them at its top, where
``data_dir`` finds them. Nothing but the standard library is imported at module level: ``setup.py`` loads this
file by its path, where torch may be missing, and importing the package compiles nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

PACKAGE = Path(__file__).resolve().parents[1]
CHECKOUT = PACKAGE.parent
T = TypeVar("T")


@dataclass(frozen=True)
class Native:
    """One library built from ``csrc/``: what it is made of and the flags it is compiled with."""

    name: str  # the library's name (its cache subdirectory and file start with it)
    what: str  # for messages: "lightning_zeroq's <what>"
    sources: tuple[str, ...]  # compiled, in csrc/
    headers: tuple[str, ...]  # included, in csrc/
    cflags: tuple[str, ...]  # C/C++ compiler
    cuda_cflags: tuple[str, ...] = ()  # nvcc
    ldflags: tuple[str, ...] = ()  # the linker, after the sources
    takes: str = ""  # how long one build takes, for the line said before it

    def files(self) -> tuple[str, ...]:
        return self.sources + self.headers


CUDA_KERNELS = Native(
    "lightning_zeroq_C",
    "CUDA kernels",
    ("ops.cpp", "quant_int8.cu", "widen.cu"),
    ("quant_int8.h", "widen.h"),
    ("-O3",),
    ("-O3",),
    takes="about a minute",
)
HOST_ADAM = Native(
    "zeroq_host_adam",
    "host Adam kernel",
    ("host_adam.c",),
    (),
    ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread"),
    ldflags=("-lm",),
    takes="a few seconds",
)
NATIVE = (CUDA_KERNELS, HOST_ADAM)

DATA = {  # package -> (the checkout's top-level folder, the files of it the wheel carries)
    "lightning_zeroq.csrc": ("csrc", ("*.c", "*.cpp", "*.cu", "*.h")),
    "lightning_zeroq.cli.conf": ("conf", ("*.yaml",)),
    "lightning_zeroq.cli.recipes": ("recipes", ("*.yaml", "*.json")),
}


def data_dir(package: str) -> Path:
    """Where a folder of ``DATA`` is: inside the installed package (a wheel), else at the top of the checkout."""
    folder = DATA[package][0]
    inside = PACKAGE.joinpath(*package.split(".")[1:])
    for candidate in (inside, CHECKOUT / folder):
        if candidate.is_dir():
            return candidate.resolve()
    raise RuntimeError(
        f"lightning_zeroq cannot find its '{folder}' directory (looked in {inside.parent} and "
        f"{CHECKOUT}); reinstall the package from a complete source checkout (pip install .) or run "
        "from one."
    )


def source_dir() -> Path | None:
    """``csrc/``: inside the installed package, else at the top of the checkout; None when neither has it."""
    try:
        return data_dir("lightning_zeroq.csrc")
    except RuntimeError:
        return None


def _sources(native: Native) -> Path:
    csrc = source_dir()
    if csrc is None:
        raise FileNotFoundError(missing(native, jit=True))
    return csrc


# ---- what a build needs -------------------------------------------------------------------------


def c_compiler() -> str | None:
    """The system C compiler (``$CC``, default ``cc``) as a path, or None."""
    return shutil.which(os.environ.get("CC", "cc"))


def missing(native: Native, *, jit: bool) -> str | None:
    """What keeps ``native`` from being built here, in one line that names the fix, or None.

    ``jit``: for a build at first use (CUDA's needs ninja there; ``setup.py``'s does not)."""
    reason = _missing_c_toolchain() if native is HOST_ADAM else _missing_cuda_toolchain(jit)
    if reason is not None:
        return reason
    csrc = source_dir()
    absent = list(native.files()) if csrc is None else [f for f in native.files() if not (csrc / f).is_file()]
    if absent:
        return f"its sources {absent} are not found (looked in {PACKAGE / 'csrc'} and {CHECKOUT / 'csrc'})"
    return None


def _missing_c_toolchain() -> str | None:
    if c_compiler() is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')}) on the PATH; install one or set CC"
    return None


def _missing_cuda_toolchain(jit: bool) -> str | None:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return "torch is not importable here (with pip: pip install --no-build-isolation .)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    cuda_home = cpp_extension.CUDA_HOME
    if cuda_home is None or not (Path(cuda_home) / "bin" / "nvcc").exists():
        return "nvcc not found (set CUDA_HOME to a CUDA toolkit)"
    if jit and not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


# ---- ahead of time: setup.py --------------------------------------------------------------------

PY_LIMITED_API = "cp310"  # the extension has no Python code; one file serves every Python >= 3.10


def cuda_extension() -> Any:
    """``setup.py``'s ahead-of-time build of ``CUDA_KERNELS`` (a ``CUDAExtension``, built by torch's
    ``BuildExtension``), where ``missing(CUDA_KERNELS, jit=False)`` found nothing missing; run from the
    checkout's top, as pip runs ``setup.py``."""
    from torch.utils.cpp_extension import CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    csrc = DATA["lightning_zeroq.csrc"][0]
    return CUDAExtension(
        name="lightning_zeroq._C",
        sources=[f"{csrc}/{name}" for name in CUDA_KERNELS.sources],
        include_dirs=[str(CHECKOUT / csrc)],
        extra_compile_args={
            "cxx": [*CUDA_KERNELS.cflags, "-DPy_LIMITED_API=0x030A0000"],
            "nvcc": list(CUDA_KERNELS.cuda_cflags),
        },
        py_limited_api=True,
    )


# ---- just in time: the first use ----------------------------------------------------------------


def cache_dir() -> Path:
    """Where builds at first use go: ``$ZEROQ_EXT_CACHE`` or ``~/.cache/lightning_zeroq/<versions>/``."""
    override = os.environ.get("ZEROQ_EXT_CACHE")
    if override:
        return Path(override).expanduser()
    import torch

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lightning_zeroq" / f"{torch.__version__}-cuda{torch.version.cuda}"


def build_key(native: Native, *settings: str) -> str:
    """A hash of ``native``'s sources and flags and of ``settings`` (the toolchain, the targets)."""
    csrc = _sources(native)
    digest = hashlib.sha256()
    for name in native.files():
        digest.update(name.encode())
        digest.update((csrc / name).read_bytes())
    for part in (*settings, *native.cflags, *native.cuda_cflags, *native.ldflags):
        digest.update(part.encode())
    return digest.hexdigest()[:12]


def cpu_key() -> str:
    """This machine's CPU, for builds that target it (``-march=native``)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def say(message: str) -> None:
    """One line on stderr, prefixed by the rank where there is one."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}{message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def exclusive_lock(path: Path, waiting_message: str) -> Iterator[None]:
    import fcntl

    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(waiting_message)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(native: Native, key: str, make: Callable[[Path, Path], None], load: Callable[[Path], T]) -> T:
    """``load(library)`` of ``native``'s build ``key``, compiling it first where the cache has none.

    ``make(folder, library)`` writes ``library`` in ``folder`` (``cache_dir()/<name>_<key>``). Under the folder's
    lock: one process compiles, the others wait and then load what it built; a cached library that fails to load
    (a build killed while linking) is built again."""
    name = f"{native.name}_{key}"
    folder = cache_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"{name}.so"
    waiting = f"waiting for another process compiling lightning_zeroq's {native.what} in {folder}"
    with exclusive_lock(folder / "zeroq.lock", waiting):
        if library.is_file():
            try:
                return load(library)
            except OSError as err:
                say(f"lightning_zeroq: cached {library} fails to load ({err}); building it again")
                library.unlink()
        say(f"compiling lightning_zeroq's {native.what} once, {native.takes}, cached in {folder}")
        make(folder, library)
        return load(library)


def compile_c(native: Native, compiler: str, defines: tuple[str, ...]) -> Callable[[Path, Path], None]:
    """``build``'s ``make`` for a plain C library: ``compiler`` on ``native``'s sources with its flags."""
    csrc = _sources(native)

    def run(folder: Path, library: Path) -> None:
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            subprocess.run(
                [
                    compiler,
                    *native.cflags,
                    *defines,
                    "-o",
                    str(partial),
                    *(str(csrc / name) for name in native.sources),
                    *native.ldflags,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            os.replace(partial, library)  # whole or absent, whatever happens to this process
        finally:
            partial.unlink(missing_ok=True)

    return run


def failed(native: Native, error: BaseException) -> str:
    """A failed build in one line: the error and the end of the compiler's output."""
    detail = " ".join(str(getattr(error, "stderr", "") or "").split())
    said = f"compiling lightning_zeroq's {native.what} failed: {' '.join(str(error).split())}"
    return f"{said}: {detail[-400:]}" if detail else said
