"""What ``zeroq-train`` runs: the ``Trainer`` and whole-run dataclasses Hydra composes into, built from plain
values, and the checks made before any process starts; a bad value becomes one line naming its Hydra key."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from lightning_zeroq.cli.data import DataConfig, check_one_batch_per_rank
from lightning_zeroq.cli.gpt import GPTConfig, OptimConfig
from lightning_zeroq.common.precision import PARAM_DTYPES
from lightning_zeroq.config import ZeroConfig, check_shard_group_size, check_swap_directory
from lightning_zeroq.validation import check_int


@dataclass(kw_only=True)
class TrainerConfig:
    """The ``lightning.Trainer`` arguments a recipe sets (the strategy is always ``ZeroQStrategy``)."""

    accelerator: str = "cpu"
    """``cpu``, ``gpu``/``cuda`` or ``auto``, as in Lightning."""

    devices: Any = 2
    """Processes per node: a number, ``auto`` or a list of device indices, as in Lightning."""

    num_nodes: int = 1
    """Number of nodes."""

    precision: str = "32-true"
    """One of the precisions ``ZeroQStrategy`` owns: 32-true, bf16-mixed, 16-mixed, bf16-true."""

    max_steps: int = 150
    """Optimizer steps to train for (the learning-rate schedule ends there)."""

    accumulate_grad_batches: int = 1
    """Batches per optimizer step."""

    gradient_clip_val: Optional[float] = 1.0
    """Clip gradients to this global norm across all shards; ``null`` disables clipping."""

    log_every_n_steps: int = 10
    """How often the loss is written to the CSV log."""

    enable_progress_bar: bool = True
    """Lightning's progress bar on rank 0."""

    enable_checkpointing: bool = False
    """Save a checkpoint directory at the end of training (off: the recipes are short benchmarks)."""

    logger: bool = True
    """Write the logged loss to ``csv/metrics.csv`` in the run directory."""

    def __post_init__(self) -> None:
        for name, minimum in (
            ("num_nodes", 1),
            ("max_steps", 1),
            ("accumulate_grad_batches", 1),
            ("log_every_n_steps", 1),
        ):
            check_int("TrainerConfig", name, getattr(self, name), minimum)
        check_devices(self.devices, self.accelerator)
        if self.precision not in PARAM_DTYPES:
            raise ValueError(
                f"TrainerConfig.precision={self.precision!r} is not a precision ZeroQStrategy owns; "
                f"use one of {list(PARAM_DTYPES)}."
            )
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise ValueError(
                f"TrainerConfig.gradient_clip_val={self.gradient_clip_val!r} must be positive, or null for no clipping."
            )


@dataclass(kw_only=True)
class FinetuneConfig:
    """Fine-tuning: the checkpoint the run starts from, and LoRA factors on a frozen copy of it."""

    base: Optional[str] = None
    """A checkpoint of this GPT to start from (a ``zeroq-train`` checkpoint directory, ``trainer.enable_checkpointing=
    true``; or any file ``lightning_zeroq.load_pretrained`` reads), each rank reading only its own shards; None: a
    fresh initialization."""

    lora_rank: int = 0
    """LoRA factors of this rank on every linear of the blocks, everything else frozen (stage 3 shards the frozen
    base with its block); 0: every parameter trains."""

    lora_alpha: float = 16.0
    """LoRA's scale is ``lora_alpha / lora_rank``."""

    def __post_init__(self) -> None:
        self.lora_rank = check_int("FinetuneConfig", "lora_rank", self.lora_rank, 0)
        if not isinstance(self.lora_alpha, (int, float)) or isinstance(self.lora_alpha, bool) or self.lora_alpha <= 0:
            raise ValueError(f"FinetuneConfig.lora_alpha={self.lora_alpha!r} must be a positive number, e.g. 16.")


