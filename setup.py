"""Optional ahead-of-time build of the CUDA kernels (``lightning_zeroq/_C*.so``) from ``csrc/``.

All metadata lives in pyproject.toml; setuptools runs this file only for ``ext_modules``. The
extension is built when all of these hold, otherwise the install is pure Python (and the ops
JIT-compile on first use or fall back to the PyTorch reference, see lightning_zeroq/ops/_load.py):

- ``ZEROQ_BUILD_EXT`` is not ``0``;
- torch is importable in the build environment and is a CUDA build (``torch.version.cuda``);
  with pip that means ``pip install --no-build-isolation .``, since an isolated build has no torch;
- a CUDA toolkit (``nvcc``) is found (``CUDA_HOME``).

Target architectures come from ``TORCH_CUDA_ARCH_LIST`` (default ``9.0``: H100/H200).
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

_ROOT = Path(__file__).resolve().parent
_SOURCES = ["csrc/ops.cpp", "csrc/quant_int8.cu"]
_PY_LIMITED_API = "cp310"  # the library has no Python code; one file serves every Python >= 3.10


def _skip(reason: str) -> tuple[list, dict, dict]:
    print(f"lightning_zeroq: not building the CUDA extension ({reason}); pure-Python install")
    return [], {}, {}


def _extension() -> tuple[list, dict, dict]:
    if os.environ.get("ZEROQ_BUILD_EXT", "1") == "0":
        return _skip("ZEROQ_BUILD_EXT=0")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return _skip("torch is not importable here; use pip install --no-build-isolation")
    if torch.version.cuda is None:
        return _skip(f"torch {torch.__version__} is not a CUDA build")
    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return _skip("nvcc not found; set CUDA_HOME")
    if not all((_ROOT / source).is_file() for source in _SOURCES):
        return _skip("csrc/ sources not found")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    extension = CUDAExtension(
        name="lightning_zeroq._C",
        sources=_SOURCES,
        include_dirs=[str(_ROOT / "csrc")],
        extra_compile_args={"cxx": ["-O3", "-DPy_LIMITED_API=0x030A0000"], "nvcc": ["-O3"]},
        py_limited_api=True,
    )
    return [extension], {"build_ext": BuildExtension}, {"bdist_wheel": {"py_limited_api": _PY_LIMITED_API}}


_ext_modules, _cmdclass, _options = _extension()
setup(ext_modules=_ext_modules, cmdclass=_cmdclass, options=_options)
