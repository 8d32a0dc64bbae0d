"""Reading a DeepSpeed ZeRO checkpoint (stages 1, 2 and 3; fp32 or bf16/fp16 training, whose fp32
master partitions are what it keeps), without DeepSpeed and without unpickling code.

A DeepSpeed checkpoint directory holds a ``latest`` file naming its tag, and under the tag:

- per rank ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: that rank's partition of the fp32
  masters of each parameter group and the optimizer's state for it, flat (``exp_avg`` and
  ``exp_avg_sq`` for Adam, the same length as the partition; ``step``);
- the model states, ``mp_rank_00_model_states.pt`` (stages 1 and 2) or one per rank (stage 3):
  ``param_shapes`` (per parameter group at stages 1 and 2, per sub-group at stage 3: the parameters in
  order by name and shape), the frozen parameters (``frozen_param_shapes`` and
  ``frozen_param_fragments``: whole at stage 2, each rank's part at stage 3; stage 1 keeps them only in
  ``module``, the module's full state dict), the tied ones (``shared_params``: each name DeepSpeed does
  not store, with the name it stores under, in rank 0's file) and the step counters; where Lightning's
  ``DeepSpeedStrategy`` wrote it, also the Trainer's own state (its loops, callbacks, counters and
  schedulers: ``LIGHTNING_KEYS``), which resumes with the rest.

Stages 1 and 2 flatten each group's parameters one after another (DeepSpeed may record a padding after
each one, ``param_alignment_paddings``), pad the end, and give each rank an equal consecutive part: the
ranks' parts concatenated are the group. Stage 3 cuts every parameter on its own into as many equal
parts as there are ranks (the last padded) and gives rank R its R-th part of each, one after another in
the order of ``param_shapes``, across its groups. It splits each parameter group into sub-groups of
about ``sub_group_size`` elements per rank, each a flat tensor with its own optimizer state: the
optimizer's ``param_groups`` list the sub-groups of each group (their ids in the state).

Before any value is taken, the files are checked against each other: every rank's file records the
number of ranks (``partition_count``, and ``dp_world_size`` in the model states), which must be the
number of rank files; stages 1 and 2 record which part of each parameter a rank holds
(``param_slice_mappings``), which must be the part of the rank the file's name says; every file records
the name it was saved under (torch's archive name inside it), which must be its name now; the
partitions must be as long as the shapes need at that many ranks. So rank files renamed, mixed up,
missing or left over from another save are one line naming the file, never wrong values.

The checkpoint directory is opened once and everything in it relative to it, never through a symbolic
link: ``latest`` must name a tag directory inside it (one plain name).

The files are read with ``torch.load(weights_only=True)``; the few DeepSpeed objects pickled in them
(its loss scaler, a stage enum, fragment addresses) are read as inert stand-ins that keep their fields,
so nothing of DeepSpeed is imported or run. An fp16 run's dynamic loss scale (``_loss_scale``) resumes
in ZeroQ's scaler under ``16-mixed``.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_zeroq.checkpoint.agree import CheckpointError, agree
from lightning_zeroq.checkpoint.files import Files
from lightning_zeroq.checkpoint.store import (
    DEEPSPEED_LATEST,
    DEEPSPEED_OPTIMIZER_FILE,
    ENGINE_KEY,
    classify,
    lightning_version,
)


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
    """Every parameter: the trained ones' fp32 masters in the order of DeepSpeed's parameter groups, then
    the frozen ones (their values, in fp32), then each tied name (the same tensor as the name it is tied to)."""
    groups: list[list[str]]
    """The parameter names of each group (the trained parameters)."""
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
    frozen: list[str] = field(default_factory=list)
    """The parameters no optimizer held (``requires_grad=False``): in ``params``, in no group."""
    tied: dict[str, str] = field(default_factory=dict)
    """Each tied parameter name DeepSpeed did not store -> the name it stored it under (both in ``params``)."""


LIGHTNING_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "lr_schedulers")
"""What Lightning's ``DeepSpeedStrategy`` saves as DeepSpeed's client state (in the model states file)."""
MODEL_FILE = r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt"
"""A stage-3 rank's model states file."""
_SAVED_AS = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states")


