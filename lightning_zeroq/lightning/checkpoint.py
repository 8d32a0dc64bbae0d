"""Lightning glue for checkpoints: what ``ZeroQStrategy``'s checkpoint methods do.

Save (``save``): Lightning's checkpoint dict is split without touching the caller's dict: its
``state_dict`` and ``optimizer_states[0]`` (sharded, from ``lightning_module_state_dict`` and
``optimizer_state``) go to DCP; so does the module's sharded state where a callback moved it to another
key (Lightning's weight averaging: ``current_model_state``, with the average's full tensors under
``state_dict``); everything else (loops, callbacks, schedulers, precision, hyperparameters, and the
engine's loss scaler under ``"zeroq"``) becomes the manifest's JSON trainer state. A weights-only checkpoint (``ModelCheckpoint(save_weights_only=True)``) is one consolidated
Lightning file instead, gathered unit by unit to rank 0's host memory only and written by rank 0
(atomically); any strategy and ``load_from_checkpoint`` read it.

Load (``load``): a ZeroQ or other DCP directory is validated on every rank and read into the engine
(``engine_io``; the optimizer state only when fitting; a moved module state comes back whole in the
trainer state beside ``state_dict``, for the callback that moved it); a single file (a Lightning checkpoint written
by ``strategy="ddp"``, or our weights-only file) is read with ``torch.load(weights_only=True)``
(memory-mapped) unless the caller passes ``weights_only=False`` for a file they trust, and its
``optimizer_states`` are loaded into the shards. Anything else ends every rank with one error that
names the path and the fix.

``install_load_from_checkpoint`` makes ``LightningModule.load_from_checkpoint(dir)`` read a checkpoint
directory (one process, no process group) by consolidating its weights in memory.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from torch import Tensor

from lightning_zeroq.checkpoint import api
from lightning_zeroq.checkpoint.api import MODEL_KEY, OPTIMIZER_KEY, Checkpointer
from lightning_zeroq.zero import state_dict as zsd
from lightning_zeroq.zero.state_dict import ShardedParts

if TYPE_CHECKING:
    import lightning.pytorch as pl


def _register_types() -> None:
    from lightning.fabric.utilities.data import AttributeDict

    api.register_type("AttributeDict", AttributeDict, dict, AttributeDict)
    api.register_type("Namespace", argparse.Namespace, vars, lambda d: argparse.Namespace(**d))
    try:
        from omegaconf import DictConfig, ListConfig
    except ImportError:
        return
    api.register_type("DictConfig", DictConfig, _config_to_plain, lambda plain: _config_from_plain(plain, dict))
    api.register_type("ListConfig", ListConfig, _config_to_plain, lambda plain: _config_from_plain(plain, list))


# OmegaConf containers resolve an interpolation ("${oc.env:VAR}", "${resolver:...}", "${other.key}") when it is
# read: one in a loaded checkpoint would copy the loading process's environment into hparams (and loggers) or run
# a resolver it registered. So a save stores them resolved (as Lightning's hparams.yaml does), a literal "${"
# escaped, and a load refuses any interpolation before OmegaConf sees the value.
_INTERPOLATION_START = re.compile(r"(\\*)\$\{")


def _config_to_plain(config: Any) -> Any:
    from omegaconf import OmegaConf

    def escape(value: Any) -> Any:  # OmegaConf reads "\${" as a literal "${" and halves the backslashes before it
        if isinstance(value, str):
            return _INTERPOLATION_START.sub(lambda m: m.group(1) * 2 + "\\${", value)
        if isinstance(value, dict):
            return {k: escape(v) for k, v in value.items()}
        return [escape(v) for v in value] if isinstance(value, list) else value

    return escape(OmegaConf.to_container(config, resolve=True))


def _interpolation(value: Any, where: str = "") -> Optional[tuple[str, str]]:
    """The first string in ``value`` (a plain container) that OmegaConf would resolve, and where it is: a
    "${" not escaped by an odd number of backslashes."""
    if isinstance(value, str):
        return (
            (value, where or "the top")
            if any(len(m.group(1)) % 2 == 0 for m in _INTERPOLATION_START.finditer(value))
            else None
        )
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _interpolation(
            item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        )
        if found is not None:
            return found
    return None


def _config_from_plain(plain: Any, kind: type) -> Any:
    from omegaconf import OmegaConf

    name, value = ("DictConfig" if kind is dict else "ListConfig"), plain
    if not isinstance(plain, kind):  # OmegaConf.create would parse a string as YAML
        raise ValueError(
            f"holds a {name} made of a {type(plain).__name__}, not a {kind.__name__}: the trainer "
            "state was edited or damaged."
        )
    found = _interpolation(plain)
    if found is not None:
        raise ValueError(
            f"holds the OmegaConf interpolation {found[0]!r} at {found[1]}, which loading never "
            "resolves (it could read environment variables or run a registered resolver); a save "
            "stores OmegaConf values resolved, so the checkpoint was edited or saved by an earlier "
            "lightning_zeroq: load its weights only (zeroq-convert CKPT OUT.pt) and set the "
            "hyperparameters yourself."
        )
    return OmegaConf.create(value)


_register_types()


class Owner(Protocol):
    """What these functions read of ``ZeroQStrategy``."""

    @property
    def engine(self) -> Optional[ShardedParts]: ...

    @property
    def lightning_module(self) -> Optional["pl.LightningModule"]: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def exclude_frozen_parameters(self) -> bool: ...


def save(strategy: Owner, checkpoint: dict, path: Path, checkpointer: Checkpointer) -> None:
    engine = strategy.engine
    if "optimizer_states" not in checkpoint or engine is None:
        save_single_file(strategy, checkpoint, path, checkpointer)
        return
    optimizers = checkpoint["optimizer_states"]
    # A callback may have moved the module's sharded state to another key and put a state dict of its own
    # (full tensors) under "state_dict" (Lightning's weight averaging); both are stored with the tensors.
    moved = [
        k
        for k, v in checkpoint.items()
        if k not in ("state_dict", "optimizer_states", OPTIMIZER_KEY) and api.holds_sharded_state(v)
    ]
    state = {MODEL_KEY: checkpoint["state_dict"], **{k: checkpoint[k] for k in moved}}
    if optimizers:
        state[OPTIMIZER_KEY] = optimizers[0]
    trainer_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", *moved)}
    api.save(engine, path, state, trainer_state, checkpointer, exclude_frozen=strategy.exclude_frozen_parameters)


def save_single_file(strategy: Owner, checkpoint: dict, path: Path, checkpointer: Checkpointer) -> None:
    """Weights only: one Lightning file of full fp32 weights, built on rank 0 alone."""
    checkpointer.wait()
    engine = strategy.engine
    weights = zsd.full_state_dict(engine.parts, rank0_only=True) if engine is not None else None

    def make() -> dict:
        out = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        model = {}
        given = checkpoint["state_dict"]
        module = strategy.lightning_module
        live = module.state_dict(keep_vars=True) if module is not None else {}
        for key, value in {**live, **given}.items():
            if weights is not None and key in weights:
                model[key] = weights[key]
            elif isinstance(given.get(key, value), Tensor):
                model[key] = given.get(key, value).detach().cpu()
        return api.with_engine_state(engine, {**out, "state_dict": model})

    api.write_file(path, make if strategy.is_global_zero else None)


def outside_checkpoint_dirs(strategy: object, path: Path) -> Optional[str]:
    """The ``ModelCheckpoint`` directory ``path`` seems to lie in but does not: it names the directory
    as a parent (what Lightning checks before a cleanup) yet resolves (``..``, a linked subdirectory;
    the last component itself is not followed: a link is removed, never its target) to a place
    outside it. None otherwise (a path elsewhere is the caller's own choice)."""
    module = getattr(strategy, "_lightning_module", None)
    trainer = getattr(module, "_trainer", None) if module is not None else None
    dirs = [c.dirpath for c in (getattr(trainer, "checkpoint_callbacks", None) or []) if getattr(c, "dirpath", None)]
    given = Path(path).absolute()  # not normalized: '..' stays, as Lightning's check sees it
    target = Path(os.path.realpath(given.parent)) / given.name
    for directory in dirs:
        lexical, root = Path(directory).absolute(), Path(os.path.realpath(directory))
        if lexical in given.parents and not (target != root and root in target.parents):
            return str(directory)
    return None


def load(
    strategy: Owner, checkpoint_path: Any, weights_only: Optional[bool], checkpointer: Checkpointer
) -> tuple[dict, bool]:
    """The trainer state to hand to Lightning, and whether the model's weights are already loaded."""
    from lightning.pytorch.trainer.states import TrainerFn

    module = strategy.lightning_module
    trainer = module.trainer if module is not None else None
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    engine = strategy.engine
    loaded = api.load(
        engine,
        checkpoint_path,
        optimizer=fitting,
        strict=getattr(module, "strict_loading", True),
        checkpointer=checkpointer,
        moved=True,
        read_file=lambda path, group: load_single_file(strategy, path, weights_only, fitting, group),
    )
    state, path = loaded.trainer_state, Path(checkpoint_path)
    if loaded.foreign and (path / api.LIGHTNING_META).is_file():  # Lightning's ModelParallelStrategy layout
        state = api.read_lightning_meta(path)
    elif loaded.foreign:
        state = foreign_trainer_state(path, fitting, strategy.is_global_zero)
    if fitting:
        count_steps_from(engine, state)
    return state, loaded.weights_loaded


def count_steps_from(engine: Optional[ShardedParts], state: Any) -> None:
    """The engine counts optimizer steps on from the checkpoint's global step, so its messages ("in
    optimizer step N") speak of the run's step, not of this fit's."""
    if engine is not None and isinstance(state, dict):
        try:
            engine.steps = max(int(state.get("global_step") or 0), 0)
        except (TypeError, ValueError):
            pass


def foreign_trainer_state(path: Path, fitting: bool, rank_zero: bool) -> dict:
    """What Lightning needs to go on from a DCP directory that holds no trainer state (no zeroq.json,
    no meta.pt: e.g. saved by FSDP2 with ``dcp.save``): its weights (and, when fitting, its optimizer
    state) are loaded; loops, schedulers and callbacks start afresh."""
    import warnings

    import lightning

    if rank_zero:
        what = "weights and optimizer state were" if fitting else "weights were"
        warnings.warn(
            f"{path} is a torch.distributed.checkpoint directory without ZeroQ's trainer state (no zeroq.json, e.g. saved by "
            f"FSDP2): its {what} loaded; the loops, learning-rate schedulers and callbacks start afresh "
            "at step 0.",
            stacklevel=2,
        )
    return {
        "pytorch-lightning_version": lightning.__version__,
        "global_step": 0,
        "epoch": 0,
        "lr_schedulers": [],
        "optimizer_states": [],
    }


def load_single_file(
    strategy: Owner, path: Path, weights_only: Optional[bool], fitting: bool, group: Any
) -> tuple[dict, bool]:
    checkpoint = api.read_single_file(path, group, optimizer=fitting, weights_only=weights_only is not False)
    errors = []
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        errors.append(f"{path} is not a Lightning checkpoint (no 'state_dict'): load it into the module yourself.")
    api.agree(errors, f"Loading checkpoint {path}", group)
    engine = strategy.engine
    optimizers = checkpoint.get("optimizer_states") or []
    if fitting and engine is not None and engine.optimizer is not None and optimizers:
        strict = getattr(strategy.lightning_module, "strict_loading", True)
        api.load_torch_optimizer_state(engine, checkpoint["state_dict"], optimizers[0], group, strict=strict)
        return checkpoint, True
    return checkpoint, False


def install_load_from_checkpoint() -> None:
    """``LightningModule.load_from_checkpoint(directory)``: read a checkpoint directory's weights."""
    import lightning.pytorch.core.saving as saving

    original = saving.pl_load
    if getattr(original, "_zeroq", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        if isinstance(path_or_url, (str, Path)) and not str(path_or_url).startswith(("http://", "https://")):
            checkpoint = api.read_weights(Path(path_or_url), map_location)
            if checkpoint is not None:
                import lightning

                checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)  # a foreign DCP directory
                return checkpoint
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._zeroq = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load
