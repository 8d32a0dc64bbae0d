"""Reading a DeepSpeed ZeRO checkpoint (stages 1, 2 and 3; fp32 or bf16/fp16 training, whose fp32
master partitions are what it keeps), without DeepSpeed and without unpickling code.

A DeepSpeed checkpoint directory holds a ``latest`` file naming its tag, and under the tag:

- per rank ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: that rank's partition of the fp32
  masters of each parameter group and the optimizer's state for it, flat (``exp_avg`` and
  ``exp_avg_sq`` for Adam, the same length as the partition; ``step``);
- the model states, ``mp_rank_00_model_states.pt`` (stages 1 and 2) or one per rank (stage 3):
  ``param_shapes`` (per parameter group, the parameters in order by name and shape) and the step
  counters; where Lightning's ``DeepSpeedStrategy`` wrote it, also the Trainer's own state (its loops,
  callbacks, counters and schedulers: ``LIGHTNING_KEYS``), which resumes with the rest.

Stages 1 and 2 flatten each group's parameters one after another (DeepSpeed may record a padding after
each one, ``param_alignment_paddings``), pad the end, and give each rank an equal consecutive part: the
ranks' parts concatenated are the group. Stage 3 cuts every parameter on its own into as many equal
parts as there are ranks (the last padded) and gives rank R its R-th part of each, one after another in
the order of ``param_shapes``, across its groups.

The files are read with ``torch.load(weights_only=True)``; the few DeepSpeed objects pickled in them
(its loss scaler, a stage enum, fragment addresses) are read as inert stand-ins that keep their fields,
so nothing of DeepSpeed is imported or run. An fp16 run's dynamic loss scale (``_loss_scale``) resumes
in ZeroQ's scaler under ``16-mixed``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_zeroq.checkpoint.agree import CheckpointError, agree
from lightning_zeroq.checkpoint.store import ENGINE_KEY, lightning_version


class DeepSpeedCheckpointError(CheckpointError, ValueError):
    """A DeepSpeed checkpoint that cannot be read: one line naming the file and the field."""


class _Inert:
    """A DeepSpeed object in a checkpoint, kept as its fields (never run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _value(value: Any) -> Any:
    return value


_STAND_INS: list[Union[Callable[..., Any], tuple[Callable[..., Any], str]]] = [
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Inert, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class DeepSpeedState:
    """What a DeepSpeed checkpoint holds, by parameter name, whole and in fp32."""

    stage: int
    world_size: int
    params: dict[str, Tensor]
    """The fp32 masters, in the order of DeepSpeed's parameter groups."""
    groups: list[list[str]]
    """The parameter names of each group."""
    state: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    """Per parameter: ``exp_avg``, ``exp_avg_sq`` (Adam's moments) and ``step``, where the optimizer kept them."""
    hyperparameters: list[dict[str, Any]] = field(default_factory=list)
    """Per group: the optimizer's settings (``lr``, ``betas``, ``weight_decay``, ...)."""
    global_steps: int = 0
    loss_scale: Optional[dict[str, Any]] = None
    """fp16 training with a dynamic scale: its state as ZeroQ's scaler keeps it (``scale``, ``good_steps``:
    DeepSpeed's iterations since its last overflow, ``skipped_steps``); None otherwise."""
    lightning: dict[str, Any] = field(default_factory=dict)
    """Where Lightning's ``DeepSpeedStrategy`` wrote the checkpoint: the Trainer's own state it kept beside
    DeepSpeed's (``LIGHTNING_KEYS``: its loops, callbacks, epoch and step counters, schedulers)."""


LIGHTNING_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "lr_schedulers")
"""What Lightning's ``DeepSpeedStrategy`` saves as DeepSpeed's client state (in the model states file)."""


def is_deepspeed(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory (or one of its tag directories)."""
    path = Path(path)
    return path.is_dir() and (_tag_dir(path) is not None)


def _tag_dir(path: Path) -> Optional[Path]:
    if any(path.glob("*zero_pp_rank_*_optim_states.pt")):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = path / latest.read_text().strip()
        if tag.is_dir() and any(tag.glob("*zero_pp_rank_*_optim_states.pt")):
            return tag
    return None


def _load(path: Path) -> dict:
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a damaged file, or one with code in it: named, never run
        raise DeepSpeedCheckpointError(f"{path}: cannot be read as a DeepSpeed checkpoint file "
                                       f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None
    if not isinstance(loaded, dict):
        raise DeepSpeedCheckpointError(f"{path}: holds a {type(loaded).__name__}, not DeepSpeed's dict of states")
    return loaded


def _field(d: dict, key: str, path: Path, where: str = "") -> Any:
    if key not in d:
        raise DeepSpeedCheckpointError(f"{path}: no field {where}{key!r}: not a DeepSpeed ZeRO checkpoint of the "
                                       "layout this reader knows (DeepSpeed 0.19's; tests/data/deepspeed)")
    return d[key]


def _rank_files(tag: Path, pattern: str, what: str) -> list[Path]:
    found = {int(m.group(1)): p for p in tag.iterdir() if (m := re.fullmatch(pattern, p.name))}
    if not found:
        raise DeepSpeedCheckpointError(f"{tag}: no {what} files")
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        raise DeepSpeedCheckpointError(f"{tag}: the {what} file of rank {missing[0]} is missing "
                                       f"(found ranks {sorted(found)})")
    return [found[r] for r in sorted(found)]


def read(path: Path, optimizer: bool = True) -> DeepSpeedState:
    """The checkpoint at ``path`` (the directory ``save_checkpoint`` wrote, or its tag directory)."""
    tag = _tag_dir(Path(path))
    if tag is None:
        raise DeepSpeedCheckpointError(f"{path}: no DeepSpeed checkpoint (no 'latest' file naming a tag directory "
                                       "with *zero_pp_rank_*_optim_states.pt files)")
    optim_files = _rank_files(tag, r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt", "optimizer state")
    optims = []
    for file in optim_files:
        outer = _field(_load(file), "optimizer_state_dict", file)
        optims.append((file, outer))
    first_file, first = optims[0]
    stage = int(_field(first, "zero_stage", first_file, "optimizer_state_dict."))
    world = len(optims)
    if stage == 3:
        model_files = _rank_files(tag, r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt", "model state")
    else:
        model_files = [tag / "mp_rank_00_model_states.pt"]
        if not model_files[0].is_file():
            raise DeepSpeedCheckpointError(f"{model_files[0]}: missing (stage {stage} keeps its parameter shapes there)")
    model = _load(model_files[0])
    shapes = _field(model, "param_shapes", model_files[0])
    groups = [list(g.keys()) for g in shapes]
    sizes = {name: tuple(shape) for g in shapes for name, shape in g.items()}
    state_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    bases = [(f, _field(o, state_key, f, "optimizer_state_dict.")) for f, o in optims]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in _field(bases[0][1], "param_groups", first_file)]
    hyper = [_torch_adam_group(h, model.get("ds_config") or {}, first_file) for h in hyper]
    out = DeepSpeedState(stage, world, {}, groups, hyperparameters=hyper,
                         global_steps=int(model.get("global_steps", 0) or 0),
                         lightning={k: model[k] for k in LIGHTNING_KEYS if k in model},
                         loss_scale=_loss_scale(first))
    if stage == 3:
        order = [n for g in groups for n in g]
        flats = [_field(o, "fp32_flat_groups", f, "optimizer_state_dict.") for f, o in optims]
        _unzip_stage3(out, flats, sizes, order, None, first_file)
        if optimizer:
            for key in MOMENTS:
                moments = [[_moment(base, g, key, f) for g in range(len(flats[0]))] for f, base in bases]
                _unzip_stage3(out, moments, sizes, order, key, first_file)
    else:
        partitions = [_field(o, "single_partition_of_fp32_groups", f, "optimizer_state_dict.") for f, o in optims]
        paddings = first.get("param_alignment_paddings")
        for g, names in enumerate(groups):
            pads = paddings[g] if paddings is not None else [0] * len(names)
            _split_stage12(out, torch.cat([p[g] for p in partitions]), names, sizes, pads, None, first_file)
            if optimizer:
                for key in MOMENTS:
                    whole = torch.cat([_moment(base, g, key, f) for f, base in bases])
                    _split_stage12(out, whole, names, sizes, pads, key, first_file)
    if optimizer:
        for g, names in enumerate(groups):
            step = bases[0][1]["state"].get(g, {}).get("step")
            for name in names:
                if step is not None and name in out.state:
                    out.state[name]["step"] = step.clone() if isinstance(step, Tensor) else torch.tensor(float(step))
    return out


def _torch_adam_group(group: dict[str, Any], ds_config: dict, file: Path) -> dict[str, Any]:
    """A parameter group of DeepSpeed's own Adam (its CPU or fused kernels: ``bias_correction`` among the
    settings) as torch's ``AdamW`` (or ``Adam``, where the config turned off decoupled weight decay) keeps
    one, so that the optimizer ``configure_optimizers`` makes takes it; torch's own groups as they are."""
    if "bias_correction" not in group:
        return group
    if not group["bias_correction"]:
        raise DeepSpeedCheckpointError(f"{file}: its Adam ran with bias_correction=False, which torch's Adam and "
                                       "AdamW do not offer: load the weights only (zeroq-convert without --optimizer)")
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    decoupled = (ds_config.get("optimizer") or {}).get("type", "AdamW").lower() == "adamw" or params.get("adam_w_mode", True)
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    out = {k: v for k, v in torch_class([torch.zeros(1, requires_grad=True)]).param_groups[0].items() if k != "params"}
    out.update({k: group[k] for k in ("lr", "eps", "weight_decay", "amsgrad") if k in group})
    if "betas" in group:
        out["betas"] = tuple(group["betas"])
    return out


def _moment(base: dict, group: int, key: str, file: Path) -> Tensor:
    state = base.get("state", {}).get(group)
    if state is None or key not in state:
        raise DeepSpeedCheckpointError(f"{file}: no optimizer state {key!r} for parameter group {group} (only Adam's "
                                       "moments are read: pass --optimizer only for Adam/AdamW checkpoints)")
    return state[key]


def _put(out: DeepSpeedState, name: str, value: Tensor, key: Optional[str]) -> None:
    if key is None:
        out.params[name] = value
    else:
        out.state.setdefault(name, {})[key] = value


def _split_stage12(out: DeepSpeedState, whole: Tensor, names: list[str], sizes: dict[str, tuple[int, ...]],
                   pads: list[int], key: Optional[str], file: Path) -> None:
    """Stages 1/2: one group's flat vector (every rank's part, in rank order) into its parameters."""
    offset = 0
    for name, pad in zip(names, pads):
        n = math.prod(sizes[name])
        if offset + n > whole.numel():
            raise DeepSpeedCheckpointError(f"{file}: the group holding {name!r} has {whole.numel()} elements, fewer "
                                           f"than its parameters' shapes need (param_shapes and the partitions disagree)")
        _put(out, name, whole[offset:offset + n].clone().float().view(sizes[name]), key)
        offset += n + int(pad)


def _unzip_stage3(out: DeepSpeedState, flats: list[list[Tensor]], sizes: dict[str, tuple[int, ...]], names: list[str],
                  key: Optional[str], file: Path) -> None:
    """Stage 3: each rank's concatenated groups hold its part of every parameter in turn; a parameter
    is its parts in rank order, less the padding of the last."""
    world = len(flats)
    per_rank = [torch.cat([t.reshape(-1) for t in groups]) for groups in flats]
    offset = 0
    for name in names:
        n = math.prod(sizes[name])
        part = -(-n // world)
        if offset + part > per_rank[0].numel():
            raise DeepSpeedCheckpointError(f"{file}: the flat partitions end before parameter {name!r} "
                                           "(param_shapes and fp32_flat_groups disagree)")
        whole = torch.cat([flat[offset:offset + part] for flat in per_rank])[:n]
        _put(out, name, whole.clone().float().view(sizes[name]), key)
        offset += part


def _loss_scale(optimizer_state: dict) -> Optional[dict[str, Any]]:
    """DeepSpeed's dynamic fp16 loss scaler (an inert stand-in of ``DynamicLossScaler``), as ZeroQ's
    scaler state; None where the checkpoint has none (bf16, fp32) or a fixed scale."""
    scaler = optimizer_state.get("loss_scaler")
    fields = getattr(scaler, "state", None)
    if not isinstance(fields, dict) or not fields.get("dynamic") or "cur_scale" not in fields:
        return None
    since = int(fields.get("cur_iter", 0)) - int(fields.get("last_overflow_iter", -1)) - 1
    return {"scale": float(fields["cur_scale"]), "good_steps": max(0, since), "skipped_steps": 0}


def as_lightning_checkpoint(state: DeepSpeedState, optimizer: bool) -> dict:
    """The checkpoint as the single-file Lightning checkpoint ``strategy="ddp"`` writes: the fp32 weights
    by name, with ``optimizer`` torch's optimizer state (parameter ids in DeepSpeed's group order, the order
    the same ``configure_optimizers`` gives them), and the step count."""
    out: dict[str, Any] = {"state_dict": state.params, "global_step": state.global_steps, "epoch": 0,
                           "pytorch-lightning_version": lightning_version()}
    if state.loss_scale is not None:  # ZeroQ's scaler picks it up where the run uses one (16-mixed)
        out[ENGINE_KEY] = {"loss_scaler": state.loss_scale}
    if state.lightning:  # written by Lightning's DeepSpeedStrategy: its Trainer state resumes too
        out.update({k: v for k, v in state.lightning.items() if optimizer or k != "lr_schedulers"})
    if optimizer:
        names = [name for group in state.groups for name in group]
        ids = {name: i for i, name in enumerate(names)}
        out["optimizer_states"] = [{
            "state": {ids[n]: state.state[n] for n in names if n in state.state},
            "param_groups": [{**hyper, "params": [ids[n] for n in group]}
                             for hyper, group in zip(state.hyperparameters, state.groups)],
        }]
        out.setdefault("lr_schedulers", [])
    return out


def load_agreed(path: Path, optimizer: bool, group: Any) -> dict:
    """Collective: ``as_lightning_checkpoint`` of the checkpoint at ``path``, read by every rank (into its
    host memory); one that cannot be read raises the same error on every rank."""
    errors, checkpoint = [], {}
    try:
        checkpoint = as_lightning_checkpoint(read(path, optimizer=optimizer), optimizer=optimizer)
    except DeepSpeedCheckpointError as error:
        errors.append(str(error))
    agree(errors, f"Loading checkpoint {path}", group)
    return checkpoint
