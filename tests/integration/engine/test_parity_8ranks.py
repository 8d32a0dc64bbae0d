"""Parity at 8 ranks on gloo: the feature-rich model (tied weights, a block used twice, a frozen layer,
a layer used on some steps only, one never used, a small LayerNorm) with stages 1-3, CPU offload and
INT8 weights. At 8 ranks most units leave some ranks with a shard of pure padding (stage 1/2, buckets
of 300: the 83-element unit is padded to 512, so ranks 2-7 own nothing of it), which 2 and 3 ranks
rarely show.

- Full width: ``_parity_body`` (DDP, step by step, 1e-5), as ``test_engine_parity`` runs it at 2 and 3.
- INT8 weights cannot match DDP to 1e-5; they are held to what does hold: after every step all 8
  ranks hold bitwise the same working weights, equal to the reference reconstruction
  (``test_quantized._check_units``), and training follows the full-width run of the same engine on
  the same data within the measured tolerances stated below.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.models import RichModel, make_batch, param_groups
from tests.integration.engine.test_parity import OFFLOAD, STAGE3, _parity_body
from tests.integration.engine.test_quantized import _check_units

pytestmark = pytest.mark.slow
WORLD = 8


@pytest.mark.parametrize(
    "stage, offload, managed",
    [(1, "none", True), (1, "optimizer_cpu", False), (2, "none", False), (2, "optimizer_cpu", True),
     (3, "none", True), (3, "params_optimizer_cpu", False)],
)
def test_matches_ddp_at_8_ranks(dist_pool, stage, offload, managed):
    results = dist_pool(WORLD).run(_parity_body, stage, managed, 0.5, "adamw", 300, "cpu", offload)
    assert all(r < 1e-5 for r in results)


INT8_BACKWARDS = [2, 1, 3, 1, 2, 1, 1, 2]
EXACT = 64  # the embedding and the 16x16 weights are quantized; LayerNorm, biases, the 3x16 layer go exactly


def _run(stage: int, offload: str, quantized: bool) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # different init per rank: the engine syncs from rank 0
    model = RichModel()
    units = STAGE3 if stage == 3 else {"reduce_bucket_size": 300}
    config = ZeroConfig(stage=stage, quantized_weights=quantized, quantized_weights_exact_numel=EXACT,
                        allgather_bucket_size=1024, **units, **OFFLOAD[offload])
    engine = ZeroEngine(model, config)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), eps=1e-3))
    losses, states = [], []
    for step, n in enumerate(INT8_BACKWARDS):
        total = 0.0
        for micro in range(n):
            loss = model.loss(make_batch(step, micro, rank, uniform=stage == 3)) / n
            engine.backward(loss, boundary=micro == n - 1)
            total += float(loss)
        engine.clip_grad_norm_(0.5)
        engine.step()
        mean = torch.tensor(total)
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        if quantized:
            _check_units(engine, EXACT)  # bitwise identical on every rank, and what the reference says
        states.append(engine.full_state_dict())
    engine.close()
    return losses, states


def _int8_body(stage: int, offload: str) -> tuple[float, float]:
    """Worst relative loss difference and worst parameter difference, INT8 vs full width."""
    plain_losses, plain = _run(stage, offload, False)
    quant_losses, quant = _run(stage, offload, True)
    loss_dev = max(abs(q - p) / p for q, p in zip(quant_losses, plain_losses))
    param_dev = max((q[k] - p[k]).abs().max().item() for q, p in zip(quant, plain) for k in p)
    assert quant_losses[-1] < quant_losses[0], quant_losses
    return loss_dev, param_dev


@pytest.mark.parametrize("stage, offload", [(1, "optimizer_cpu"), (2, "optimizer_cpu"), (3, "params_optimizer_cpu")])
def test_int8_at_8_ranks_identical_on_every_rank_and_follows_full_width(dist_pool, stage, offload):
    results = dist_pool(WORLD).run(_int8_body, stage, offload)
    assert len(set(results)) == 1  # every rank measured the same (all-reduced losses, full state dicts)
    loss_dev, param_dev = results[0]
    print(f"stage {stage} {offload}: INT8 vs full width, loss {loss_dev:.3%}, parameters {param_dev:.3g}")
    # Measured at 8 ranks over these 8 steps (torch 2.13 CPU): loss 0.143% (stages 1, 2) and 0.128%
    # (stage 3); parameters 4.9e-3 (stages 1, 2) and 3.8e-3 (stage 3), about a quarter of one step of
    # lr 2e-2. The bounds leave about 3x room.
    assert loss_dev < 0.005 and param_dev < 0.015, (loss_dev, param_dev)
