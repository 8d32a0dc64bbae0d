"""Callbacks and hooks that read or write the weights, under zeroq against DDP on 2 ranks (fp32, ``32-true``).

One fit per configuration runs every reader and writer at once, DDP the same on the same data:

- ``StochasticWeightAveraging`` and ``EMAWeightAveraging`` (Lightning's ``WeightAveraging`` family): their
  averaged models after fit, the EMA's average swapped in for validation (``validation_losses``) and copied
  into the module at the end of training;
- ``ModelCheckpoint(save_weights_only=True)``: the weights it saved each epoch;
- LightningModule hooks that read the weights: ``on_train_batch_end``, ``on_before_zero_grad``,
  ``on_validation_start`` (the norm of every parameter), and one that writes them (``on_train_end``
  halves every parameter after the callbacks copied their averages in);
- a logger's ``log_graph``: TensorBoard's needs the ``tensorboard`` package, which the test environment
  does not have; ``GraphLogger`` does what its trace does with the weights (one forward of
  ``example_input_array``) and records the output;
- the module after fit (``final_module``).

Every observation must be within 1e-5 of DDP's, per rank. The model is a ``Sequential`` the training step
calls as a submodule, made one unit (default bucket size; stage 3: the ``Sequential``) and several units
(a bucket of 64 elements; stage 3: each ``Linear``); stage 3 units are really freed
(``stage3_param_persistence_threshold=0``), so hooks read the weights there inside
``lightning_zeroq.gathered_parameters`` (a no-op under DDP), as stage 3 documents. Host optimizer steps:
synchronous on the device, offloaded (``offload_optimizer``), asynchronous (``offload_async_step``) and
speculative and asynchronous. A fit runs once per configuration (cached here), its observations are
compared in a case each.

A stage-3 model made in ``Trainer.init_module()`` has nothing the averaging callbacks could copy before fit
(its parameters are on the meta device until the engine materializes them): refused before fit, in one line.

Full checkpoints with ``EMAWeightAveraging`` (``resume_with_ema``): a fit saves one each epoch (the callback
moves the module's own weights to ``current_model_state`` and puts its average under ``state_dict``), a new
Trainer resumes from the first and trains on; right after the resume the module and the average hold what
they held at the save, and every step after that matches DDP doing the same within 1e-6 (stages 1-3, stage 3
with freed units and with offload). Also resumed with the callback from a checkpoint saved without it (its
average starts from the checkpoint's weights).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch

from tests.conformance.harness import on_ranks

STAGES = (1, 2, 3)
UNITS = ("one", "several")
MODES = {
    "sync": {},
    "offload": {"offload_optimizer": True},
    "async": {"offload_optimizer": True, "offload_async_step": True},
    "speculative_async": {"offload_optimizer": True, "offload_speculative_step": True, "offload_async_step": True},
}
OBSERVERS = ("ema_average", "swa_average", "checkpoint", "batch_end_norms", "before_zero_grad_norms",
             "validation_start_norms", "log_graph", "validation_losses", "final_module")
TOL = 1e-5
EPOCHS, BATCHES = 2, 2


def zeroq_options(stage: int, units: str, mode: str) -> dict[str, Any]:
    options: dict[str, Any] = {"stage": stage, **MODES[mode]}
    if stage == 3:
        options.update(stage3_param_persistence_threshold=0,
                       stage3_wrap_classes=["Sequential"] if units == "one" else ["Linear"])
    elif units == "several":
        options["reduce_bucket_size"] = 64
    return options


# --------------------------------------------------------------------------- the body every rank runs


def _norm(module: torch.nn.Module, gather: bool) -> float:
    import lightning_zeroq

    with lightning_zeroq.gathered_parameters(module) if gather else _nothing():
        return float(torch.stack([p.detach().float().norm() for p in module.parameters()]).norm())


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _named(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}


def fit_and_observe(options: Optional[dict], root: str) -> dict[str, Any]:
    """One fit with every reader and writer; ``options`` a ``ZeroConfig`` (None: DDP)."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
    from lightning.pytorch.loggers import Logger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zeroq

    gather = bool(options) and options["stage"] == 3
    seen: dict[str, list] = {k: [] for k in ("batch_end_norms", "before_zero_grad_norms", "validation_start_norms",
                                             "validation_losses", "log_graph")}

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))
            self.example_input_array = torch.linspace(-1, 1, 24).view(3, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            seen["validation_losses"].append(float(nn.functional.mse_loss(self.model(x), y)))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.02)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen["batch_end_norms"].append(_norm(self, gather))

        def on_before_zero_grad(self, optimizer: Any) -> None:
            seen["before_zero_grad_norms"].append(_norm(self, gather))

        def on_validation_start(self) -> None:
            seen["validation_start_norms"].append(_norm(self, gather))

        @torch.no_grad()
        def on_train_end(self) -> None:  # after the callbacks copied their averages in
            with lightning_zeroq.gathered_parameters(self, writeback=True) if gather else _nothing():
                for p in self.parameters():
                    p.mul_(0.5)

    class GraphLogger(Logger):
        """What ``TensorBoardLogger.log_graph`` does with the weights: one forward of the example input."""

        name, version = "graph", 0

        def log_metrics(self, metrics: Any, step: Any = None) -> None: ...

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None: ...

        @torch.no_grad()
        def log_graph(self, model: Any, input_array: Any = None) -> None:
            seen["log_graph"].append(model(model.example_input_array).flatten().tolist())

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, torch.stack([x[:, :4].sum(1), x[:, 4:].prod(1)], 1))
    torch.manual_seed(11)
    model = Model()
    ema = EMAWeightAveraging(decay=0.8)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=1)
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_weights_only=True, save_top_k=-1,
                           every_n_epochs=1, filename="{epoch}")
    strategy: Any = "ddp" if options is None else lightning_zeroq.ZeroQStrategy(**options)
    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=EPOCHS,
                         limit_train_batches=BATCHES, limit_val_batches=1, num_sanity_val_steps=0,
                         callbacks=[swa, ema, ckpt], logger=GraphLogger(), enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=16))
    dist.barrier()
    assert ema._average_model is not None and swa._average_model is not None
    saved = {}
    for epoch in range(EPOCHS):
        state = torch.load(os.path.join(root, "ckpt", f"epoch={epoch}.ckpt"), map_location="cpu", weights_only=True)
        saved[epoch] = {k: v.float() for k, v in state["state_dict"].items()}
    return {**seen, "ema_average": _named(ema._average_model.module), "swa_average": _named(swa._average_model),
            "checkpoint": saved, "final_module": _named(model)}


