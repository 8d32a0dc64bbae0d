"""Finding, building and loading the compiled CUDA kernels: lazily, once per process.

Importing this module does nothing: no CUDA initialization, no compiler, no file access. The first
``lightning_zeroq.ops`` call with a CUDA tensor (or an explicit :func:`load_cuda_backend`) fills the
``CUDA`` dispatch key of the ``zeroq::`` ops, trying in order:

1. ``ZEROQ_DISABLE_EXT=1``: the PyTorch reference, on purpose.
2. Kernels already registered for ``zeroq::`` on CUDA (the library was loaded by other means).
3. Prebuilt: ``lightning_zeroq/_C*.so``, built by ``setup.py`` at install time, loaded with
   ``torch.ops.load_library``.
4. Just in time: if torch is a CUDA build and ``nvcc``, ``ninja`` and the ``csrc/`` sources (a
   source checkout or editable install) are present, ``torch.utils.cpp_extension.load`` compiles
   them once into a cache directory (``$ZEROQ_EXT_CACHE``, default
   ``~/.cache/lightning_zeroq/<torch version>-cuda<CUDA version>/``), one subdirectory per hash of
   sources, torch version and target architectures. An ``fcntl`` lock in that subdirectory lets one
   process (one rank) compile while the others wait, each saying so on stderr, and then load the
   cached library; later processes load it without compiling.
5. Otherwise the reference, with one WARNING that says why.

Which path is active is logged once at INFO. Compiling takes about a minute; to keep it out of a
training step (other ranks would wait in a collective), build ahead of time (``pip install
--no-build-isolation .`` with a CUDA torch) or warm the cache with
``python -c "from lightning_zeroq.ops._load import main; raise SystemExit(main())"``.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from lightning_zeroq.ops import _library

__all__ = ["Backend", "active_backend", "cache_dir", "has_cuda_kernel", "load_cuda_backend"]

logger = logging.getLogger("lightning_zeroq.ops")


class Backend(str, enum.Enum):
    """What implements the ``zeroq::`` ops on CUDA tensors in this process."""

    UNRESOLVED = "unresolved"  # no CUDA tensor has reached the ops yet
    PREBUILT = "cuda-prebuilt"  # lightning_zeroq/_C*.so (or kernels registered by other means)
    JIT = "cuda-jit"  # compiled from csrc/ into the cache directory
    REFERENCE = "reference"  # the PyTorch reference, registered for CUDA


_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_CSRC_DIR = _PACKAGE_DIR.parent / "csrc"
_JIT_SOURCES = ("ops.cpp", "quant_int8.cu")
_JIT_HEADERS = ("quant_int8.h",)
_JIT_CFLAGS = ("-O3",)
_JIT_CUDA_CFLAGS = ("-O3",)
_EXT_NAME = "lightning_zeroq_C"

_backend = Backend.UNRESOLVED
_resolve_lock = threading.Lock()


def active_backend() -> Backend:
    """The backend of the CUDA ops; ``UNRESOLVED`` until first used. Loads nothing."""
    return _backend


def has_cuda_kernel() -> bool:
    """True when the compiled kernels (not the reference) serve CUDA tensors. Loads nothing."""
    if _backend is Backend.UNRESOLVED:
        return _library.cuda_key_has_kernels()  # only if the library was loaded by other means
    return _backend is not Backend.REFERENCE


def load_cuda_backend() -> Backend:
    """Resolves the CUDA implementation now (see the module docstring) and returns it.

    Idempotent and thread-safe; the first call may compile for about a minute.
    """
    global _backend
    if _backend is Backend.UNRESOLVED:
        with _resolve_lock:
            if _backend is Backend.UNRESOLVED:
                backend, detail = _resolve()
                logger.info("lightning_zeroq: zeroq:: ops on CUDA use %s: %s", backend.value, detail)
                _backend = backend
    return _backend


def cache_dir() -> Path:
    """Where JIT builds go: ``$ZEROQ_EXT_CACHE`` or ``~/.cache/lightning_zeroq/<versions>/``."""
    override = os.environ.get("ZEROQ_EXT_CACHE")
    if override:
        return Path(override).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lightning_zeroq" / f"{torch.__version__}-cuda{torch.version.cuda}"


# ---- resolution -------------------------------------------------------------------------------


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _resolve() -> tuple[Backend, str]:
    if _env_flag("ZEROQ_DISABLE_EXT"):
        _library.register_reference_for_cuda()
        return Backend.REFERENCE, "the compiled kernels are disabled by ZEROQ_DISABLE_EXT=1"
    if _library.cuda_key_has_kernels():
        return Backend.PREBUILT, "kernels already registered in this process"

    failures: list[str] = []
    prebuilt = _find_prebuilt()
    if prebuilt is not None:
        try:
            _load_library(prebuilt)
            return Backend.PREBUILT, str(prebuilt)
        except (OSError, RuntimeError) as err:
            failures.append(f"loading {prebuilt} failed ({err}); rebuild it for this torch")
    reason = _jit_unavailable_reason()
    if reason is None:
        try:
            return Backend.JIT, str(_jit_build_and_load())
        except Exception as err:  # a failed build must not stop training; say why below
            failures.append(f"JIT compilation failed: {err}")
    else:
        failures.append(f"cannot JIT-compile: {reason}")

    _library.register_reference_for_cuda()
    logger.warning(
        "lightning_zeroq: compiled CUDA kernels unavailable (%s). The zeroq:: ops run the PyTorch "
        "reference on CUDA: same results, slower. Set ZEROQ_DISABLE_EXT=1 to choose this "
        "explicitly.",
        "; ".join(failures),
    )
    return Backend.REFERENCE, "fallback"


def _find_prebuilt() -> Path | None:
    candidates = sorted(_PACKAGE_DIR.glob("_C*.so"))
    return candidates[0] if candidates else None


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))
    if not _library.cuda_key_has_kernels():
        raise RuntimeError(f"{path} registered no CUDA kernels for every zeroq:: op")


def _jit_unavailable_reason() -> str | None:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    missing = [f for f in _JIT_SOURCES + _JIT_HEADERS if not (_CSRC_DIR / f).is_file()]
    if missing:
        return (
            f"sources {missing} not found under {_CSRC_DIR} (installed packages carry no "
            "csrc/; build the extension at install time instead)"
        )
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    if cuda_home is None or not (Path(cuda_home) / "bin" / "nvcc").exists():
        return "nvcc not found (set CUDA_HOME to a CUDA toolkit)"
    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


# ---- just-in-time build -----------------------------------------------------------------------


def _target_archs() -> str:
    configured = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if configured:
        return configured
    # torch compiles for the visible GPUs when the list is unset; key the cache on them.
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(capabilities))


def _build_key() -> str:
    digest = hashlib.sha256()
    for name in _JIT_SOURCES + _JIT_HEADERS:
        digest.update(name.encode())
        digest.update((_CSRC_DIR / name).read_bytes())
    settings = (torch.__version__, str(torch.version.cuda), _target_archs())
    for part in settings + _JIT_CFLAGS + _JIT_CUDA_CFLAGS:
        digest.update(part.encode())
    return digest.hexdigest()[:12]


def _say(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}{message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _exclusive_lock(path: Path, waiting_message: str) -> Iterator[None]:
    import fcntl

    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(waiting_message)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _jit_build_and_load() -> Path:
    from torch.utils import cpp_extension

    name = f"{_EXT_NAME}_{_build_key()}"
    build_dir = cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    waiting = f"waiting for another process compiling lightning_zeroq CUDA kernels in {build_dir}"
    with _exclusive_lock(build_dir / "zeroq.lock", waiting):
        if library.is_file():
            try:
                _load_library(library)
                return library
            except OSError as err:  # e.g. a build killed while linking; build it again
                logger.warning("lightning_zeroq: cached %s fails to load (%s); rebuilding", library, err)
                library.unlink()
        _say(f"compiling lightning_zeroq CUDA kernels once, ~60 s, cached in {build_dir}")
        # torch's own lock file; a stale one from a killed build would make load() wait forever,
        # and while we hold our lock nobody else is building here.
        (build_dir / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(_CSRC_DIR / f) for f in _JIT_SOURCES],
            extra_cflags=list(_JIT_CFLAGS),
            extra_cuda_cflags=list(_JIT_CUDA_CFLAGS),
            extra_include_paths=[str(_CSRC_DIR)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        if not _library.cuda_key_has_kernels():
            raise RuntimeError(f"{library} registered no CUDA kernels for every zeroq:: op")
    return library


def main() -> int:
    """Builds (if needed) and loads the kernels now; exit status 0 when they are compiled ones.

    ``python -c "from lightning_zeroq.ops._load import main; raise SystemExit(main())"``
    (not ``python -m``, which would run a second copy of this module beside the imported one).
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to build", file=sys.stderr)
        return 1
    backend = load_cuda_backend()
    print(backend.value)
    return 0 if backend in (Backend.PREBUILT, Backend.JIT) else 1
