"""Running Lightning's own tests against zeroq: the pieces every ported module shares.

A ported case is a pytest function in the host process that sends a module-level *body* to the
session's gloo worker pool (``dist_pool``). Each worker already carries the environment of an
externally launched rank and an initialized process group, so ``Trainer(accelerator="cpu",
devices=2, strategy=...)`` inside a body runs exactly as under ``torchrun``.

- ``SPECS``: the strategies a case runs under. The presets (``zeroq_stage_1`` .. ``zeroq_stage_3``)
  and ``stage3_freed``: stage 3 with every module of the classes in ``wrap`` as a unit that is really
  freed after use (``stage3_param_persistence_threshold=0``); with the preset's defaults a tiny model
  never leaves the gathered state.
- ``strategy(spec)`` builds one inside a body; ``trainer(spec, root, **kw)`` a ``Trainer`` on every rank
  of the pool, with Lightning's defaults otherwise (``ModelCheckpoint``, logger, progress bar off only
  where the original turned them off).
- ``on_ranks(dist_pool, body, ...)``: run a body on the 2 ranks and return their results in rank order.
- ``deselected(table)``: one skipped case per entry of a module's ``{"original_test": "reason"}`` table,
  so every deselection shows in the run (``pytest -rs``) with its one-line reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pytest

WORLD = 2

STAGE3_FREED = "stage3_freed"
SPECS = ("zeroq_stage_1", "zeroq_stage_2", "zeroq_stage_3", STAGE3_FREED)
SHARDED = ("zeroq_stage_2", "zeroq_stage_3", STAGE3_FREED)  # where DeepSpeed/FSDP tests use gradient sharding
STAGE3 = ("zeroq_stage_3", STAGE3_FREED)


def stage_of(spec: str) -> int:
    return 3 if spec == STAGE3_FREED else int(spec.rsplit("_", 1)[1])


def strategy(spec: str, wrap: Iterable[str] = ("Linear",), **options: Any):
    """The strategy named by ``spec`` (a preset or ``stage3_freed``), with extra ``ZeroConfig`` options.
    ``wrap``: the module classes that become freed stage-3 units (``stage3_freed`` only)."""
    import lightning_zeroq  # noqa: F401  (registers the preset names)
    from lightning_zeroq import ZeroQStrategy
    from lightning_zeroq.common.strategy import PRESETS

    if spec == STAGE3_FREED:
        return ZeroQStrategy(stage=3, stage3_wrap_classes=list(wrap), stage3_param_persistence_threshold=0, **options)
    return ZeroQStrategy(**{**PRESETS[spec], **options})


def trainer(spec: Any, root: Optional[str] = None, wrap: Iterable[str] = ("Linear",), **kw: Any):
    """A ``Trainer`` on every rank of the pool: CPU, one device per rank, ``spec`` a name from ``SPECS``
    (or a strategy object, or another strategy name such as ``"ddp"``); ``root`` its ``default_root_dir``."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    if isinstance(spec, str) and (spec in SPECS or spec.startswith("zeroq")):
        spec = strategy(spec, wrap=wrap)
    if root is not None:
        kw.setdefault("default_root_dir", root)
    return pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=spec, **kw)


# A body that raises must not cost a pool restart (~20 s on 2 cores) when every rank raised, which is what
# a strategy's errors and Lightning's assertions do: each rank catches its exception and meets the others
# at a barrier, which proves the process group consistent, then reports it. A rank that raised alone waits
# at the barrier until the process group's timeout; the pool then restarts, as it would anyway.
def resolve(module: str, qualname: str) -> Callable:
    """The function a worker is asked to run, found by its module and qualified name."""
    import importlib

    fn: Any = importlib.import_module(module)
    for name in qualname.split("."):
        fn = getattr(fn, name)
    return fn


def _guarded(module: str, qualname: str, args: tuple, kwargs: dict) -> tuple:
    import traceback

    import torch.distributed as dist

    try:
        return ("ok", resolve(module, qualname)(*args, **kwargs))
    except Exception:
        report = traceback.format_exc()
    dist.barrier()
    return ("raised", report)


def on_ranks(dist_pool: Callable, body: Callable, *args: Any, world: int = WORLD, **kwargs: Any) -> list:
    """``body(*args, **kwargs)`` on every rank of a ``world``-rank pool; the results in rank order. A body
    that raises on any rank fails the case with every rank's traceback."""
    replies = dist_pool(world).run(_guarded, body.__module__, body.__qualname__, args, kwargs)
    failed = [f"--- rank {r} raised:\n{value}" for r, (kind, value) in enumerate(replies) if kind != "ok"]
    if failed:
        raise RuntimeError(f"{body.__qualname__} failed on {len(failed)} of {world} ranks\n" + "\n".join(failed))
    return [value for _, value in replies]


def deselected(table: dict[str, str]) -> Optional[Callable]:
    """A pytest case per deselected original test, skipped with its reason (``-rs`` lists them)."""
    names = sorted(table)
    if not names:
        return None  # nothing deselected: no case

    @pytest.mark.parametrize("original", names, ids=names)
    def test_deselected(original: str) -> None:
        pytest.skip(f"{original}: {table[original]}")

    return test_deselected


def shared_dir(path: Any) -> str:
    """A directory every rank sees (the pool's ranks share the host's file system)."""
    os.makedirs(path, exist_ok=True)
    return str(path)


def assert_checkpoint_dir(path: Any) -> None:
    """A zeroq checkpoint is a directory, as DeepSpeed's is: where Lightning's DeepSpeed tests check
    ``os.path.isdir(ckpt)`` the ported case checks the same (and that it holds our manifest)."""
    p = Path(path)
    assert p.is_dir(), f"{p} is not a checkpoint directory"
    assert any(p.iterdir()), f"{p} is empty"


# --------------------------------------------------------------------------- models and data the ports share


def classif_datamodule(batch_size: int = 16):
    """A stand-in for Lightning's test helper ``ClassifDataModule`` (scikit-learn's make_classification):
    32 features, 3 well separated classes (a Gaussian cloud around one center each), train/val/test
    splits; no scikit-learn needed."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class ClassifData(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(1234)
            centers = 2.0 * torch.randn(3, 32, generator=g)
            y = torch.randint(0, 3, (320,), generator=g)
            x = centers[y] + torch.randn(320, 32, generator=g)
            self.splits = {"train": (x[:192], y[:192]), "val": (x[192:256], y[192:256]), "test": (x[256:], y[256:])}

        def _loader(self, split: str) -> DataLoader:
            return DataLoader(TensorDataset(*self.splits[split]), batch_size=batch_size)

        def train_dataloader(self) -> DataLoader:
            return self._loader("train")

        def val_dataloader(self) -> DataLoader:
            return self._loader("val")

        def test_dataloader(self) -> DataLoader:
            return self._loader("test")

        def predict_dataloader(self) -> DataLoader:
            return self._loader("test")

    return ClassifData()


def warns_on_rank_zero(category: type, match: str):
    """``pytest.warns`` on global rank 0, nothing elsewhere: Lightning gives most of its warnings through
    ``rank_zero_warn`` (the original single-process cases see them; on 2 ranks only rank 0 does, which is
    what Lightning's own multi-device tests check too)."""
    import contextlib

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return contextlib.nullcontext()
    return pytest.warns(category, match=match)
