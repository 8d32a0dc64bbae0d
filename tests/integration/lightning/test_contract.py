"""What Lightning users do every day, through ``Trainer(strategy=...)`` on gloo: a ``training_step``
that returns ``None``, a model fitted twice or by another strategy afterwards, ``sync_batchnorm``,
state built in ``configure_model``, ``init_module`` with ``bf16-true``, pickling the Trainer."""

from __future__ import annotations

import copy
import io

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from lightning_zeroq import ZeroQStrategy
from tests.models import SEQ, VOCAB, RichModel, TokenDataset

TRANSIENT = {"stage3_wrap_classes": ["Sequential", "Linear"], "stage3_param_persistence_threshold": 0}


def _strategy(stage: int, **extra) -> ZeroQStrategy:
    return ZeroQStrategy(stage=stage, **(TRANSIENT if stage == 3 else {}), **extra)


def _trainer(strategy, **kw):
    import lightning as L

    kw = {"max_epochs": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
          "enable_model_summary": False, **kw}
    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, **kw)


def _data(batches_per_rank: int = 6):
    return torch.utils.data.DataLoader(TokenDataset(2 * batches_per_rank * dist.get_world_size()), batch_size=2)


class Lit(L.LightningModule):
    """Module level, so a Trainer holding it pickles."""

    def __init__(self, skip_last_micro: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.model = RichModel()
        self.skip_last_micro, self.lr = skip_last_micro, lr

    def training_step(self, batch, batch_idx):
        if self.skip_last_micro and batch_idx % 2 == 1:
            return None  # the window's last micro-batch: no backward
        tokens, targets = batch
        return self.model.loss((tokens, targets, False))

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        self.log("val", self.model.loss((tokens, targets, False)), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _lit(skip_last_micro: bool = False, lr: float = 0.1) -> Lit:
    return Lit(skip_last_micro, lr)


def _none_body(stage: int) -> None:
    torch.manual_seed(0)
    module = _lit(skip_last_micro=True)
    ref = copy.deepcopy(module.model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = _trainer(_strategy(stage), accumulate_grad_batches=2)
    data = _data()
    trainer.fit(module, data)
    assert trainer.global_step == 3
    # The reference: each window's first micro-batch, its gradient averaged over the ranks (Lightning
    # divides the loss by accumulate_grad_batches). DDP itself would step with unsynchronized local
    # gradients here (its first micro-batch runs under no_sync and the reducing one never comes).
    for batch_idx, (tokens, targets) in enumerate(trainer.train_dataloader):
        if batch_idx % 2 == 1:
            continue
        (ref.loss((tokens, targets, False)) / 2).backward()
        for p in ref.parameters():
            if p.requires_grad:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                p.grad = grad / dist.get_world_size()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
    full = trainer.strategy.full_state_dict()
    for name, p in ref.named_parameters():
        diff = (full[f"model.{name}"] - p.detach()).abs().max().item()
        assert diff < 1e-5, (name, diff)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_window_whose_last_training_step_returns_none_still_steps(dist_pool, stage):
    # Before: the whole window was dropped. (Lightning allows returning None from training_step only on
    # one process, so one rank: the reference is then plain DDP's behaviour.)
    dist_pool(1).run(_none_body, stage)


# --------------------------------------------------------------------------- a model used again


def _refit_body(stage: int, second: str) -> None:
    """fit with zeroq, then fit the same module again (same Trainer config, or DDP): the second fit
    must train (non-zero gradients) and match a fresh fit that starts from the first fit's weights."""
    torch.manual_seed(0)
    module = _lit(lr=0.1)
    first = _trainer(_strategy(stage))
    first.fit(module, _data())
    after_first = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert all(type(p) is nn.Parameter for p in module.parameters())  # handed back as plain tensors
    other = _strategy(stage) if second == "zeroq" else "ddp_find_unused_parameters_true"
    del first
    again = _trainer(other)
    again.fit(module, _data())
    # the reference: a fresh module loaded with the first fit's weights, fitted by the second strategy
    fresh = _lit(lr=0.1)
    fresh.load_state_dict(after_first)
    _trainer(_strategy(stage) if second == "zeroq" else "ddp_find_unused_parameters_true").fit(fresh, _data())
    moved = 0.0
    for (name, p), q in zip(module.named_parameters(), fresh.parameters()):
        assert torch.allclose(p.detach().float(), q.detach().float(), atol=1e-6), name
        moved = max(moved, (p.detach() - after_first[name]).abs().max().item())
    assert moved > 1e-3, "the second fit must train (before: zero gradients, weights unchanged)"


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("second", ["zeroq", "ddp"])
def test_a_model_fitted_twice_trains_twice(dist_pool, stage, second):
    # Before: stage 3 segfaulted in the second engine's build; stages 2 and 3 trained with zero gradients
    # (the first engine's hooks fired first and set p.grad = None).
    dist_pool(2).run(_refit_body, stage, second)


def _validate_after_fit_body(stage: int) -> float:
    module = _lit()
    trainer = _trainer(_strategy(stage))
    data = _data()
    trainer.fit(module, data, val_dataloaders=[])
    metrics = trainer.validate(module, data, verbose=False)
    assert trainer.strategy.engine is not None and trainer.strategy.engine.optimizer is not None
    return metrics[0]["val"]


@pytest.mark.parametrize("stage", [1, 3])
def test_validate_after_fit_runs_the_handed_back_module(dist_pool, stage):
    values = dist_pool(2).run(_validate_after_fit_body, stage)
    assert values[0] == values[1] and torch.isfinite(torch.tensor(values[0]))


def _pickle_body(stage: int) -> int:
    trainer = _trainer(_strategy(stage))
    module = _lit()
    trainer.fit(module, _data())
    buffer = io.BytesIO()
    torch.save(trainer, buffer)  # as with DDP
    return buffer.tell()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_trainer_that_used_zeroq_pickles(dist_pool, stage):
    # Before: "Can't pickle local object '_weak_hook.<locals>.hook'" (stage 3: a module hook).
    assert all(n > 0 for n in dist_pool(2).run(_pickle_body, stage))


# --------------------------------------------------------------------------- set-up


def _sync_bn_body() -> list[str]:
    import lightning as L

    class BN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.BatchNorm1d(SEQ), nn.Linear(8, VOCAB))
            self.seen: list[str] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(type(self.net[1]).__name__)
            self.net[1].eval()  # SyncBatchNorm syncs only on GPUs; its eval path runs on CPU
            tokens, targets = batch
            return F.cross_entropy(self.net(tokens).reshape(-1, VOCAB), targets.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = BN()
    _trainer(_strategy(2), sync_batchnorm=True, max_steps=2).fit(module, _data())
    return module.seen


def test_sync_batchnorm_converts_the_batchnorm_layers(dist_pool):
    # Before: sync_batchnorm=True was silently ignored.
    assert all(seen == ["SyncBatchNorm", "SyncBatchNorm"] for seen in dist_pool(2).run(_sync_bn_body))


def _configure_model_state_body() -> dict:
    import lightning as L

    class WithState(L.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = RichModel()
                self.steps_seen = torch.zeros(())  # state that is not a parameter (a metric's, say)
                self.built = (self.model.embed.weight.device.type, self.model.gain.device.type)

        def training_step(self, batch, batch_idx):
            self.steps_seen += 1
            tokens, targets = batch
            return self.model.loss((tokens, targets, False))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = WithState()
    _trainer(_strategy(3), max_steps=3).fit(module, _data())
    return {"built": module.built, "steps": float(module.steps_seen.item())}


def test_stage3_configure_model_builds_parameters_on_meta_and_other_state_for_real(dist_pool):
    # Before: everything made in configure_model stayed on meta ("Tensor.item() cannot be called on meta
    # tensors" for a torchmetrics metric).
    for result in dist_pool(2).run(_configure_model_state_body):
        assert result == {"built": ("meta", "cpu"), "steps": 3.0}, result


def _init_module_body(stage: int) -> list[str]:
    trainer = _trainer(_strategy(stage), precision="bf16-true", max_steps=1)
    with trainer.init_module():
        module = _lit()
    dtypes = [str(p.dtype) for p in module.parameters()]
    trainer.fit(module, _data())
    return dtypes + [str(p.dtype) for p in module.parameters()]


@pytest.mark.parametrize("stage", [2, 3])
def test_init_module_builds_in_bf16_for_bf16_true(dist_pool, stage):
    # Before: the model was built in fp32 (twice the init memory). After fit it is handed back in bf16.
    for dtypes in dist_pool(2).run(_init_module_body, stage):
        assert set(dtypes) == {"torch.bfloat16"}, dtypes


class NormLogging(Lit):
    def __init__(self) -> None:
        super().__init__()
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm

        strategy = self.trainer.strategy
        norms = strategy.grad_norms(2) if hasattr(strategy, "grad_norms") else grad_norm(self, 2)
        self.norms.append({k: float(v) for k, v in norms.items()})


def _grad_norms_body(stage: int) -> None:
    results = []
    for strategy in (_strategy(stage), "ddp_find_unused_parameters_true"):
        torch.manual_seed(0)
        module = NormLogging()
        _trainer(strategy, max_steps=3, gradient_clip_val=0.5).fit(module, _data())
        results.append(module.norms)
    zeroq, ddp = results
    assert len(zeroq) == len(ddp) == 3
    for ours, theirs in zip(zeroq, ddp):
        for key, value in theirs.items():
            assert abs(ours[key] - value) <= 1e-5 * max(1.0, value), (key, ours[key], value)
        assert all(v == 0.0 for k, v in ours.items() if k not in theirs)  # no gradient: norm 0


@pytest.mark.parametrize("stage", [1, 3])
def test_gradient_norms_for_logging_match_ddp(dist_pool, stage):
    # Before: .grad is empty in on_before_optimizer_step (gradients live in shards), so Lightning's
    # grad_norm and gradient-logging callbacks saw nothing.
    dist_pool(2).run(_grad_norms_body, stage)


class TwoOptimizers(L.LightningModule):
    """GAN-style manual optimization: two disjoint parameter sets, two optimizers, each zeroed, stepped
    (and one clipped) in turn, the second backward also reaching the first set's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16))
        self.disc = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, VOCAB))
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        tokens, targets = batch
        # the discriminator's step: the generator's output detached
        self.toggle_optimizer(opt_d)
        opt_d.zero_grad()
        d_loss = F.cross_entropy(self.disc(self.gen(tokens).detach()).reshape(-1, VOCAB), targets.reshape(-1))
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        # the generator's step: its backward also leaves gradients on the discriminator
        opt_g.zero_grad()
        g_loss = -F.cross_entropy(self.disc(self.gen(tokens)).reshape(-1, VOCAB), targets.reshape(-1))
        self.manual_backward(g_loss)
        opt_g.step()
        strategy = self.trainer.strategy
        full = strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else {
            n: p.detach().clone() for n, p in self.named_parameters()}
        self.snapshots.append(full)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.gen.parameters(), lr=1e-2, eps=1e-3), \
            torch.optim.SGD(self.disc.parameters(), lr=0.1, momentum=0.9)


def _two_optimizers_body(stage: int) -> None:
    runs = []
    for strategy in (_strategy(stage), "ddp_find_unused_parameters_true"):
        torch.manual_seed(0)
        module = TwoOptimizers()
        _trainer(strategy, max_steps=8).fit(module, _data(4))
        runs.append(module.snapshots)
    ours, ddp = runs
    assert len(ours) == len(ddp) == 4
    for step, (a, b) in enumerate(zip(ours, ddp)):
        for name in b:
            assert (a[name] - b[name]).abs().max().item() < 1e-5, (step, name, (a[name] - b[name]).abs().max().item(), {k: (a[k] - b[k]).abs().max().item() for k in b})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_several_optimizers_in_manual_optimization_match_ddp(dist_pool, stage):
    # Before: configure_optimizers returning two optimizers was rejected.
    dist_pool(2).run(_two_optimizers_body, stage)


class ZeroGradBetween(Lit):
    """Manual optimization: a backward whose gradients the user drops with zero_grad(), then the one
    that counts."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        tokens, targets = batch
        self.manual_backward(self.model.loss((tokens, targets, False)) * 100.0)
        opt.zero_grad()
        self.manual_backward(self.model.loss((tokens.flip(0), targets, False)))
        opt.step()


def _manual_zero_grad_body(stage: int) -> None:
    results = []
    for strategy in (_strategy(stage), "ddp_find_unused_parameters_true"):
        torch.manual_seed(0)
        module = ZeroGradBetween()
        trainer = _trainer(strategy, max_steps=3)
        trainer.fit(module, _data())
        results.append({n: p.detach().float() for n, p in module.named_parameters()})  # handed back (zeroq)
    for name, value in results[1].items():
        assert (results[0][name] - value).abs().max().item() < 1e-5, name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_between_manual_backwards_drops_the_first(dist_pool, stage):
    # Before: backward, zero_grad(), backward, step gave an update 101x DDP's (stages 1 and 2).
    dist_pool(2).run(_manual_zero_grad_body, stage)


# ------------------------------------------------------------ load_model_state_dict checks (issue 11.3)


class _LoadChecks(L.Callback):
    """At the start of training, loads good and bad state dicts through the strategy and records what
    happened: the messages of the errors and whether any parameter changed."""

    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        good = {k: v.clone() for k, v in strategy.engine.full_state_dict().items()}
        good.update({k: v.clone() for k, v in pl_module.named_buffers() if k not in good})
        name = next(k for k, v in good.items() if v.dim() == 2 and v.shape[0] != v.shape[1])
        shape = tuple(good[name].shape)
        self.results = {"name": name, "shape": shape}
        bigger = torch.randn(shape[0] * 5, shape[1])  # holds enough elements to be misread as the parameter
        for label, state, strict in (
            ("bigger", {**good, name: bigger}, True),
            ("transposed", {**good, name: good[name].t().contiguous()}, True),
            ("bigger_lenient", {**good, name: bigger}, False),
            ("missing", {k: v for k, v in good.items() if k != name}, True),
        ):
            try:
                strategy.load_model_state_dict({"state_dict": state}, strict=strict)
                self.results[label] = "loaded"
            except RuntimeError as err:
                self.results[label] = str(err)
            self.results[label + "_unchanged"] = torch.equal(strategy.engine.full_state_dict()[name], good[name])
        perturbed = {**good, name: good[name] + 1}
        strategy.load_model_state_dict({"state_dict": {k: v for k, v in perturbed.items()}}, strict=True)
        self.results["good_loaded"] = torch.equal(strategy.engine.full_state_dict()[name], good[name] + 1)
        trainer.should_stop = True


def _load_checks_body(stage: int) -> dict:
    torch.manual_seed(0)
    checks = _LoadChecks()
    _trainer(_strategy(stage), callbacks=[checks], max_steps=1).fit(_lit(), _data(1))
    return checks.results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_load_model_state_dict_checks_names_and_shapes_like_nn_module(dist_pool, stage: int) -> None:
    # A 5x larger tensor used to load by taking its first elements, a transposed one as if right, and
    # a missing trainable key passed under strict=True.
    results = dist_pool(2).run(_load_checks_body, stage)
    assert results[0] == results[1]
    r = results[0]
    for label in ("bigger", "transposed", "bigger_lenient"):  # a size mismatch raises, strict or not
        assert "size mismatch" in r[label] and r["name"] in r[label] and f"parameter {r['shape']}" in r[label], r[label]
        assert r[label + "_unchanged"]
    assert "missing keys" in r["missing"] and r["name"] in r["missing"], r["missing"]
    assert r["good_loaded"]
