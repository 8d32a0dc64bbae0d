"""How an optimizer is bound to the engine's master shards and handed back: state its constructor
made (Adagrad's) is kept, an optimizer used by one fit can be used by the next, and a fit without an
optimizer runs as with DDP."""

from __future__ import annotations

import copy
from typing import Optional

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_zeroq import ZeroQStrategy
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero.engine import ZeroEngine
from tests.models import RichModel, TokenDataset, make_batch, param_groups

FREED = {"stage3_wrap_classes": ["Sequential", "Linear"], "stage3_param_persistence_threshold": 0}


def _adagrad_body(stage: int, offload: bool) -> float:
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = RichModel()
    ref_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref_model, find_unused_parameters=True)
    # initial_accumulator_value != 0: Adagrad's constructor fills "sum" with it; losing it changes every step.
    kwargs = {"initial_accumulator_value": 0.1, "lr_decay": 0.01}
    ref_opt = torch.optim.Adagrad(param_groups(ref_model), **kwargs)
    extra = FREED if stage == 3 else {"reduce_bucket_size": 300}
    engine = ZeroEngine(model, ZeroConfig(stage=stage, offload_optimizer=offload, **extra))
    optimizer = torch.optim.Adagrad(param_groups(model), **kwargs)  # stage 3: built on freed weights, as in fit
    # An accumulator that differs element by element (as one loaded from a checkpoint would), so each
    # segment must get its own slice of it; torch would re-create a lost one as the constant 0.1.
    for opt, m in ((ref_opt, ref_model), (optimizer, model)):
        g = torch.Generator().manual_seed(7)
        for p in m.parameters():
            if p in opt.state:
                opt.state[p]["sum"] += torch.rand(p.shape, generator=g)
    engine.attach_optimizer(optimizer)
    views = [v for views in engine._binding(optimizer).optimized.values() for v, _ in views]
    assert views and all(optimizer.state.get(v) for v in views), "Adagrad's constructor state was dropped"
    for view in views:  # before any step: the accumulator at least its initial 0.1, on the master's device
        values = optimizer.state[view]
        assert values["sum"].device == view.device and values["sum"].shape == view.shape
        assert values["sum"].min() >= 0.1 and values["step"].item() == 0
    worst = 0.0
    for step in range(3):
        batch = make_batch(step, 0, rank, uniform=stage == 3)
        engine.backward(model.loss(batch))
        tokens, targets, use_sometimes = batch
        logits = ddp(tokens, use_sometimes)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)).backward()
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        full = engine.full_state_dict()
        for name, p in ref_model.named_parameters(remove_duplicate=False):
            diff = (full[name] - p.detach()).abs().max().item()
            assert diff < 1e-5, f"step {step}: {name} differs from DDP by {diff}"
            worst = max(worst, diff)
    engine.close()
    return worst


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adagrad_constructor_state_matches_ddp(dist_pool, stage: int) -> None:
    assert all(r < 1e-5 for r in dist_pool(2).run(_adagrad_body, stage, False))


def test_adagrad_constructor_state_with_offload_matches_ddp(dist_pool) -> None:
    assert all(r < 1e-5 for r in dist_pool(2).run(_adagrad_body, 2, True))


# --------------------------------------------------------------------------- through Lightning

class _Lit(L.LightningModule):
    """``optimizer``: what configure_optimizers returns (None: Lightning fits without one)."""

    def __init__(self, optimizer_lr: Optional[float] = 0.1, fail_at: Optional[int] = None) -> None:
        super().__init__()
        self.model = RichModel()
        self.optimizer = torch.optim.SGD(self.parameters(), lr=optimizer_lr) if optimizer_lr else None
        self.fail_at, self.backwards = fail_at, 0

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise _Stop()  # on every rank, as Lightning's own checks fail
        tokens, targets = batch
        return self.model.loss((tokens, targets, False))

    def on_after_backward(self) -> None:
        self.backwards += 1

    def configure_optimizers(self):
        return self.optimizer


class _Stop(Exception):
    pass


def _fit(module: L.LightningModule, strategy, **kw) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **kw)
    data = torch.utils.data.DataLoader(TokenDataset(8 * dist.get_world_size()), batch_size=2)
    trainer.fit(module, data)
    return trainer


def _strategy(stage: int) -> ZeroQStrategy:
    return ZeroQStrategy(stage=stage, **(FREED if stage == 3 else {}))


def _no_optimizer_body(stage: int) -> None:
    torch.manual_seed(0)
    module = _Lit(optimizer_lr=None)
    before = copy.deepcopy(module.model.state_dict())
    trainer = _fit(module, _strategy(stage), gradient_clip_val=0.5)
    assert module.backwards == 4 and trainer.global_step == 4  # forward and backward ran; Lightning counts the steps
    assert trainer.strategy.engine.optimizer is None and not trainer.strategy.engine.has_gradients
    for name, value in module.model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed in a fit without an optimizer"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fit_without_an_optimizer_runs_and_steps_nothing(dist_pool, stage: int) -> None:
    # Before: Lightning's stand-in optimizer was refused ("cannot shard optimizer _MockOptimizer").
    dist_pool(2).run(_no_optimizer_body, stage)


def _reuse_body(stage: int, second: str, first_fails: bool) -> None:
    torch.manual_seed(0)
    module = _Lit(fail_at=2 if first_fails else None)
    optimizer = module.optimizer
    if first_fails:
        initial = copy.deepcopy(module.state_dict())
        with pytest.raises(_Stop):
            _fit(module, _strategy(stage))
    else:
        _fit(module, _strategy(stage))
    # handed back: the module's parameters, in the order given, as with DDP
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in module.parameters()]
    if first_fails:  # stage 3 holds the weights sharded until the next fit releases them: only check it trains
        module.fail_at = None
        _fit(module, _strategy(stage))
        assert all(type(p) is torch.nn.Parameter for p in module.parameters())
        assert max((p.detach() - initial[n]).abs().max().item() for n, p in module.named_parameters()) > 1e-3
        return
    after_first = copy.deepcopy(module.state_dict())
    _fit(module, _strategy(stage) if second == "zeroq" else "ddp_find_unused_parameters_true")
    assert module.optimizer is optimizer
    fresh = _Lit()  # the reference: the first fit's weights and a new optimizer, fitted by the second strategy
    fresh.load_state_dict(after_first)
    _fit(fresh, _strategy(stage) if second == "zeroq" else "ddp_find_unused_parameters_true")
    moved = 0.0
    for (name, p), q in zip(module.named_parameters(), fresh.parameters()):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-6), name
        moved = max(moved, (p.detach() - after_first[name]).abs().max().item())
    assert moved > 1e-3, "the second fit must train"


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("second", ["zeroq", "ddp"])
def test_an_optimizer_fitted_once_is_taken_by_the_next_fit(dist_pool, stage: int, second: str) -> None:
    # Before: "The optimizer holds tensor(s) that are not parameters of the module" (zeroq), or DDP
    # stepping the first fit's master shards instead of the module.
    dist_pool(2).run(_reuse_body, stage, second, False)


def test_an_optimizer_of_a_failed_fit_is_taken_by_the_next_fit(dist_pool) -> None:
    # A failed fit does not hand the module back in its teardown; the next fit's engine does it first.
    dist_pool(2).run(_reuse_body, 3, "zeroq", True)
