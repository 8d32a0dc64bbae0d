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
    from tests.integration.engine.stage3 import test_stage3

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


def _reduction_pool_body(stage: int, identity: bool = False) -> tuple[int, int, int]:
    """Bytes of the segments the reduction stream's pool holds after three steps, beside the working-dtype
    and the fp32 bytes of the units' gradients. One rank: ``identity`` False makes the reduction copy the
    gradients into flat parts as it does where they travel; True leaves them as autograd made them."""
    import torch
    import torch.nn.functional as F

    from lightning_zeroq import ZeroConfig, ZeroEngine
    from lightning_zeroq.cli.gpt import GPTConfig, GPTModel

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()  # torch hands out pooled streams: none keeps an earlier test's cached blocks
    torch.manual_seed(0)
    # units of 12.6M elements (25 MB in bf16): above the allocator's 10 MiB, each its own segment
    model = GPTModel(GPTConfig(n_layer=6, n_embd=1024, n_head=16, block_size=128, vocab_size=1024)).to(device)
    units = ({"stage3_wrap_classes": ["Block"], "stage3_param_persistence_threshold": 0} if stage == 3
             else {"reduce_bucket_size": 16_000_000})
    engine = ZeroEngine(model, ZeroConfig(stage=stage, **units),
                        param_dtype=torch.bfloat16, device=device)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    engine.parts.reducer.wire.identity = identity
    tokens = torch.randint(0, 1024, (4, 128), device=device)
    for _ in range(3):
        logits = model(tokens)
        engine.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1)))
        engine.step()
        engine.zero_grad()
    torch.cuda.synchronize()
    side = engine.parts.reducer._stream.stream
    assert side is not None, "overlap_comm puts the reductions on a side stream on CUDA"
    pool = sum(s["total_size"] for s in torch.cuda.memory_snapshot() if s["stream"] == side.cuda_stream)
    stepped = [u for u in engine.parts.units if engine.parts.reducer.gradients.master_on_device(u.index)]
    working = sum(2 * u.layout.padded_numel for u in stepped)
    fp32 = sum(4 * u.layout.shard_numel for u in stepped)
    engine.close()
    return pool, working, fp32


@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_gradient_shards_are_not_made_in_the_reduction_streams_pool(gpu_pool, stage):
    # The reduced parts wait in the working dtype until the window ends; the fp32 shards made then come
    # from the compute stream's pool, which the backward has just freed. Made on the reduction stream
    # beside the parts, neither set of blocks could serve the other and that pool kept both (stage 3,
    # 953M GPT, one H200: 5.72 GiB cached there, 1.2 GiB more reserved than FSDP2).
    pool, working, fp32 = gpu_pool(1).run(_reduction_pool_body, stage)[0]
    # the parts' blocks (rounded up by the allocator), not the shards' too (working + fp32 before)
    assert pool < working + fp32 // 2, (pool, working, fp32)
    # at one rank nothing is reduced: the gradients wait where autograd made them, the side pool holds nothing
    assert gpu_pool(1).run(_reduction_pool_body, stage, True)[0][0] == 0

@pytest.mark.parametrize("stage", [2, 3])
def test_muon_on_the_host_is_the_gpus_step_nccl(gpu_pool, stage):
    """Offloaded Muon (the host kernel's parts, pinned bf16 journeys, the next unit blended while the GPU
    orthogonalizes this one) against Muon stepping on the GPU: bitwise."""
    from tests.integration.engine.optim import test_muon

    assert gpu_pool(WORLD).run(test_muon._matrices_pair, stage, "cuda") == [3] * WORLD
