"""Stage 3's frozen parts on CUDA with NCCL: parity with DDP (prefetch on the gather stream), no frozen byte
resting on the device with ``offload_parameters``, and the INT8 kernels' storage numerics."""

from __future__ import annotations

import os

import pytest

from tests.integration.engine.frozen import test_frozen_parts as frozen_tests

pytestmark = pytest.mark.gpu
WORLD = int(os.environ.get("ZEROQ_GPU_WORLD", "2"))


@pytest.mark.parametrize("offload", [o for o in frozen_tests.OFFLOAD if o != "hybrid"])
def test_lora_matches_ddp_nccl(gpu_pool, offload) -> None:
    for r in gpu_pool(WORLD).run(frozen_tests._parity, offload, True, 0.5, "cuda"):
        assert r["worst"] < 1e-6, r
        if "offload_parameters" in frozen_tests.OFFLOAD[offload]:
            assert r["on_device"] == 0, r


@pytest.mark.parametrize("storage, bound", [("bf16", 2 ** -8), ("int8", 1 / 127)])
def test_frozen_storage_rounds_as_documented_cuda(gpu_pool, storage, bound) -> None:
    for worst in gpu_pool(WORLD).run(frozen_tests._storage_numerics, storage, "cuda"):
        assert 0 < worst <= bound, worst
