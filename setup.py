"""The build's code: the folders the wheel carries inside the package, and the CUDA kernels ahead of time.

All metadata lives in pyproject.toml; setuptools runs this file for ``packages``, ``package_dir``, ``package_data``
and ``ext_modules``. What is built, from which sources, with which flags, and what is missing to build it, come
from ``lightning_zeroq/ops/_build.py``, which the first use of a kernel follows too; it is loaded by its path, since
the build environment may have no torch to import the package with. The CUDA extension (``lightning_zeroq/_C*.so``)
is built when ``ZEROQ_BUILD_EXT`` is not ``0``, torch is importable and a CUDA build (with pip: ``pip install
--no-build-isolation .``) and nvcc is found (``CUDA_HOME``); otherwise the install is pure Python.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup

_spec = importlib.util.spec_from_file_location("_zeroq_build", Path(__file__).resolve().parent / "lightning_zeroq"
                                               / "ops" / "_build.py")
assert _spec is not None and _spec.loader is not None
_build = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(_build)

# conf/, recipes/ and csrc/ stay at the top of the checkout; the wheel carries them inside the package.
_packages = find_packages(include=["lightning_zeroq*"])
_package_data = {"lightning_zeroq": ["py.typed"]}  # PEP 561: the package's annotations are its users' too
for _package, (_folder, _patterns) in _build.DATA.items():
    _inner = [_package] + [f"{_package}.{sub}" for sub in find_namespace_packages(where=_folder)]
    _packages += _inner
    _package_data.update({name: list(_patterns) for name in _inner})
_arguments = {"packages": _packages, "package_data": _package_data,
              "package_dir": {package: folder for package, (folder, _) in _build.DATA.items()}}

_reason = "ZEROQ_BUILD_EXT=0" if os.environ.get("ZEROQ_BUILD_EXT", "1") == "0" else _build.missing(
    _build.CUDA_KERNELS, jit=False)
if _reason is None:
    from torch.utils.cpp_extension import BuildExtension

    _arguments.update(ext_modules=[_build.cuda_extension()], cmdclass={"build_ext": BuildExtension},
                      options={"bdist_wheel": {"py_limited_api": _build.PY_LIMITED_API}})
else:
    print(f"lightning_zeroq: not building the CUDA extension ({_reason}); pure-Python install")
setup(**_arguments)