def is_deepspeed(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory (or one of its tag directories), not ZeroQ's:
    ``store.classify`` decides."""
    return classify(Path(path)).is_deepspeed


_LINK = (
    "is a symbolic link: not opened, a DeepSpeed checkpoint's tag directory and files are read only from "
    "inside its directory, never through a link"
)


def _open_tag(path: Path) -> Files:
    """The tag directory of the checkpoint at ``path`` (``path`` itself where it holds the rank files),
    opened relative to ``path``, never through a link, and only where ``latest`` names one plain name."""
    try:
        top = Files(path)
    except OSError as error:
        raise DeepSpeedCheckpointError(
            f"{path}: cannot be opened as a DeepSpeed checkpoint directory ({error.strerror or error})"
        ) from None
    names = top.names()
    if any(re.fullmatch(DEEPSPEED_OPTIMIZER_FILE, n) for n in names):
        return top
    latest = path / DEEPSPEED_LATEST
    if DEEPSPEED_LATEST not in names:
        top.close()
        raise DeepSpeedCheckpointError(
            f"{path}: no DeepSpeed checkpoint (no 'latest' file naming a tag directory "
            "with *zero_pp_rank_*_optim_states.pt files)"
        )
    problem = None
    try:
        raw = top.read(DEEPSPEED_LATEST, 0, 4096) if top.is_file(DEEPSPEED_LATEST) else None
        tag = raw.decode("utf-8").strip() if raw is not None else ""
    except UnicodeDecodeError:
        problem = "not UTF-8 text, so it names no tag directory of this DeepSpeed checkpoint (the file is damaged)"
    except ValueError:  # a link (files.Files)
        problem = _LINK
    except OSError as error:
        problem = f"cannot be read ({error.strerror or error})"
    else:
        if raw is None:
            problem = "not a file, so it names no tag directory of this DeepSpeed checkpoint"
    if problem is not None:
        top.close()
        raise DeepSpeedCheckpointError(f"{latest}: {problem}")
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag or os.path.isabs(tag):
        top.close()
        raise DeepSpeedCheckpointError(
            f"{latest}: names the tag {tag!r}, which is not a directory inside {path}; it "
            "was not opened (a DeepSpeed tag is one directory name beside 'latest')"
        )
    try:
        return top.subdirectory(tag)
    except ValueError:  # a link
        raise DeepSpeedCheckpointError(f"{path / tag}: the tag directory 'latest' names, {_LINK}") from None
    except FileNotFoundError:
        raise DeepSpeedCheckpointError(
            f"{latest}: names the DeepSpeed tag {tag!r}, but {path / tag} does not exist "
            "(the checkpoint is incomplete, or 'latest' is from another save)"
        ) from None
    except OSError as error:
        raise DeepSpeedCheckpointError(
            f"{path / tag}: the DeepSpeed tag directory {latest} names cannot be opened ({error.strerror or error})"
        ) from None
    finally:
        top.close()


def _refused(error: BaseException) -> Optional[str]:
    """What torch's weights-only reader refused (a global, an opcode), or None for another failure."""
    text = str(error)
    if "Weights only load failed" not in text and not isinstance(error, pickle.UnpicklingError):
        return None
    found = re.search(r"GLOBAL (\S+)", text) or re.search(r"WeightsUnpickler error: ([^\n.]+)", text)
    return found.group(1) if found else "an object a weights-only load does not allow"


def _load(files: Files, name: str) -> tuple[dict, Optional[int]]:
    """One rank file of the tag directory: its dict, and the rank it records having been saved as (torch's
    archive name inside it; None where it names no DeepSpeed rank file)."""
    path = files.directory / name
    try:
        fd = files.fd(name)
        if not files.is_file(name):
            raise DeepSpeedCheckpointError(f"{path}: not a file")
    except ValueError:  # a symbolic link
        raise DeepSpeedCheckpointError(f"{path}: {_LINK}") from None
    except OSError as error:
        raise DeepSpeedCheckpointError(f"{path}: cannot be opened ({error.strerror or error})") from None
    saved_as = None
    try:
        with os.fdopen(os.dup(fd), "rb") as f, zipfile.ZipFile(f) as archive:
            first = archive.namelist()[0] if archive.namelist() else ""
        match = _SAVED_AS.fullmatch(first.split("/", 1)[0])
        saved_as = int(match.group(1)) if match else None
    except (zipfile.BadZipFile, OSError, IndexError):
        pass  # not torch's zip format: torch.load says so below
    # the file through the descriptor opened above (memory-mapped where /proc names it: never reopened by name)
    source: Any = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else os.fdopen(os.dup(fd), "rb")
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=isinstance(source, str))
    except Exception as error:  # a damaged file, or one with code in it: named, never run
        refused = _refused(error)
        if refused is not None:
            raise DeepSpeedCheckpointError(
                f"{path}: cannot be read as a DeepSpeed checkpoint file: it refers to {refused}, which a DeepSpeed "
                "checkpoint never holds; it was not loaded, because unpickling it could run code, and cannot be "
                "loaded safely (the file is damaged or was made to run code)"
            ) from None
        raise DeepSpeedCheckpointError(
            f"{path}: cannot be read as a DeepSpeed checkpoint file "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        ) from None
    finally:
        if not isinstance(source, str):
            source.close()
    if not isinstance(loaded, dict):
        raise DeepSpeedCheckpointError(f"{path}: holds a {type(loaded).__name__}, not DeepSpeed's dict of states")
    return loaded, saved_as


