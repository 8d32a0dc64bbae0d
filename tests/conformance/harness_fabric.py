"""What the checkpoint and Fabric conformance modules share: the zeroq arms a ported case runs under,
Trainer/Fabric builders for the worker pool, and reading a checkpoint directory in the pytest process.

A case's body runs on every rank of the gloo pool (``tests/dist_pool.py``). Lightning's own tests run
in one process, so where they count batches per epoch each rank here gets the same count: the models'
datasets are ``world_size`` times as long (``Boring``), and the distributed sampler splits them.
Checkpoint directories are read in the pytest process, which has no process group (the layout's
promise), exactly as the single-process original reads its file after ``fit``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

import lightning_zeroq  # noqa: F401  (registers the strategy names)

PORTED = "ported"
"""A case of the original module that has a port here; any other value is the one-line reason it has none."""


def assert_ported_or_explained(original: dict[str, str], namespace: dict, count: int | None = None) -> None:
    """Every case of the original module (``count``: how many it has) is ported (a function of that name in
    ``namespace``, the test module's globals) or carries a one-line reason."""
    if count is not None:
        assert len(original) == count, f"{len(original)} cases listed; the original module has {count}"
    for name, what in original.items():
        if what == PORTED:
            assert callable(namespace.get(name)), f"{name} is listed as ported but is not defined"
        else:
            assert what.strip() and "\n" not in what, f"{name}: give a one-line reason"


# Stage 3 whose units are really freed between uses: BoringModel's only module is a Linear.
FREED = {"stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0}

# The arms a case runs under: the three presets by name, stage 3 with freed units, offload, and stage 3
# with freed units and speculative host steps (parameters and optimizer on the CPU).
STAGES = ["zeroq_stage_1", "zeroq_stage_2", "stage3_freed"]
PRESETS = ["zeroq_stage_1", "zeroq_stage_2", "zeroq_stage_3"]


def strategy(arm: str, **extra):
    """A strategy name or object for ``arm``; ``extra`` are ``ZeroQStrategy`` options."""
    from lightning_zeroq import ZeroQStrategy

    if arm == "stage3_freed":
        return ZeroQStrategy(stage=3, **FREED, **extra)
    if arm == "stage2_offload":
        return ZeroQStrategy(stage=2, offload_optimizer=True, **extra)
    if arm == "stage3_freed_offload_spec":
        return ZeroQStrategy(stage=3, **FREED, offload_optimizer=True, offload_parameters=True,
                             offload_speculative_step=True, **extra)
    if extra:
        return ZeroQStrategy(stage=int(arm[-1]), **extra)
    return arm


def fabric_strategy(arm: str, **extra):
    from lightning_zeroq import ZeroQFabricStrategy

    if not isinstance(arm, str):  # a strategy object already
        return arm
    if arm == "stage3_freed":
        return ZeroQFabricStrategy(stage=3, **FREED, **extra)
    if extra:
        return ZeroQFabricStrategy(stage=int(arm[-1]), **extra)
    return arm


def trainer(arm: str, **kwargs):
    """A Trainer on this pool's ranks (the processes and the process group exist already)."""
    import lightning as L

    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_model_summary", False)
    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy(arm), **kwargs)


def fabric(arm: str, **kwargs):
    import lightning as L

    f = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=fabric_strategy(arm), **kwargs)
    f.launch()  # joins the pool's process group
    return f


class Boring(BoringModel):
    """``BoringModel`` (plain SGD, lr 0.1) whose every rank sees as many batches as the original's one
    process: datasets ``world_size`` times as long."""

    def _loader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64 * dist.get_world_size()))

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()

    def test_dataloader(self):
        return self._loader()

    def predict_dataloader(self):
        return self._loader()


class LogInTwoMethods(Boring):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("early_stop_on", out["loss"])
        return out

    def on_validation_epoch_end(self):
        self.log("val_acc", torch.tensor(1.23))


def read(path) -> dict:
    """A checkpoint as Lightning's loader sees it, read in this (group-less) process: a directory's
    trainer state and full weights, or a single file."""
    path = Path(path)
    if path.is_dir():
        from lightning_zeroq.checkpoint.convert import lightning_checkpoint

        return lightning_checkpoint(path)
    return torch.load(path, map_location="cpu", weights_only=False)


def is_checkpoint(path) -> bool:
    """What the originals' ``os.path.isfile(ckpt)`` means for a zeroq checkpoint (a directory, as
    DeepSpeed's): complete, its manifest written last."""
    path = Path(path)
    return path.is_dir() and (path / "zeroq.json").is_file() and (path / ".metadata").is_file()


def _noop() -> None:
    return None


def run(pool, fn, *args, timeout: float | None = None, **kwargs):
    """``pool.run(fn, ...)``; with ``timeout``, ``fn`` alone runs under it (the pool starts under its own)."""
    if timeout is None:
        return pool.run(fn, *args, **kwargs)
    if not pool._procs:
        pool.run(_noop)
    return pool.run_within(timeout, fn, *args, **kwargs)