# --------------------------------------------------------------------------- the host side

_RESULTS: dict[Any, Any] = {}


def _observed(dist_pool: Any, tmp_path_factory: Any, key: Any, options: Optional[dict]) -> list:
    return _observed_with(dist_pool, tmp_path_factory, key, fit_and_observe, options)


def _observed_with(dist_pool: Any, tmp_path_factory: Any, key: Any, body: Any, options: Optional[dict],
                   *args: Any) -> list:
    if key not in _RESULTS:
        root = str(tmp_path_factory.mktemp("weights"))
        try:
            _RESULTS[key] = on_ranks(dist_pool, body, options, root, *args)
        except RuntimeError as error:
            _RESULTS[key] = error
    if isinstance(_RESULTS[key], RuntimeError):
        raise _RESULTS[key]
    return _RESULTS[key]


def _assert_close(ours: Any, ddp: Any, where: str, tol: float = TOL) -> None:
    if isinstance(ddp, dict):
        assert ours.keys() == ddp.keys(), f"{where}: keys {sorted(ours)} != {sorted(ddp)}"
        for k in ddp:
            _assert_close(ours[k], ddp[k], f"{where}.{k}", tol)
        return
    a, b = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(ddp, dtype=torch.float64)
    assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != DDP's {tuple(b.shape)}"
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    assert diff <= tol, f"{where}: max difference {diff:.3g} > {tol}"


def _cases() -> list:
    cases = []
    for stage in STAGES:
        for units in UNITS:
            for mode in MODES:
                for observer in OBSERVERS:
                    cases.append(pytest.param(stage, units, mode, observer,
                                              id=f"stage{stage}-{units}-{mode}-{observer}"))
    return cases