def _field(d: dict, key: str, path: Path, where: str = "") -> Any:
    if key not in d:
        raise DeepSpeedCheckpointError(
            f"{path}: no field {where}{key!r}: not a DeepSpeed ZeRO checkpoint of the "
            "layout this reader knows (DeepSpeed 0.19's; tests/data/deepspeed)"
        )
    return d[key]


def _rank_files(tag: Files, pattern: str, what: str) -> list[str]:
    found: dict[int, str] = {}
    for name in tag.names():
        if m := re.fullmatch(pattern, name):
            found[int(m.group(1))] = name
    if not found:
        raise DeepSpeedCheckpointError(f"{tag.directory}: no {what} files")
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        raise DeepSpeedCheckpointError(
            f"{tag.directory}: the {what} file of rank {missing[0]} is missing (found ranks {sorted(found)})"
        )
    return [found[r] for r in sorted(found)]


def _rank_name(names: list[str], rank: int) -> str:
    """The file name of ``rank`` in the pattern of ``names`` (rank 0's)."""
    return re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{rank}_", names[0], count=1)


def _check_world(tag: Files, names: list[str], recorded: list[tuple[str, int, str]], what: str) -> None:
    """Every file's recorded number of ranks (``recorded``: file name, count, the field) is the number of
    ``what`` files: a missing last rank, or a file too many, named."""
    world = len(names)
    for name, count, key in recorded:
        if count > world:
            raise DeepSpeedCheckpointError(
                f"{tag.directory / _rank_name(names, world)}: missing: {name} records {count} ranks ({key}), the "
                f"tag directory holds the {what} files of ranks 0-{world - 1} (the checkpoint is incomplete)"
            )
        if count < world:
            raise DeepSpeedCheckpointError(
                f"{tag.directory / names[count]}: one {what} file too many: {name} records {count} ranks ({key}), the "
                f"tag directory holds {world} such files (a file left over from another save?)"
            )


def _check_saved_as(tag: Files, names: list[str], saved: list[Optional[int]]) -> None:
    for rank, (name, was) in enumerate(zip(names, saved)):
        if was is not None and was != rank:
            raise DeepSpeedCheckpointError(
                f"{tag.directory / name}: was saved as rank {was}'s file (the name recorded inside it), but its name "
                f"says rank {rank}: rank files renamed or mixed up"
            )


Layout = list[tuple[str, int, tuple[int, ...]]]
"""Stages 1/2: a group's parameters, each with its offset in the group's flat vector and its shape."""


