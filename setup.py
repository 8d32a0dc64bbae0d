"""The CUDA kernels ahead of time (``lightning_zeroq/_C*.so``).

All metadata lives in pyproject.toml; setuptools runs this file only for ``ext_modules``. What is built, from which
sources, with which flags, and what is missing to build it, come from ``lightning_zeroq/ops/_build.py``, which the
first use of a kernel follows too; it is loaded by its path, since the build environment may have no torch to
import the package with. The extension is built when ``ZEROQ_BUILD_EXT`` is not ``0``, torch is importable and a
CUDA build (with pip: ``pip install --no-build-isolation .``) and nvcc is found (``CUDA_HOME``); otherwise the
install is pure Python.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

_spec = importlib.util.spec_from_file_location("_zeroq_build", Path(__file__).resolve().parent / "lightning_zeroq"
                                               / "ops" / "_build.py")
assert _spec is not None and _spec.loader is not None
_build = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(_build)

_arguments: dict = {}
_reason = "ZEROQ_BUILD_EXT=0" if os.environ.get("ZEROQ_BUILD_EXT", "1") == "0" else _build.missing(
    _build.CUDA_KERNELS, jit=False)
if _reason is None:
    from torch.utils.cpp_extension import BuildExtension

    _arguments.update(ext_modules=[_build.cuda_extension()], cmdclass={"build_ext": BuildExtension},
                      options={"bdist_wheel": {"py_limited_api": _build.PY_LIMITED_API}})
else:
    print(f"lightning_zeroq: not building the CUDA extension ({_reason}); pure-Python install")
setup(**_arguments)