@pytest.mark.parametrize(("stage", "units", "mode", "observer"), _cases())
def test_observed_as_under_ddp(dist_pool, tmp_path_factory, stage: int, units: str, mode: str, observer: str) -> None:
    ddp = _observed(dist_pool, tmp_path_factory, "ddp", None)
    ours = _observed(dist_pool, tmp_path_factory, (stage, units, mode), zeroq_options(stage, units, mode))
    assert ddp[0][observer] is not None
    for rank, (mine, theirs) in enumerate(zip(ours, ddp)):
        _assert_close(mine[observer], theirs[observer], f"rank {rank} {observer}")


def refused_in_init_module(callback: str) -> str:
    """A stage-3 model made in ``Trainer.init_module()`` (parameters on the meta device until the engine
    materializes them), with an averaging callback that copies the model before fit."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch import callbacks
    from torch import nn

    import lightning_zeroq

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = lightning_zeroq.ZeroQStrategy(stage=3, stage3_param_persistence_threshold=0)
    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[getattr(callbacks, callback)(swa_lrs=0.1)
                                                                if callback == "StochasticWeightAveraging"
                                                                else getattr(callbacks, callback)()])
    with trainer.init_module():
        model = Model()
    with pytest.raises(ValueError) as info:
        trainer.fit(model, [torch.zeros(2, 8)])
    return str(info.value)


@pytest.mark.parametrize("callback", ["EMAWeightAveraging", "StochasticWeightAveraging"])
def test_averaging_a_stage3_model_made_in_init_module_is_refused_before_fit(dist_pool, callback: str) -> None:
    for message in on_ranks(dist_pool, refused_in_init_module, callback):
        assert message.startswith(callback) and "model.0.weight" in message and "init_module" in message, message


# --------------------------------------------------------------------------- full checkpoints with EMA

RESUME_CASES = {  # name -> ZeroConfig options; stage 3's units are really freed (each Linear)
    "stage1": zeroq_options(1, "several", "sync"),
    "stage2": zeroq_options(2, "several", "sync"),
    "stage3": zeroq_options(3, "several", "sync"),
    "stage3_offload": zeroq_options(3, "several", "offload"),
}
ADDED_CASES = ("stage1", "stage3")  # resumed with the callback from a checkpoint saved without it
RESUME_TOL = 1e-6
SAVED_EPOCHS, RESUMED_EPOCHS = 1, 3


def resume_with_ema(options: Optional[dict], root: str, saved_with_ema: bool = True) -> dict[str, Any]:
    """``EMAWeightAveraging`` with the Trainer's full checkpoints: a fit that saves one at the end of each epoch
    (the ``ModelCheckpoint`` every Trainer has), then a new model, callback and Trainer resuming from the first
    epoch's with ``fit(ckpt_path=...)`` and training on. Returns the module's and the average's weights at the
    save, right after the resume and after every step of the resumed fit. ``saved_with_ema=False``: the first
    fit runs without the callback (the resumed one starts its average from the checkpoint's weights)."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zeroq

    gather = bool(options) and options["stage"] == 3

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.model(x), y), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.02)

    class Observer(Callback):  # after the EMA callback in the list: sees each step's update
        def __init__(self, ema: Optional[EMAWeightAveraging]) -> None:
            self.ema, self.seen = ema, []

        def _observe(self, pl_module: pl.LightningModule) -> None:
            with lightning_zeroq.gathered_parameters(pl_module) if gather else _nothing():
                module = _named(pl_module)
            average = self.ema._average_model if self.ema is not None else None
            self.seen.append({"module": module, "average": _named(average.module) if average is not None else None,
                              "n_averaged": int(average.n_averaged) if average is not None else 0})

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._observe(pl_module)

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            self._observe(pl_module)

    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 8, generator=g)
    data = TensorDataset(x, torch.stack([x[:, :4].sum(1), x[:, 4:].prod(1)], 1))

    def fit(epochs: int, ckpt_path: Optional[str]) -> Observer:
        torch.manual_seed(11 if ckpt_path is None else 12)  # the resumed fit starts from other weights
        ema = EMAWeightAveraging(decay=0.8) if saved_with_ema or ckpt_path is not None else None
        observer = Observer(ema)
        ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=-1, filename="{epoch}")
        strategy: Any = "ddp" if options is None else lightning_zeroq.ZeroQStrategy(**options)
        trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=epochs,
                             limit_val_batches=1, num_sanity_val_steps=0,
                             callbacks=[c for c in (ema, observer, ckpt) if c is not None],
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=root)
        trainer.fit(Model(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
        dist.barrier()
        return observer

    saved = fit(SAVED_EPOCHS, None).seen[-1]
    path = os.path.join(root, "ckpt", f"epoch={SAVED_EPOCHS - 1}.ckpt")
    converted = None
    if options is not None and saved_with_ema:  # zeroq-convert's Lightning file holds what DDP's does
        from lightning_zeroq.checkpoint.convert import consolidate

        out = consolidate(path, os.path.join(root, f"converted-{dist.get_rank()}.ckpt"), optimizer=True)
        converted = torch.load(out, map_location="cpu", weights_only=True)
        converted = {"module": converted["current_model_state"], "average": converted["state_dict"],
                     "n_averaged": int(converted["averaging_state"]["n_averaged"])}
    resumed = fit(RESUMED_EPOCHS, path).seen
    return {"saved": saved, "resumed": resumed, "converted": converted}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_ema_full_checkpoint_resumes_as_under_ddp(dist_pool, tmp_path_factory, case: str) -> None:
    """The full checkpoint holds the average (``state_dict``) and the module's own weights (where the callback
    moves them, ``current_model_state``); the resume puts each back where it was, and the resumed fit follows
    DDP's step by step."""
    ddp = _observed_with(dist_pool, tmp_path_factory, "ema-resume-ddp", resume_with_ema, None)
    ours = _observed_with(dist_pool, tmp_path_factory, f"ema-resume-{case}", resume_with_ema, RESUME_CASES[case])
    for rank, mine in enumerate(ours):
        assert mine["saved"]["n_averaged"] > 0
        converted = mine["converted"]  # zeroq-convert CKPT OUT.ckpt --optimizer
        assert converted["n_averaged"] == mine["saved"]["n_averaged"]
        _assert_close(mine["saved"]["module"], converted["module"], f"rank {rank} converted current_model_state", 0.0)
        _assert_close(mine["saved"]["average"], converted["average"], f"rank {rank} converted state_dict", 0.0)
    _assert_resumed_as_under_ddp(ours, ddp)


@pytest.mark.parametrize("case", ADDED_CASES)
def test_ema_added_at_resume_starts_from_the_checkpoint_as_under_ddp(dist_pool, tmp_path_factory, case: str) -> None:
    """A full checkpoint saved without the callback, resumed with it: its average starts from the checkpoint's
    weights (Lightning warns that the checkpoint was not created with it), which the engine loaded."""
    ddp = _observed_with(dist_pool, tmp_path_factory, "ema-added-ddp", resume_with_ema, None, False)
    ours = _observed_with(dist_pool, tmp_path_factory, f"ema-added-{case}", resume_with_ema, RESUME_CASES[case],
                          False)
    for mine in ours:
        assert mine["saved"]["average"] is None and mine["resumed"][0]["n_averaged"] == 0
        mine["saved"]["average"] = mine["saved"]["module"]  # the average starts as the checkpoint's weights
    _assert_resumed_as_under_ddp(ours, ddp)


def _assert_resumed_as_under_ddp(ours: list, ddp: list) -> None:
    for rank, (mine, theirs) in enumerate(zip(ours, ddp)):
        assert len(theirs["resumed"]) == 1 + (RESUMED_EPOCHS - SAVED_EPOCHS) * 4  # the start, then 4 steps an epoch
        first = mine["resumed"][0]
        assert first["n_averaged"] == mine["saved"]["n_averaged"]
        _assert_close(first["module"], mine["saved"]["module"], f"rank {rank} module at the resume", RESUME_TOL)
        _assert_close(first["average"], mine["saved"]["average"], f"rank {rank} average at the resume", RESUME_TOL)
        assert [s["n_averaged"] for s in mine["resumed"]] == [s["n_averaged"] for s in theirs["resumed"]]
        for step, (a, b) in enumerate(zip(mine["resumed"], theirs["resumed"])):
            _assert_close(a["module"], b["module"], f"rank {rank} module after resumed step {step}", RESUME_TOL)
            _assert_close(a["average"], b["average"], f"rank {rank} average after resumed step {step}", RESUME_TOL)
