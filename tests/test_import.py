"""Importing the package is lean: it initializes no CUDA, compiles nothing and loads no extension
(``docs/DESIGN.md``'s invariant), checked in a fresh interpreter."""

import os
import subprocess
import sys

import lightning_zeroq


def test_import_initializes_no_cuda_and_compiles_nothing(tmp_path):
    # In a fresh interpreter: no CUDA context, the compiler front end (torch.utils.cpp_extension) not
    # even imported, no extension library loaded, no zeroq:: CUDA kernel registered, the CUDA backend
    # still unresolved and the JIT cache directory untouched.
    code = (
        "import sys, torch; import lightning_zeroq; from lightning_zeroq.ops import _library, _load; "
        "problems = [what for what, bad in ["
        "('CUDA initialized', torch.cuda.is_initialized()), "
        "('torch.utils.cpp_extension imported', 'torch.utils.cpp_extension' in sys.modules), "
        "('libraries loaded: %s' % sorted(torch.ops.loaded_libraries), bool(torch.ops.loaded_libraries)), "
        "('zeroq:: CUDA kernels registered', _library.cuda_key_has_kernels()), "
        "('CUDA backend resolved: %s' % _load.active_backend(), "
        "_load.active_backend() is not _load.Backend.UNRESOLVED), "
        "('JIT cache created', _load.cache_dir().exists())] if bad]; "
        "print(problems or 'ok')"
    )
    env = {**os.environ, "ZEROQ_EXT_CACHE": str(tmp_path / "ext-cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "ok", out.stdout
    assert lightning_zeroq.__version__
