"""Optimizer offload through the host kernel (ops.host_adam) is bitwise the offload through torch's
fused CPU step, and takes its own paths: bf16 gradients to the host, the multiplier (clipping) on the
fly, the bf16 working copy the wire and stage 3's host store take instead of the master. Two gloo
ranks; the same training with the kernel and with it switched off, compared bit for bit after every
step (masters, optimizer state, working weights, losses)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.integration.engine.offload.scripted import Window, same, snapshot, train, two_heads_engine
from tests.integration.engine.offload.test_offload import TwoHeads, _loss


pytestmark = pytest.mark.usefixtures("host_kernel")  # tests/conftest.py: skips where it cannot match torch


CASES = {
    "s2_opt_bf16": (2, {"offload_optimizer": True}, torch.bfloat16),
    "s2_opt_fp32": (2, {"offload_optimizer": True}, torch.float32),
    "s1_opt_bf16": (1, {"offload_optimizer": True}, torch.bfloat16),
    "s3_params_bf16": (3, {"offload_optimizer": True, "offload_parameters": True}, torch.bfloat16),
    "s3_opt_bf16": (3, {"offload_optimizer": True}, torch.bfloat16),
    "s2_ratio_bf16": (2, {"offload_optimizer": True, "offload_optimizer_ratio": 0.5}, torch.bfloat16),
    "s3_params_ratio_bf16": (3, {"offload_optimizer": True, "offload_parameters": True,
                                 "offload_optimizer_ratio": 0.5}, torch.bfloat16),
    "s2_ratio_async_spec_bf16": (2, {"offload_optimizer": True, "offload_optimizer_ratio": 0.5, "offload_async_step": True,
                                     "offload_speculative_step": True}, torch.bfloat16),
    "s2_nvme_bf16": (2, {"offload_optimizer": True, "offload_optimizer_device": "nvme"}, torch.bfloat16),
    "s2_hybrid_fp32": (2, {"offload_optimizer": True, "shard_group_size": 1}, torch.float32),
    "s3_hybrid_params_bf16": (3, {"offload_optimizer": True, "offload_parameters": True, "shard_group_size": 1},
                              torch.bfloat16),
}
# (backward passes per step, boundary given: managed accumulation, clip norm)
WINDOWS = {"one_backward_clip": (1, True, 0.05), "accumulate_managed": (3, True, None),
           "accumulate_unmanaged_clip": (2, False, 0.05)}


def _train(case: str, window: str, kernel_on: bool, optimizer: str, device: str = "cpu"):
    import lightning_zeroq.swap.buffers as buffers
    import lightning_zeroq.zero.offload.host as host

    exact_pin = buffers.EXACT_PIN_BYTES
    buffers.EXACT_PIN_BYTES = 0  # on CUDA every pinned buffer is registered exactly, as a large model's are

    stage, options, dtype = CASES[case]
    backwards, managed, clip = WINDOWS[window]
    options = dict(options)
    if options.get("offload_optimizer_device") == "nvme":
        options["nvme_path"] = tempfile.mkdtemp()
    real, runs, halves = host.host_adam, [0], []
    if kernel_on:
        kernel = real()
        assert kernel is not None
        run = kernel.run

        def counting(jobs, threads=None):
            runs[0] += 1
            return run(jobs, threads)

        kernel.run = counting  # type: ignore[method-assign]
    else:
        host.host_adam = lambda: None  # type: ignore[assignment]
    try:
        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        model, engine = two_heads_engine(stage, options, dtype, optimizer=optimizer, device=dev)
        placement = getattr(engine.parts.placement, "host", engine.parts.placement)
        script = [Window(backwards=backwards, head=step % 2, managed=managed, clip=clip)  # the other head is unused
                  for step in range(4)]
        out, _ = train(engine, model, script, device=dev, before_step=lambda: halves.append(len(placement.landing.half)),
                       after_step=lambda: snapshot(engine, model))  # offload_async_step: read once the step is done
        engine.close()
        return out, runs[0], halves, placement.landing.copy_all
    finally:
        buffers.EXACT_PIN_BYTES = exact_pin
        host.host_adam = real
        if kernel_on:
            del kernel.run


@pytest.mark.parametrize("optimizer", ["adamw", "adam_l2"])
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_offload_is_bitwise_torch_offload(dist_pool, case, window, optimizer):
    if optimizer == "adam_l2" and case not in ("s2_opt_bf16", "s3_params_bf16"):
        pytest.skip("Adam with L2 decay: two cases are enough")
    _compare(dist_pool(2), case, window, optimizer, "cpu")


GPU_WORLD = int(os.environ.get("ZEROQ_GPU_WORLD", "2"))


@pytest.mark.gpu
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("case", [c for c in CASES if "hybrid" not in c or GPU_WORLD > 1])
def test_kernel_offload_is_bitwise_torch_offload_cuda(gpu_pool, case, window):
    """On CUDA the kernel's paths include the copy stream, the mapped read-back, the bf16 copies to and
    from pinned memory and stage 3's pinned store."""
    _compare(gpu_pool(GPU_WORLD), case, window, "adamw", "cuda")


def _compare(pool, case, window, optimizer, device):
    results = pool.run(_train, case, window, True, optimizer, device)
    references = pool.run(_train, case, window, False, optimizer, device)
    for (ours, runs, halves, copy_all), (theirs, torch_runs, _, _) in zip(results, references):
        assert runs > 0 and torch_runs == 0, "the kernel stepped the host units (and only with it on)"
        assert copy_all == (device == "cuda"), "CUDA reads the agreement back through mapped memory"
        stage, options, dtype = CASES[case]
        if dtype == torch.bfloat16 and WINDOWS[window][:2] == (1, True) and stage > 1:
            assert all(h > 0 for h in halves), "a single reduction's bf16 gradient went to the host as it is"
        for a, b in zip(ours, theirs):
            assert same(a, b), f"step {a[0]}: the losses, masters, optimizer state or working weights differ"


def _working_body():
    """After a kernel step the working weights are the masters' bf16 casts, everywhere they rest: the
    module (stage 2) and stage 3's host store."""
    from lightning_zeroq.zero.offload.stores import HostStore

    out = {}
    for stage, options in ((2, {"offload_optimizer": True}),
                           (3, {"offload_optimizer": True, "offload_parameters": True})):
        torch.manual_seed(0)
        model = TwoHeads().to(torch.bfloat16)
        engine = ZeroEngine(model, ZeroConfig(stage=stage, reduce_bucket_size=700, stage3_wrap_classes=["Linear"],
                                              stage3_param_persistence_threshold=40, **options),
                            param_dtype=torch.bfloat16)
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        engine.backward(_loss(model, 0, 0, 0).float(), boundary=True)
        engine.step()
        store = engine.parts.gatherer.store
        checked = 0
        for unit in engine.parts.units:
            cast = unit.master.to(torch.bfloat16)
            if unit.persistent:
                shard = unit.flat[unit.layout.shard_span(dist.get_rank())]
                assert torch.equal(shard, cast), unit.index
            else:
                assert isinstance(store, HostStore)
                assert torch.equal(store.buffers[unit.index], cast), unit.index
            checked += 1
        out[stage] = checked
        engine.close()
    return out


def test_working_weights_are_the_masters_casts(dist_pool):
    for checked in dist_pool(2).run(_working_body):
        assert checked[2] > 0 and checked[3] > 0
