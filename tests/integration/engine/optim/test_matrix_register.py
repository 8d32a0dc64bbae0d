"""A user's optimizer that needs each matrix whole (``register_matrix_optimizer``): refused with its fix
before it is registered; once registered with its ``MatrixRule``, stages 1-3, with and without CPU
optimizer offload, gloo, 2 and 3 ranks (3: uneven cuts), match DDP with the same optimizer within 1e-5
after every step, and the engine's full optimizer state is DDP's optimizer's state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning_zeroq
from lightning_zeroq import MatrixRule, ZeroConfig, ZeroEngine, register_matrix_optimizer
from tests.integration.engine.optim.test_muon import backward_both

DIM = 24


class NormalizedMomentum(torch.optim.Optimizer):
    """Heavy-ball momentum whose update of each matrix is scaled to unit RMS over the whole matrix (a
    norm of all its elements: a shard cannot compute it alone)."""

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf / buf.pow(2).mean().sqrt().clamp(min=1e-8), alpha=-group["lr"])


class NormalizedMomentumRule(MatrixRule):
    def blend(self, view, grad, state, group):
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(view)
        buf.mul_(group["momentum"]).add_(grad)
        return buf.clone()

    def whole(self, matrix, group):
        return matrix / matrix.pow(2).mean().sqrt().clamp(min=1e-8)

    def apply(self, view, update, group, shape):
        view.add_(update, alpha=-group["lr"])


class Matrices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.Tanh(), nn.Linear(2 * DIM, DIM, bias=False),
                                    nn.Tanh(), nn.Linear(DIM, DIM, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


CONFIGS = {
    1: {"stage": 1, "reduce_bucket_size": 500},
    2: {"stage": 2, "reduce_bucket_size": 500},
    3: {"stage": 3, "stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0},
}


def _loss(model: nn.Module, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + dist.get_rank())
    x = torch.randn(4, DIM, generator=g)
    return F.mse_loss(model(x), x.flip(-1))


def _train(stage: int, offload: bool) -> float:
    register_matrix_optimizer(NormalizedMomentum, NormalizedMomentumRule())
    torch.manual_seed(0)
    model = Matrices()
    ref = copy.deepcopy(model)
    engine = ZeroEngine(model, ZeroConfig(**CONFIGS[stage], offload_optimizer=offload))
    engine.attach_optimizer(NormalizedMomentum(model.parameters(), lr=0.02))
    ddp = DistributedDataParallel(ref)
    theirs = NormalizedMomentum(ref.parameters(), lr=0.02)
    worst = 0.0
    for step in range(10):
        backward_both(engine, model, ddp, _loss, step)
        engine.step()
        theirs.step()
        engine.zero_grad()
        theirs.zero_grad()
        full = engine.full_state_dict()
        for name, p in ref.named_parameters():
            diff = (full[name] - p.detach()).abs().max().item()
            assert diff <= 1e-5, f"step {step}: {name} differs from DDP by {diff}"
            worst = max(worst, diff)
    state = engine.full_optimizer_state()  # collective; by parameter name, at full shape
    expected = {name: theirs.state[p]["momentum_buffer"] for name, p in ref.named_parameters()}
    assert state.keys() == expected.keys()
    for name, buf in expected.items():
        assert state[name]["momentum_buffer"].shape == buf.shape, name
        assert (state[name]["momentum_buffer"] - buf).abs().max().item() <= 1e-5, name
    engine.close()
    return worst


@pytest.mark.parametrize("world_size, stage, offload", [(2, 1, False), (3, 2, True), (2, 3, True), (3, 3, False)])
def test_a_registered_matrix_optimizer_matches_ddp(dist_pool, world_size, stage, offload):
    dist_pool(world_size).run(_train, stage, offload)


def test_an_unregistered_one_is_refused_with_the_fix_and_bad_registrations_too():
    class Unknown(torch.optim.Optimizer):
        def __init__(self, params) -> None:
            super().__init__(params, {"lr": 0.1})

    model = Matrices()
    engine = ZeroEngine(model, ZeroConfig(stage=2))
    with pytest.raises(ValueError) as caught:
        engine.attach_optimizer(Unknown(model.parameters()))
    message = str(caught.value)
    assert "\n" not in message and "register_matrix_optimizer(Unknown, rule)" in message
    assert "register_elementwise_optimizer(Unknown)" in message
    engine.close()
    with pytest.raises(TypeError, match=r"takes an optimizer class .* got an object of type int"):
        register_matrix_optimizer(3, NormalizedMomentumRule())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be a lightning_zeroq.MatrixRule .* got dict"):
        register_matrix_optimizer(Unknown, {})  # type: ignore[arg-type]
    assert lightning_zeroq.register_matrix_optimizer is register_matrix_optimizer


class Misshapen(torch.optim.Optimizer):
    """Stepped by ``MisshapenRule`` alone (its own ``step()`` sees no gradients in the engine)."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "momentum": 0.9})

    def step(self, closure=None):
        return None


