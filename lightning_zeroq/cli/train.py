"""``zeroq-train``: Hydra recipes in, a Lightning run with ``ZeroQStrategy`` out. The only Hydra import.

Configuration:
- The typed dataclasses (``ZeroConfig``, ``GPTConfig``, ``OptimConfig``, ``DataConfig`` and, in ``config``,
  ``TrainerConfig`` and the top-level ``RunConfig``) are stored in Hydra's ConfigStore as schemas
  (``base_config``, ``zero/base``, ``model/base``, ``data/base``, ``trainer/base``). The YAML files in
  ``conf/`` extend them through their defaults lists, so a misspelt key or a wrong type fails when the
  config is composed, with Hydra's message naming it. ``offload/*`` and ``quantization/*`` write into
  the ``zero`` node (``# @package zero``).
- ``recipes/*.yaml`` are complete runs (``# @package _global_``) stored as the ``recipe`` group, the
  last entry of the primary defaults list: ``zeroq-train recipe=gpt1m_zero1_cpu trainer.max_steps=50``.
- After composition every section is instantiated as its dataclass, so the ``__post_init__`` checks
  run; then ``preflight`` checks what depends on this machine or
  on the text (a GPU for ``trainer=gpu``, one batch of text per rank). A ``ValueError`` there (or the
  ``RuntimeError`` of a missing GPU) ends the program with one line that names the value, the fix and
  the config key, exit status 2, before any process is started.
- ``conf/`` and ``recipes/`` are found inside the package (``lightning_zeroq/cli/conf``, where the wheel
  puts them), else at the top of the source checkout (``ops/_build.py``'s ``data_dir``).

Processes: the command itself is rank 0. Lightning's subprocess launcher starts ranks 1..N-1 by
re-running the command line; with Hydra it would append ``hydra.run.dir=...``, but re-running Hydra in
the children also re-runs ``--multirun`` sweeps and re-resolves the config. Instead, before ``fit`` the
parent puts the ``RunConfig`` it validated (plain values: the config is resolved exactly once, in the
parent, where Hydra's ``${hydra:...}`` resolver works, so a literal ``${`` in a value stays literal),
its run directory and label into ``ZEROQ_CHILD_CONFIG``, inherited by the children. The payload names
its writer (pid and, on Linux, start time): ``main`` trains from it only in a process with
``LOCAL_RANK`` set whose parent is that writer. Anything else, e.g. a variable left in the
environment of a ``torchrun`` launch, is dropped with a warning and Hydra runs as usual. So all ranks
share the parent's run directory and config, and children create no output directories. After each
job the parent waits for its children, destroys its process group and restores the launcher's
environment variables, so the next job of a ``--multirun`` sweep launches afresh.

Logging (``conf/hydra/job_logging/zeroq.yaml``): Lightning's loggers, this package's and Python
warnings (``logging.captureWarnings``) go through the root logger, so the run directory's
``zeroq-train.log`` gets the whole log of rank 0 with timestamps, while the console shows the same
lines plain: INFO on stdout (the summary line among them), warnings and errors on stderr.

``train`` is also what the recipe regression tests call, inside already-initialized worker processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional, Sequence

import hydra
import lightning as L
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_zeroq.cli.config import SECTIONS, RunConfig, build_run_config, config_error_line, preflight
from lightning_zeroq.cli.data import TextDataModule
from lightning_zeroq.cli.gpt import GPT, add_lora
from lightning_zeroq.lightning.strategy import ZeroQStrategy
from lightning_zeroq.ops import _build

HYDRA_VERSION_BASE = "1.3"
CHILD_ENV = "ZEROQ_CHILD_CONFIG"
FIGURES_SUFFIX = ".expected.json"
RECIPE_HEADER = "# @package _global_"
SUMMARY_PREFIX = "zeroq-train summary"

log = logging.getLogger("lightning_zeroq.cli")  # not __name__: that is "__main__" under python -m


@dataclass(frozen=True)
class TrainResult:
    """What a run reports; the same on every rank (gathered)."""

    label: str
    world_size: int
    num_parameters: int
    losses: list[float]
    """Loss of every training batch, averaged over the ranks."""
    tokens_per_s: float
    """Tokens consumed by all ranks per second of the training loop (set-up excluded)."""
    peak_memory_bytes: list[int]
    """Per rank: max RSS on CPU, ``torch.cuda.max_memory_allocated`` on GPU."""
    memory_kind: str
    skipped_steps: int = 0
    """Optimizer steps skipped for non-finite gradients (fp16 overflow, or ``nonfinite_gradients="skip"``)."""

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")

    def summary(self) -> str:
        peaks = ", ".join(f"{b / 2**20:.0f}" for b in self.peak_memory_bytes)
        return (
            f"{SUMMARY_PREFIX} | {self.label} | {len(self.losses)} steps on {self.world_size} ranks | "
            f"final loss {self.final_loss:.4f} | {self.tokens_per_s:,.0f} tokens/s | "
            f"peak memory per rank ({self.memory_kind}): {peaks} MiB | skipped steps {self.skipped_steps}"
        )


# ---------------------------------------------------------------------------- config files


def resource_dir(name: str) -> Path:
    """``conf`` or ``recipes``: inside the installed package, else at the top of the source checkout."""
    return _build.data_dir(f"lightning_zeroq.cli.{name}")


def recipe_names() -> list[str]:
    """Every recipe in ``recipes/``, sorted."""
    return sorted(path.stem for path in resource_dir("recipes").glob("*.yaml"))


def figures_path(recipe: str) -> Path:
    """Where the regression figures of ``recipe`` are stored (beside the recipe)."""
    return resource_dir("recipes") / f"{recipe}{FIGURES_SUFFIX}"


def register_configs() -> None:
    """Store the schemas and the recipes in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=RunConfig)
    for group, schema in SECTIONS.items():
        if group not in ("optim", "finetune"):  # no group: their values live in config.yaml and the recipes
            store.store(group=group, name="base", node=schema)
    for path in sorted(resource_dir("recipes").glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        if not text.startswith(RECIPE_HEADER):
            raise ValueError(
                f"recipe {path} must start with the line '{RECIPE_HEADER}' (recipes set keys of the whole config)."
            )
        store.store(
            group="recipe",
            name=path.stem,
            node=OmegaConf.create(text),
            package="_global_",
            provider="lightning_zeroq recipes",
        )


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the config like ``zeroq-train <overrides>`` does, without running anything."""
    register_configs()
    with initialize_config_dir(
        config_dir=str(resource_dir("conf")), version_base=HYDRA_VERSION_BASE, job_name="zeroq-train"
    ):
        return compose(config_name="config", overrides=list(overrides))


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Resolve a composed config and instantiate every section, running its checks; ``ValueError`` if bad."""
    sections: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    sections.pop("hydra", None)
    return build_run_config(sections)


class ConsoleInfoFilter(logging.Filter):
    """Lets records below WARNING through (to stdout); ``conf/hydra/job_logging/zeroq.yaml`` uses it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


# ---------------------------------------------------------------------------- training


class RunRecorder(L.Callback):
    """Records every batch's loss and the training loop's tokens and wall time on this rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0
        self.started = 0.0
        self.elapsed = 0.0
        self.skipped_steps = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.losses, self.tokens, self.started = [], 0, time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.tokens += batch[:, 1:].numel()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.elapsed = time.perf_counter() - self.started
        engine = getattr(trainer.strategy, "engine", None)
        self.skipped_steps = int(getattr(engine, "skipped_steps", 0))

    def gather(self, trainer: L.Trainer, label: str, num_parameters: int) -> TrainResult:
        """Collective: average the losses over the ranks, sum the tokens, collect peak memory."""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            peak, kind = torch.cuda.max_memory_allocated(device), "CUDA max allocated"
        else:  # Linux reports ru_maxrss in KiB
            peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max RSS"
        local = torch.tensor(
            [float(self.tokens), self.elapsed, float(peak), *self.losses], dtype=torch.float64, device=device
        )
        gathered = _all_gather_rows(local)
        losses = gathered[:, 3:].mean(dim=0).tolist()
        tokens_per_s = gathered[:, 0].sum().item() / max(gathered[:, 1].max().item(), 1e-9)
        return TrainResult(
            label=label,
            world_size=trainer.world_size,
            num_parameters=num_parameters,
            losses=losses,
            tokens_per_s=tokens_per_s,
            peak_memory_bytes=[int(b) for b in gathered[:, 2].tolist()],
            memory_kind=kind,
            skipped_steps=self.skipped_steps,
        )


def _all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Collective: ``(world_size, n)`` on CPU, row r from rank r (``(1, n)`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local.unsqueeze(0).cpu()
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    return torch.stack(rows).cpu()


def train(run: RunConfig, run_dir: Path, label: str) -> TrainResult:
    """Train ``run`` on this process's rank; every rank calls it. Rank 0 logs the summary (INFO).

    Called by ``zeroq-train`` (rank 0, which launches the other ranks during ``fit``), by its children,
    and by tests in processes that already have a process group (which is then left alone).
    """
    L.seed_everything(run.seed, verbose=False)
    model = GPT(run.model, run.optim)
    tune = run.finetune
    if tune.lora_rank:
        add_lora(model, tune.lora_rank, tune.lora_alpha)
    pretrained: dict[str, Any] = {}
    if tune.base is not None:
        # The base's names, less the LoRA wrapper's ``.base`` (``blocks.0.attn.qkv.base.weight`` was
        # ``blocks.0.attn.qkv.weight``); the factors are not in it.
        pretrained = {
            "pretrained": tune.base,
            "pretrained_name_map": _base_name,
            "pretrained_allow_missing": ["*.lora_a", "*.lora_b"] if tune.lora_rank else None,
        }
    data = TextDataModule(run.data)
    recorder = RunRecorder()
    owns_process_group = not dist.is_initialized()
    cfg = run.trainer
    trainer = L.Trainer(
        strategy=ZeroQStrategy(run.zero, **pretrained),
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        precision=cfg.precision,  # type: ignore[arg-type]
        max_steps=cfg.max_steps,
        accumulate_grad_batches=cfg.accumulate_grad_batches,
        gradient_clip_val=cfg.gradient_clip_val,
        log_every_n_steps=cfg.log_every_n_steps,
        enable_progress_bar=cfg.enable_progress_bar,
        enable_checkpointing=cfg.enable_checkpointing,
        logger=CSVLogger(run_dir, name="", version="csv") if cfg.logger else False,
        default_root_dir=run_dir,
        callbacks=[recorder],
    )
    if trainer.is_global_zero:
        log.info(
            "zeroq-train: %s: GPT with %s parameters, ZeRO stage %d, data %s, %s x %s, %s; run dir %s",
            label,
            f"{model.num_parameters():,}",
            run.zero.stage,
            data.source,
            cfg.accelerator,
            cfg.devices,
            cfg.precision,
            run_dir,
        )
    trainer.fit(model, datamodule=data)
    result = recorder.gather(trainer, label, model.num_parameters())
    if owns_process_group and dist.is_initialized():
        # Every rank destroys its group before rank 0 waits for the others to exit: NCCL's teardown
        # waits for the peers' teardown, so joining first would deadlock.
        dist.destroy_process_group()
    _join_children(trainer)
    if trainer.is_global_zero:
        log.info("%s", result.summary())
    return result


def _base_name(name: str) -> str:
    """A LoRA-wrapped GPT's parameter name as the base checkpoint holds it."""
    return name.replace(".base.", ".")


def _join_children(trainer: L.Trainer, timeout_s: float = 120.0) -> None:
    """Wait for the processes Lightning's launcher started (rank 0 of ``zeroq-train`` only)."""
    for proc in getattr(trainer.strategy.launcher, "procs", []):
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(
                f"a rank process (pid {proc.pid}) did not exit {timeout_s:.0f} s after training; killed it"
            ) from None
        if code != 0:
            raise RuntimeError(f"a rank process (pid {proc.pid}) exited with code {code}")


# ---------------------------------------------------------------------------- entry points


def _start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks after boot, Linux ``/proc``); None where unknown.

    With the pid it names a process for good: a pid alone is reused, and in a container the same
    command tends to get the same small pid on every run.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in (...) may hold spaces


@contextlib.contextmanager
def _children_inherit(run: RunConfig, run_dir: Path, label: str) -> Iterator[None]:
    """Hand the validated config to the children the launcher starts; restore the environment after."""
    saved = dict(os.environ)
    payload = {
        "parent_pid": os.getpid(),
        "parent_start": _start_time(os.getpid()),
        "run": dataclasses.asdict(run),
        "run_dir": str(run_dir),
        "label": label,
    }
    os.environ[CHILD_ENV] = json.dumps(payload)
    try:
        yield
    finally:  # the launcher set LOCAL_RANK, MASTER_PORT, ...: a next job must launch afresh
        os.environ.clear()
        os.environ.update(saved)


def inherited_payload() -> Optional[dict[str, Any]]:
    """The parent's payload if this process is a rank that this parent launched, else None.

    A ``ZEROQ_CHILD_CONFIG`` that does not qualify is removed from the environment with a warning on
    stderr, so that Hydra composes the config from the command line as usual.
    """
    text = os.environ.get(CHILD_ENV)
    if text is None:
        return None
    parent = os.getppid()
    try:
        payload = json.loads(text)
        writer = (payload["parent_pid"], payload["parent_start"])
    except (ValueError, KeyError, TypeError):
        reason = "it is not a payload of this version of zeroq-train"
    else:
        if "LOCAL_RANK" not in os.environ:
            reason = "LOCAL_RANK is not set, so no launcher started this process as a rank"
        elif writer != (parent, _start_time(parent)):
            reason = f"it was written by process {writer[0]}, not by this process's parent {parent}"
        else:
            return payload
    del os.environ[CHILD_ENV]
    print(
        f"zeroq-train: warning: ignoring {CHILD_ENV}: {reason} (a leftover of another run?); "
        "composing the config from the command line.",
        file=sys.stderr,
        flush=True,
    )
    return None


def _fail(err: Exception) -> NoReturn:
    print(config_error_line(err), file=sys.stderr, flush=True)
    raise SystemExit(2)


def _hydra_task(cfg: DictConfig) -> float:
    logging.captureWarnings(True)  # warnings reach the log file too (conf/hydra/job_logging/zeroq.yaml)
    try:
        run = to_run_config(cfg)
    except ValueError as err:
        _fail(err)
    try:
        preflight(run)
    except (ValueError, RuntimeError) as err:
        _fail(err)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    label = str(hydra_cfg.runtime.choices.get("recipe") or "no recipe")
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("recipe=")]
    if overrides:
        label += f" [{' '.join(overrides)}]"
    with _children_inherit(run, run_dir, label):
        return train(run, run_dir, label).final_loss


def main() -> None:
    """The ``zeroq-train`` console script (also ``python -m lightning_zeroq.cli``)."""
    payload = inherited_payload()
    if payload is not None:  # a rank launched by zeroq-train: train on the parent's config, no Hydra
        train(build_run_config(payload["run"]), Path(payload["run_dir"]), payload["label"])
        return
    try:
        register_configs()
    except ValueError as err:
        _fail(err)
    task = hydra.main(version_base=HYDRA_VERSION_BASE, config_path=str(resource_dir("conf")), config_name="config")(
        _hydra_task
    )
    task()


if __name__ == "__main__":
    main()
