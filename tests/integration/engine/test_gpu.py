"""The parity tests again on CUDA GPUs with NCCL (``overlap_comm`` on: reductions on a side stream).

Run on a machine with 2 GPUs: ``python -m pytest -q -m gpu tests/integration/engine/test_gpu.py``; at another world size
(e.g. all 8 GPUs of a host): ``ZEROQ_GPU_WORLD=8 python -m pytest -q -m gpu tests/integration/engine/test_gpu.py``.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.engine import test_parity as engine_tests
from tests.integration.lightning import test_parity as strategy_tests

pytestmark = pytest.mark.gpu

WORLD = int(os.environ.get("ZEROQ_GPU_WORLD", "2"))
"""Ranks (one GPU each) of every test here; the test bodies are the CPU suite's, which run at 2, 3 and 8."""


def needs_world(ranks: int, why: str) -> pytest.MarkDecorator:
    """Skip below ``ranks`` GPUs (a body that makes rank 1 differ from rank 0 has no rank 1 at 1)."""
    return pytest.mark.skipif(WORLD < ranks, reason=f"{why}: needs ZEROQ_GPU_WORLD >= {ranks} (it is {WORLD})")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_engine_matches_ddp_nccl(gpu_pool, stage, managed):
    worst = gpu_pool(WORLD).run(engine_tests._parity_body, stage, managed, 0.5, "adamw", 300, "cuda")
    print(f"stage {stage} {'managed' if managed else 'unmanaged'}: worst |zeroq - ddp| = {max(worst):.3g}")
    assert max(worst) < 1e-5


@pytest.mark.parametrize(
    "stage, offload",
    [(1, "optimizer_cpu"), (2, "optimizer_cpu"), (3, "optimizer_cpu"), (3, "params_optimizer_cpu"),
     (2, "optimizer_nvme"), (3, "optimizer_nvme"), (1, "optimizer_cpu_0.5"), (2, "optimizer_cpu_0.5"),
     (3, "optimizer_cpu_0.25"), (2, "optimizer_cpu_auto"), (3, "optimizer_cpu_auto"),
     (2, "optimizer_cpu_spec"), (3, "params_optimizer_cpu_spec"), (2, "optimizer_cpu_0.5_spec"),
     (2, "optimizer_cpu_async"), (3, "params_optimizer_cpu_async"), (3, "params_optimizer_cpu_spec_async")],
)
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_offload_matches_ddp_nccl(gpu_pool, stage, offload, managed):
    # exercises the pinned host buffers, the gradient copies on the copy stream and the copy back with its cast
    worst = gpu_pool(WORLD).run(engine_tests._parity_body, stage, managed, 0.5, "adamw", 300, "cuda", offload)
    print(f"stage {stage} {offload} {'managed' if managed else 'unmanaged'}: worst = {max(worst):.3g}")
    assert max(worst) < 1e-5


@needs_world(2, "only rank 1 overflows, and rank 0 must skip the step with it")
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_skips_step_nccl(gpu_pool, stage):
    scales = gpu_pool(WORLD).run(engine_tests._overflow_body, stage, "cuda")
    assert scales[0] == scales[1] < 2.0**16


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_trainer_matches_ddp_nccl(gpu_pool, stage, managed):
    steps = gpu_pool(WORLD).run(strategy_tests._parity_body, stage, managed, "gpu")
    assert steps[0] == 6


@pytest.mark.parametrize("stage", [1, 2])
def test_manual_optimization_nccl(gpu_pool, stage):
    gpu_pool(WORLD).run(strategy_tests._manual_body, stage, "gpu")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_half_precision_follows_fp32_gpu(gpu_pool, precision):
    fp32, low = gpu_pool(WORLD).run(strategy_tests._precision_body, precision, "gpu")[0]
    worst = max(abs(a - b) / abs(a) for a, b in zip(fp32, low))
    print(f"{precision}: worst relative loss deviation from fp32 over {len(low)} steps = {worst:.4f}")
    assert worst < 0.02 and low[-1] < low[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_quantized_reconstruction_nccl(gpu_pool, dtype):
    from tests.integration.engine import test_quantized

    gpu_pool(WORLD).run(test_quantized._reconstruction_body, dtype, "cuda")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_quantized_identical_working_weights_nccl(gpu_pool, stage):
    from tests.integration.engine import test_quantized

    gpu_pool(WORLD).run(test_quantized._train_body, stage, True, 6, True, "cuda")


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "on-demand"])
def test_stage3_changing_control_flow_nccl(gpu_pool, prefetch):
    from tests.integration.engine import test_stage3

    gpu_pool(WORLD).run(test_stage3._path_body, prefetch, "cuda")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_late_gradients_reentrant_checkpointing_nccl(gpu_pool, stage):
    from tests.integration.engine import test_accumulation

    worst = gpu_pool(WORLD).run(test_accumulation._reentrant_body, stage, True, "cuda")
    print(f"stage {stage} reentrant checkpointing: worst |zeroq - reference| = {max(worst):.3g}")


@needs_world(2, "only rank 1 sees non-finite gradients, and rank 0 must stop with it")
def test_nonfinite_gradients_stop_every_rank_nccl(gpu_pool):
    from tests.integration.engine import test_nonfinite

    for r in gpu_pool(WORLD).run(test_nonfinite._nonfinite_body, "error", 2, "cuda"):
        assert "rank(s) [1]" in r["error"] and r["unchanged"], r


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_one_optimizer_step_per_step_nccl(gpu_pool, offload):
    from tests.integration.engine import test_accumulation

    assert all(c == (3, 3) for c in gpu_pool(WORLD).run(test_accumulation._one_step_body, offload, "cuda"))

