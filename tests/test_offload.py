"""Offload and accumulation semantics for every stage: heads that alternate between windows, and
managed == unmanaged == offloaded for the same micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.models import DIM, SEQ, VOCAB
from tests.test_engine_parity import OFFLOAD

COMBOS = [(1, "none"), (1, "optimizer_cpu"), (2, "none"), (2, "optimizer_cpu"),
          (3, "none"), (3, "optimizer_cpu"), (3, "params_optimizer_cpu")]


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(DIM, VOCAB), nn.Linear(DIM, VOCAB)])

    def forward(self, tokens: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](self.trunk(tokens))


def _loss(model, step: int, micro: int, head: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(97 * step + 7 * micro + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    return F.cross_entropy(model(tokens, head).reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))


def _engine(stage: int, offload: str, managed: bool) -> tuple[TwoHeads, ZeroEngine]:
    torch.manual_seed(0)
    model = TwoHeads()
    config = ZeroConfig(stage=stage, managed_gradient_accumulation=managed, reduce_bucket_size=700,
                        stage3_wrap_classes=["Linear"], stage3_param_persistence_threshold=40,
                        **OFFLOAD[offload])
    engine = ZeroEngine(model, config)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return model, engine


def _head_state(engine: ZeroEngine, model: TwoHeads, head: int) -> tuple[list[torch.Tensor], int]:
    """This rank's masters and optimizer state of one head's parameters (cloned), and how many of its
    segments have optimizer state."""
    ids = {id(p) for p in model.heads[head].parameters()}
    out, with_state = [], 0
    for seg_master, unit, seg in engine._segment_table:
        if id(unit.params[seg.param]) in ids:
            out.append(seg_master.detach().clone())
            state = engine.optimizer.state.get(seg_master, {})
            with_state += bool(state)
            out.extend(v.detach().clone() for v in state.values())
    return out, with_state


def _train(stage: int, offload: str, managed: bool, backwards=(2, 5, 3), heads=(0, 1, 0)):
    model, engine = _engine(stage, offload, managed)
    snapshots = []
    for step, (n, head) in enumerate(zip(backwards, heads)):
        for micro in range(n):
            engine.backward(_loss(model, step, micro, head) / n, boundary=micro == n - 1)
        engine.clip_grad_norm_(1.0)
        engine.step()
        snapshots.append((_head_state(engine, model, 0), _head_state(engine, model, 1)))
    return engine.full_state_dict(), snapshots


def _alternating_body(stage: int, offload: str, managed: bool) -> None:
    _, snaps = _train(stage, offload, managed)
    ((a0, _), (b0, b0_state)), ((a1, _), (b1, _)), ((a2, _), (b2, _)) = snaps
    assert b0_state == 0  # head B got no gradient in window A: never stepped, no optimizer state
    # window B: head A is bitwise untouched, value and optimizer state
    assert len(a0) == len(a1) and all(torch.equal(x, y) for x, y in zip(a0, a1))
    # window A again: head B, stepped once in window B, is untouched
    assert len(b1) == len(b2) and all(torch.equal(x, y) for x, y in zip(b1, b2))
    assert any(not torch.equal(x, y) for x, y in zip(a1, a2))  # and head A moves again


@pytest.mark.parametrize("stage, offload", COMBOS)
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_inactive_head_untouched(dist_pool, stage, offload, managed):
    dist_pool(2).run(_alternating_body, stage, offload, managed)


def _modes_body(stage: int, offload: str) -> float:
    managed, _ = _train(stage, offload, True)
    unmanaged, _ = _train(stage, offload, False)
    plain, _ = _train(stage, "none", True)
    for k in managed:
        assert torch.equal(managed[k], unmanaged[k]), f"managed != unmanaged for {k}"
    # offloaded steps run torch's fused CPU AdamW, the plain run the default implementation
    return max((managed[k] - plain[k]).abs().max().item() for k in managed)


@pytest.mark.parametrize("stage, offload", COMBOS)
def test_unmanaged_equals_managed_and_offload_equals_plain(dist_pool, stage, offload):
    worst = dist_pool(2).run(_modes_body, stage, offload)
    assert max(worst) < 1e-6