@dataclass(kw_only=True)
class RunConfig:
    """One complete run: what ``zeroq-train`` composes from ``conf/`` and a recipe."""

    seed: int = 1234
    """Seed of model initialization and data order (the same on every rank)."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def __post_init__(self) -> None:
        if self.data.seq_len > self.model.block_size:
            raise ValueError(
                f"DataConfig.seq_len={self.data.seq_len} exceeds GPTConfig.block_size={self.model.block_size}; "
                "lower data.seq_len or raise model.block_size."
            )
        if self.model.vocab_size < 256:
            raise ValueError(
                f"GPTConfig.vocab_size={self.model.vocab_size} is too small for byte-level tokens; use 256."
            )


SECTIONS: dict[str, type] = {
    "zero": ZeroConfig,
    "model": GPTConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "trainer": TrainerConfig,
    "finetune": FinetuneConfig,
}
# ValueError messages name "<Class>.<field>=<value>"; in the Hydra config that field is "<section>.<field>".
CONFIG_KEYS = {cls.__name__: section for section, cls in SECTIONS.items()} | {"RunConfig": ""}


def build_run_config(values: dict[str, Any]) -> RunConfig:
    """``RunConfig`` from plain values (``dataclasses.asdict`` of one, or a resolved config).

    Nothing is interpolated: a ``${`` in a value is literal.
    """
    sections = dict(values)
    seed = sections.pop("seed", RunConfig().seed)
    built = {name: _build(field_type, sections.pop(name, {})) for name, field_type in SECTIONS.items()}
    for key, value in sections.items():  # only reachable with "+key=value", which bypasses the schema
        raise ValueError(f"RunConfig.{key}={value!r} is not a config section; the sections are {sorted(SECTIONS)}.")
    return RunConfig(seed=seed, **built)


def _build(cls: type, values: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    for key, value in values.items():  # "+zero.stagee=2" appends past the schema; reject it here
        if key not in known:
            raise ValueError(
                f"{cls.__name__}.{key}={value!r} is not a {cls.__name__} field; the fields are {sorted(known)}."
            )
    return cls(**values)


def check_devices(devices: Any, accelerator: str = "auto") -> None:
    """``ValueError`` unless ``devices`` is what Lightning takes: a positive count, -1 (every GPU; not for
    processes on the CPU), ``auto`` or a non-empty list of distinct device indices (Hydra gives a list as a
    ``ListConfig``)."""
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    fix = (
        "use a positive number of processes per node (e.g. 2) or auto"
        if on_cpu
        else "use a positive number of processes per node, -1 for all devices, auto, or a list of device indices"
    )
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, bool):
        pass
    elif isinstance(devices, int):
        if devices >= 1 or (devices == -1 and not on_cpu):
            return
        if devices == -1:
            raise ValueError(
                f"TrainerConfig.devices=-1 means every GPU, and the accelerator is the CPU "
                f"(accelerator={accelerator!r}); {fix}."
            )
    elif devices == "auto":
        return
    elif not isinstance(devices, str) and isinstance(devices, Sequence):
        items = list(devices)
        if on_cpu:
            pass
        elif (
            items
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items)
            and len(set(items)) == len(items)
        ):
            return
    raise ValueError(f"TrainerConfig.devices={devices!r} is not a device count Lightning can run; {fix}.")


def config_error_line(err: Exception) -> str:
    """One line for a bad config: the checker's message plus the Hydra key of the field it names."""
    message = " ".join(str(err).split())
    match = re.match(r"(\w+)\.(\w+)=", message)
    if match and match.group(1) in CONFIG_KEYS:
        section = CONFIG_KEYS[match.group(1)]
        key = f"{section}.{match.group(2)}" if section else match.group(2)
        message += f" [Hydra key: {key}]"
    return f"zeroq-train: error: {message}"


def preflight(run: RunConfig) -> None:
    """The checks that depend on this machine or on the text, made before any process starts.

    ``RuntimeError`` if the run needs a CUDA GPU and torch sees none; ``ValueError`` if the text does
    not fill one batch on every rank (training would end after 0 steps), ``zero.shard_group_size``
    does not divide the number of ranks, or a fine-tune has no base to start from.
    """
    cfg = run.trainer
    if cfg.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise RuntimeError(
            f"TrainerConfig.accelerator={cfg.accelerator!r} needs a CUDA GPU, and torch {torch.__version__} "
            f"({build}) sees none on this machine; use trainer=cpu."
        )
    ranks = world_size_of(cfg)
    if ranks is not None:
        check_one_batch_per_rank(run.data, ranks)
        if run.zero.shard_group_size != "node":
            check_shard_group_size(run.zero.shard_group_size, ranks)
    if run.zero.uses_nvme:
        check_swap_directory(run.zero.nvme_path)
    tune = run.finetune
    if tune.lora_rank and tune.base is None:
        raise ValueError(
            f"FinetuneConfig.lora_rank={tune.lora_rank} needs finetune.base, the checkpoint to fine-tune: pretrain "
            "with `zeroq-train trainer.enable_checkpointing=true` and pass its checkpoint "
            "(finetune.base=<run dir>/checkpoints/<name>.ckpt)."
        )
    if tune.base is not None and not Path(tune.base).exists():
        raise ValueError(
            f"FinetuneConfig.base={tune.base!r} does not exist; pass the checkpoint to start from "
            "(a zeroq-train run's <run dir>/checkpoints/<name>.ckpt)."
        )


def world_size_of(cfg: TrainerConfig) -> Optional[int]:
    """The number of ranks the Trainer will run, where the config (and this machine) tells; else None."""
    devices = cfg.devices
    if isinstance(devices, (list, tuple)):
        per_node = len(devices)
    elif isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()):
        per_node = int(devices)
    elif devices == "auto":  # as Lightning: every GPU, or one CPU process
        uses_cuda = cfg.accelerator in ("gpu", "cuda") or (cfg.accelerator == "auto" and torch.cuda.is_available())
        per_node = torch.cuda.device_count() if uses_cuda else 1
    else:
        return None
    return per_node * cfg.num_nodes if per_node > 0 else None  # -1 ("all") is left to Lightning