def _group_layout(shapes: dict, pads: list[int]) -> Layout:
    out, offset = [], 0
    for (name, shape), pad in zip(shapes.items(), pads):
        out.append((str(name), offset, tuple(shape)))
        offset += math.prod(tuple(shape)) + int(pad)
    return out


def _slice_mapping(layout: Layout, rank: int, part: int) -> dict[str, tuple[int, int]]:
    """Stages 1/2: what ``param_slice_mappings`` records for ``rank``'s part of a group: per parameter
    it holds some of, (start in the part, numel)."""
    lo, hi = rank * part, (rank + 1) * part
    out = {}
    for name, offset, shape in layout:
        n = math.prod(shape)
        start, end = max(offset, lo), min(offset + n, hi)
        if start < end:
            out[name] = (start - lo, end - start)
    return out


def _recorded_mapping(mapping: Any) -> Optional[dict[str, tuple[int, int]]]:
    """A rank's ``param_slice_mappings`` for one group (inert ``fragment_address`` objects), or None where
    it is not in the layout this reader knows."""
    try:
        return {str(name): (int(a.state["start"]), int(a.state["numel"])) for name, a in mapping.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def read(path: Path, optimizer: bool = True) -> DeepSpeedState:
    """The checkpoint at ``path`` (the directory ``save_checkpoint`` wrote, or its tag directory)."""
    tag = _open_tag(Path(path))
    try:
        return _read(tag, optimizer)
    finally:
        tag.close()


def _read(tag: Files, optimizer: bool) -> DeepSpeedState:
    optim_names = _rank_files(tag, DEEPSPEED_OPTIMIZER_FILE, "optimizer state")
    optims, optim_saved = [], []
    for name in optim_names:
        loaded, saved_as = _load(tag, name)
        optims.append((tag.directory / name, _field(loaded, "optimizer_state_dict", tag.directory / name)))
        optim_saved.append(saved_as)
    first_file, first = optims[0]
    stage = int(_field(first, "zero_stage", first_file, "optimizer_state_dict."))
    world = len(optims)
    counts = []
    for file, outer in optims:
        count = _field(outer, "partition_count", file, "optimizer_state_dict.")
        counts.append((file.name, max(count) if isinstance(count, (list, tuple)) else int(count), "partition_count"))
    _check_world(tag, optim_names, counts, "optimizer state")
    if stage == 3:
        model_names = _rank_files(tag, MODEL_FILE, "model state")
    else:
        model_names = ["mp_rank_00_model_states.pt"]
        if model_names[0] not in tag.names():
            raise DeepSpeedCheckpointError(
                f"{tag.directory / model_names[0]}: missing (stage {stage} keeps its parameter shapes there)"
            )
    models, model_saved = [], []
    for name in model_names:
        loaded, saved_as = _load(tag, name)
        models.append(loaded)
        model_saved.append(saved_as)
    if stage == 3:  # one model states file per rank: as many as optimizer state files, each of their world
        recorded = [
            (n, int(m["dp_world_size"]), "dp_world_size")
            for n, m in zip(model_names, models)
            if isinstance(m.get("dp_world_size"), int)
        ]
        _check_world(tag, model_names, [(optim_names[0], world, "partition_count"), *recorded], "model state")
    model_file = tag.directory / model_names[0]
    model = models[0]
    shapes = _field(model, "param_shapes", model_file)
    sizes = {name: tuple(shape) for g in shapes for name, shape in g.items()}
    state_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    bases = [(f, _field(o, state_key, f, "optimizer_state_dict.")) for f, o in optims]
    param_groups = _field(bases[0][1], "param_groups", first_file)
    if stage == 3:  # param_shapes and fp32_flat_groups per sub-group; param_groups list each group's sub-groups
        flats = [_field(o, "fp32_flat_groups", f, "optimizer_state_dict.") for f, o in optims]
        subgroups = _subgroups(param_groups, len(shapes), len(flats[0]), first_file)
        _check_stage3(tag, optim_names, flats, shapes, world)
        _check_saved_as(tag, optim_names, optim_saved)
        _check_saved_as(tag, model_names, model_saved)
    else:
        subgroups = [[g] for g in range(len(shapes))]
        if len(shapes) != len(param_groups):
            raise DeepSpeedCheckpointError(
                f"{model_file}: param_shapes holds {len(shapes)} parameter group(s), the "
                f"optimizer {len(param_groups)} ({first_file.name}): files of two saves?"
            )
        partitions = [_field(o, "single_partition_of_fp32_groups", f, "optimizer_state_dict.") for f, o in optims]
        paddings = first.get("param_alignment_paddings")
        layouts = [
            _group_layout(g, paddings[i] if paddings is not None else [0] * len(g)) for i, g in enumerate(shapes)
        ]
        _check_stage12(tag, optim_names, optims, partitions, layouts, world)
        _check_saved_as(tag, optim_names, optim_saved)
    groups = [[name for s in subs for name in shapes[s]] for subs in subgroups]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
    hyper = [_torch_adam_group(h, model.get("ds_config") or {}, first_file) for h in hyper]
    out = DeepSpeedState(
        stage,
        world,
        {},
        groups,
        hyperparameters=hyper,
        global_steps=int(model.get("global_steps", 0) or 0),
        lightning={k: model[k] for k in LIGHTNING_KEYS if k in model},
        loss_scale=_loss_scale(first),
    )
    if stage == 3:
        order = [n for g in shapes for n in g]
        _unzip_stage3(out, flats, sizes, order, None, first_file)
        if optimizer:
            for key in MOMENTS:
                moments = [[_moment(base, s, key, f) for s in range(len(flats[0]))] for f, base in bases]
                _unzip_stage3(out, moments, sizes, order, key, first_file)
    else:
        for g, layout in enumerate(layouts):
            _split_stage12(out, torch.cat([p[g] for p in partitions]), layout, None, first_file)
            if optimizer:
                for key in MOMENTS:
                    whole = torch.cat([_moment(base, g, key, f) for f, base in bases])
                    _split_stage12(out, whole, layout, key, first_file)
    if optimizer:
        for subs, names in zip(subgroups, groups):
            step = bases[0][1]["state"].get(subs[0], {}).get("step") if subs else None
            for name in names:
                if step is not None and name in out.state:
                    out.state[name]["step"] = step.clone() if isinstance(step, Tensor) else torch.tensor(float(step))
    _frozen(out, tag, model_names, models, stage, world)
    shared = model.get("shared_params") or {}
    for alias, source in shared.items():  # tied: DeepSpeed stores the parameter once, under ``source``
        if source in out.params and alias not in out.params:
            out.params[str(alias)] = out.params[source]
            out.tied[str(alias)] = str(source)
    return out


def _subgroups(param_groups: list, shapes: int, flats: int, file: Path) -> list[list[int]]:
    """Stage 3: the sub-groups (indices into ``param_shapes``, ``fp32_flat_groups`` and the optimizer's
    state) of each parameter group, as its ``param_groups`` list them."""
    try:
        subs = [[int(i) for i in g["params"]] for g in param_groups]
    except (KeyError, TypeError, ValueError):
        subs = []
    if shapes != flats or [i for g in subs for i in g] != list(range(shapes)):
        raise DeepSpeedCheckpointError(
            f"{file}: its {len(param_groups)} parameter group(s) list the sub-groups {subs}, but param_shapes holds "
            f"{shapes} sub-group(s) and fp32_flat_groups {flats}: not the layout this reader knows (DeepSpeed 0.19's)"
        )
    return subs


def _check_stage3(tag: Files, names: list[str], flats: list[list[Tensor]], shapes: list[dict], world: int) -> None:
    """Each rank's sub-group partitions are as long as their parameters' parts at ``world`` ranks."""
    needed = [sum(-(-math.prod(tuple(shape)) // world) for shape in g.values()) for g in shapes]
    for name, groups in zip(names, flats):
        held = [int(t.numel()) for t in groups]
        if held != needed:
            s = next(i for i, (a, b) in enumerate(zip(held, needed)) if a != b) if len(held) == len(needed) else 0
            raise DeepSpeedCheckpointError(
                f"{tag.directory / name}: its fp32_flat_groups hold {held} elements per sub-group, but param_shapes "
                f"needs {needed} at {world} ranks (sub-group {s}): param_shapes and the partitions disagree"
            )


def _check_stage12(tag: Files, names: list[str], optims: list, partitions: list, layouts: list, world: int) -> None:
    """Each rank's part of each group is as long as every other's (DeepSpeed saves it less the group's end
    padding, ``group_paddings``), all of them long enough for the group, and holds
    (``param_slice_mappings``) the part of the rank its file's name says."""
    for g, layout in enumerate(layouts):
        held = []
        for (_, outer), partition in zip(optims, partitions):
            pads = outer.get("group_paddings")
            pad = int(pads[g]) if isinstance(pads, (list, tuple)) and len(pads) > g else 0
            held.append((int(partition[g].numel()), pad))
        part = held[0][0] + held[0][1]
        need = (layout[-1][1] + math.prod(layout[-1][2])) if layout else 0
        for name, (n, pad) in zip(names, held):
            if n + pad != part or part * world < need:
                raise DeepSpeedCheckpointError(
                    f"{tag.directory / name}: its part of parameter group {g} holds {n} elements and {pad} of padding, "
                    f"rank 0's {part} in all; the group needs {need} at {world} ranks: param_shapes and the partitions "
                    "disagree"
                )
        for rank, (name, (_, outer)) in enumerate(zip(names, optims)):
            mappings = outer.get("param_slice_mappings")
            if not isinstance(mappings, (list, tuple)) or len(mappings) <= g:
                continue  # not recorded (older DeepSpeed): the archive names still tell
            recorded = _recorded_mapping(mappings[g])
            if recorded is None or recorded == _slice_mapping(layout, rank, part):
                continue
            holds = [r for r in range(world) if recorded == _slice_mapping(layout, r, part)]
            what = f"rank {holds[0]}'s part" if holds else "no rank's part"
            raise DeepSpeedCheckpointError(
                f"{tag.directory / name}: its param_slice_mappings describe {what} of parameter group {g}, but its "
                f"name says rank {rank}: rank files renamed or mixed up"
            )


def _frozen(
    out: DeepSpeedState, tag: Files, model_names: list[str], models: list[dict], stage: int, world: int
) -> None:
    """The frozen parameters: stage 3's from every rank's ``frozen_param_fragments`` (its part of each),
    stage 2's whole from them; stage 1 records none apart, so its ``module`` (the full state dict) holds
    them: every entry there that is no trained, tied or buffer name."""
    model = models[0]
    shapes = model.get("frozen_param_shapes")
    if shapes:
        for name, shape in shapes.items():
            shape = tuple(shape)
            n = math.prod(shape)
            parts = []
            for file, m in zip(model_names, models if stage == 3 else models[:1]):
                fragment = (m.get("frozen_param_fragments") or {}).get(name)
                expected = -(-n // world) if stage == 3 else n
                if not isinstance(fragment, Tensor) or fragment.numel() != expected:
                    got = "none" if not isinstance(fragment, Tensor) else f"{fragment.numel()} elements"
                    raise DeepSpeedCheckpointError(
                        f"{tag.directory / file}: its frozen_param_fragments hold {got} of frozen parameter {name!r} "
                        f"(shape {shape}), {expected} expected at {world} ranks"
                    )
                parts.append(fragment.reshape(-1))
            out.params[str(name)] = torch.cat(parts)[:n].clone().float().view(shape)
            out.frozen.append(str(name))
        return
    if stage == 3:
        return  # saved without them (exclude_frozen_parameters): nothing to read
    module = model.get("module")
    skip = set(out.params) | set(model.get("buffer_names") or ()) | set((model.get("shared_params") or {}).keys())
    for name, value in module.items() if isinstance(module, dict) else ():
        if name not in skip and isinstance(value, Tensor) and value.is_floating_point():
            out.params[str(name)] = value.clone().float()
            out.frozen.append(str(name))


def _torch_adam_group(group: dict[str, Any], ds_config: dict, file: Path) -> dict[str, Any]:
    """A parameter group of DeepSpeed's own Adam (its CPU or fused kernels: ``bias_correction`` among the
    settings) as torch's ``AdamW`` (or ``Adam``, where the config turned off decoupled weight decay) keeps
    one, so that the optimizer ``configure_optimizers`` makes takes it; torch's own groups as they are."""
    if "bias_correction" not in group:
        return group
    if not group["bias_correction"]:
        raise DeepSpeedCheckpointError(
            f"{file}: its Adam ran with bias_correction=False, which torch's Adam and "
            "AdamW do not offer: load the weights only (zeroq-convert without --optimizer)"
        )
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    decoupled = (ds_config.get("optimizer") or {}).get("type", "AdamW").lower() == "adamw" or params.get(
        "adam_w_mode", True
    )
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    out = {k: v for k, v in torch_class([torch.zeros(1, requires_grad=True)]).param_groups[0].items() if k != "params"}
    out.update({k: group[k] for k in ("lr", "eps", "weight_decay", "amsgrad") if k in group})
    if "betas" in group:
        out["betas"] = tuple(group["betas"])
    return out


def _moment(base: dict, group: int, key: str, file: Path) -> Tensor:
    state = base.get("state", {}).get(group)
    if state is None or key not in state:
        raise DeepSpeedCheckpointError(
            f"{file}: no optimizer state {key!r} for parameter group {group} (only Adam's "
            "moments are read: pass --optimizer only for Adam/AdamW checkpoints)"
        )
    return state[key]


def _put(out: DeepSpeedState, name: str, value: Tensor, key: Optional[str]) -> None:
    if key is None:
        out.params[name] = value
    else:
        out.state.setdefault(name, {})[key] = value


def _split_stage12(out: DeepSpeedState, whole: Tensor, layout: Layout, key: Optional[str], file: Path) -> None:
    """Stages 1/2: one group's flat vector (every rank's part, in rank order) into its parameters."""
    for name, offset, shape in layout:
        n = math.prod(shape)
        if offset + n > whole.numel():
            raise DeepSpeedCheckpointError(
                f"{file}: the group holding {name!r} has {whole.numel()} elements, fewer "
                f"than its parameters' shapes need (param_shapes and the partitions disagree)"
            )
        _put(out, name, whole[offset : offset + n].clone().float().view(shape), key)


def _unzip_stage3(
    out: DeepSpeedState,
    flats: list[list[Tensor]],
    sizes: dict[str, tuple[int, ...]],
    names: list[str],
    key: Optional[str],
    file: Path,
) -> None:
    """Stage 3: each rank's concatenated groups hold its part of every parameter in turn; a parameter
    is its parts in rank order, less the padding of the last."""
    world = len(flats)
    per_rank = [torch.cat([t.reshape(-1) for t in groups]) for groups in flats]
    offset = 0
    for name in names:
        n = math.prod(sizes[name])
        part = -(-n // world)
        if offset + part > per_rank[0].numel():
            raise DeepSpeedCheckpointError(
                f"{file}: the flat partitions end before parameter {name!r} "
                "(param_shapes and fp32_flat_groups disagree)"
            )
        whole = torch.cat([flat[offset : offset + part] for flat in per_rank])[:n]
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
    out: dict[str, Any] = {
        "state_dict": state.params,
        "global_step": state.global_steps,
        "epoch": 0,
        "pytorch-lightning_version": lightning_version(),
    }
    if state.loss_scale is not None:  # ZeroQ's scaler picks it up where the run uses one (16-mixed)
        out[ENGINE_KEY] = {"loss_scaler": state.loss_scale}
    if state.lightning:  # written by Lightning's DeepSpeedStrategy: its Trainer state resumes too
        out.update({k: v for k, v in state.lightning.items() if optimizer or k != "lr_schedulers"})
    if optimizer:
        names = [name for group in state.groups for name in group]
        ids = {name: i for i, name in enumerate(names)}
        out["optimizer_states"] = [
            {
                "state": {ids[n]: state.state[n] for n in names if n in state.state},
                "param_groups": [
                    {**hyper, "params": [ids[n] for n in group]}
                    for hyper, group in zip(state.hyperparameters, state.groups)
                ],
            }
        ]
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