class MisshapenRule(NormalizedMomentumRule):
    """A rule whose ``whole()`` returns the wrong shape: the matrix transposed (the same number of
    elements: wrong weights, silently, if unchecked), a row short (one rank's apply fails while the other
    waits in the next gather) or no tensor at all."""

    def __init__(self, how: str) -> None:
        self.how = how

    def whole(self, matrix, group):
        out = super().whole(matrix, group)
        return {"transposed": out.t(), "a_row_short": out[:-1], "a_list": out.tolist()}[self.how]


def _misshapen(how: str) -> tuple[str, str]:
    register_matrix_optimizer(Misshapen, MisshapenRule(how))
    torch.manual_seed(0)
    model = Matrices()
    # One unit of the three matrices, cut in two shards: layers.0.weight (48 x 24) lies in rank 0's shard
    # alone, so rank 1 holds none of it and applies nothing of it.
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=10_000))
    engine.attach_optimizer(Misshapen(model.parameters()))
    try:
        for step in range(2):
            engine.backward(_loss(model, step, 0))
            engine.step()
            engine.zero_grad()
    except Exception as error:
        return type(error).__name__, str(error)
    finally:
        engine.close()
    return "ok", ""


@pytest.mark.parametrize("how, kind, returned", [("transposed", "ValueError", "returned shape (24, 48)"),
                                                 ("a_row_short", "ValueError", "returned shape (47, 24)"),
                                                 ("a_list", "TypeError", "returned a list")])
def test_a_rule_whose_whole_returns_another_shape_is_one_error_on_every_rank(dist_pool, how, kind, returned):
    results = dist_pool(2).run(_misshapen, how)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    got_kind, message = results[0]
    assert got_kind == kind, results
    for needle in ("MisshapenRule.whole()", returned, "layers.0.weight", "of shape (48, 24)", "Misshapen"):
        assert needle in message, f"{needle!r} not in: {message}"


class Counted(torch.optim.Optimizer):
    """NormalizedMomentum under a class of its own (not a subclass: ``rule_of`` would find that one's rule)."""

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    step = NormalizedMomentum.step


class CountingRule(NormalizedMomentumRule):
    """Counts the matrices this rank transforms, by shape."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, ...]] = []

    def whole(self, matrix, group):
        self.seen.append(tuple(matrix.shape))
        return super().whole(matrix, group)


def _count_transforms(stage: int, offload: bool) -> list[tuple[int, ...]]:
    rule = CountingRule()
    register_matrix_optimizer(Counted, rule)
    torch.manual_seed(0)
    model = Matrices()
    engine = ZeroEngine(model, ZeroConfig(**CONFIGS[stage], offload_optimizer=offload))
    engine.attach_optimizer(Counted(model.parameters()))
    try:
        for step in range(2):
            engine.backward(_loss(model, step, 0))
            engine.step()
            engine.zero_grad()
    finally:
        engine.close()
    return rule.seen


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage, offload", [(2, False), (3, False), (3, True)])
def test_each_matrix_is_transformed_once_by_its_owner(dist_pool, world_size, stage, offload):
    """Over all ranks, every matrix's whole() runs once per step (not once per rank), each on the rank
    ``owners`` gives it, and the work is spread: no rank transforms every matrix."""
    seen = dist_pool(world_size).run(_count_transforms, stage, offload)
    shapes = [(2 * DIM, DIM), (DIM, 2 * DIM), (DIM, DIM)]
    assert sorted(s for per_rank in seen for s in per_rank) == sorted(shapes * 2)
    assert max(len(per_rank) for per_rank in seen) < len(shapes) * 2


def test_owners_balance_the_newton_schulz_cost_alike_on_every_rank():
    from lightning_zeroq.zero.optim.matrix import owners

    shapes = [(4096, 4096), (4096, 1024), (1024, 4096), (14336, 4096), (4096, 14336), (4096, 1024)]
    assert owners(shapes, 1) == [0] * 6
    got = owners(shapes, 2)
    assert got == owners(list(shapes), 2)  # from the shapes alone
    assert got[3] != got[4]  # the two largest on different ranks
    assert sorted(set(got)) == [0, 1]
    assert owners([(8, 8)] * 3, 4) == [0, 1, 2]
    assert owners([(8, 8)] * 3, 4, first=5) == [1, 2, 3]  # a batch of unit 5 starts at rank 1
