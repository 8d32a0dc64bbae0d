"""Finding, building and loading the compiled CUDA kernels: lazily, once per process.

Importing this module does nothing: no CUDA initialization, no compiler, no file access. The first
``lightning_zeroq.ops`` call with a CUDA tensor (or an explicit :func:`load_cuda_backend`) fills the
``CUDA`` dispatch key of the ``zeroq::`` ops, trying in order:

1. ``ZEROQ_DISABLE_EXT=1``: the PyTorch reference, on purpose.
2. Kernels already registered for ``zeroq::`` on CUDA (the library was loaded by other means).
3. Prebuilt: ``lightning_zeroq/_C*.so``, built by ``setup.py`` at install time, loaded with
   ``torch.ops.load_library``.
4. Just in time: if torch is a CUDA build and ``nvcc``, ``ninja`` and the ``csrc/`` sources (carried by the
   wheel, or a source checkout's) are present, ``torch.utils.cpp_extension.load`` compiles them once into the
   cache directory (``$ZEROQ_EXT_CACHE``, default ``~/.cache/lightning_zeroq/<torch version>-cuda<CUDA
   version>/``), one subdirectory per hash of sources, torch version and target architectures, with the
   sources, flags, lock and messages of ``ops/_build.py`` (``setup.py``'s too): one process (one rank)
   compiles while the others wait, each saying so on stderr, and then load the cached library; later
   processes load it without compiling.
5. Otherwise the reference, with one WARNING that says why.

Which path is active is logged once at INFO. Compiling takes about a minute; to keep it out of a
training step (other ranks would wait in a collective), build ahead of time (``pip install
--no-build-isolation .`` with a CUDA torch) or warm the cache with
``python -c "from lightning_zeroq.ops._load import main; raise SystemExit(main())"``.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from lightning_zeroq.ops import _build, _library
from lightning_zeroq.ops._build import CUDA_KERNELS, cache_dir

__all__ = ["Backend", "active_backend", "cache_dir", "has_cuda_kernel", "load_cuda_backend"]

logger = logging.getLogger("lightning_zeroq.ops")


class Backend(str, enum.Enum):
    """What implements the ``zeroq::`` ops on CUDA tensors in this process."""

    UNRESOLVED = "unresolved"  # no CUDA tensor has reached the ops yet
    PREBUILT = "cuda-prebuilt"  # lightning_zeroq/_C*.so (or kernels registered by other means)
    JIT = "cuda-jit"  # compiled from csrc/ into the cache directory
    REFERENCE = "reference"  # the PyTorch reference, registered for CUDA


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
            failures.append(_build.failed(CUDA_KERNELS, err))
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
    candidates = sorted(_build.PACKAGE.glob("_C*.so"))
    return candidates[0] if candidates else None


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))
    if not _library.cuda_key_has_kernels():
        raise RuntimeError(f"{path} registered no CUDA kernels for every zeroq:: op")


def _jit_unavailable_reason() -> str | None:
    if torch.version.cuda is not None and not torch.cuda.is_available():
        return "CUDA is not available"
    return _build.missing(CUDA_KERNELS, jit=True)  # the toolchain, then the sources


# ---- just-in-time build -----------------------------------------------------------------------


def _target_archs() -> str:
    configured = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if configured:
        return configured
    # torch compiles for the visible GPUs when the list is unset; key the cache on them.
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(capabilities))


def _jit_build_and_load() -> Path:
    from torch.utils import cpp_extension

    def make(folder: Path, library: Path) -> None:
        # torch's own lock file; a stale one from a killed build would make load() wait forever,
        # and while we hold our lock nobody else is building here.
        (folder / "lock").unlink(missing_ok=True)
        csrc = _build.source_dir()
        assert csrc is not None  # _jit_unavailable_reason() found the sources
        cpp_extension.load(
            name=library.stem,
            sources=[str(csrc / f) for f in CUDA_KERNELS.sources],
            extra_cflags=list(CUDA_KERNELS.cflags),
            extra_cuda_cflags=list(CUDA_KERNELS.cuda_cflags),
            extra_include_paths=[str(csrc)],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )

    def load(library: Path) -> Path:
        _load_library(library)
        return library

    key = _build.build_key(CUDA_KERNELS, torch.__version__, str(torch.version.cuda), _target_archs())
    return _build.build(CUDA_KERNELS, key, make, load)


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
