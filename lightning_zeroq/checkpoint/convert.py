"""Offline consolidation: a sharded checkpoint directory to one file, tensor by tensor, no GPU, no
process group (what ``zeroq-convert CKPT OUT`` runs; its command line is ``cli/convert.py``).

- ``OUT.pt`` / ``OUT.pth`` / ``OUT.ckpt`` (torch): the full fp32 parameters (and buffers) by ``state_dict`` name, so
  ``nn.Module.load_state_dict(torch.load(OUT), strict=True)`` works; with ``--lightning`` a Lightning
  checkpoint instead (``state_dict`` plus the trainer state: loops, callbacks, schedulers, hparams,
  and where a callback moved the module's state, that entry: ``current_model_state``), which
  ``LightningModule.load_from_checkpoint`` reads; ``--optimizer`` adds ``optimizer_states`` in
  torch's own format (integer parameter ids in param-group order), so ``Trainer(strategy="ddp")``
  resumes from it (a Lightning checkpoint too: ``--optimizer --lightning`` writes the same file). A
  checkpoint without optimizer state is refused with ``--optimizer``.
- ``OUT.safetensors``: the same tensors (``--optimizer``: also ``optimizer.state.<name>.<key>``, the
  param groups as JSON in the metadata), written by the ``safetensors`` package
  (``pip install safetensors``), whose format rules stay its own to keep right.
- ``--adapters-only``: the trainable parameters alone (the names the optimizer's param groups hold), as a bare
  state dict in either format. A checkpoint saved with ``exclude_frozen_parameters`` converts to what it holds,
  and ``consolidate`` says so (``note``). ``hf_export.py`` writes a Hugging Face directory instead.

Memory stays at about one tensor: the torch file's skeleton (the pickle and the zip headers, from
``torch.save`` under ``torch.serialization.skip_data``) is built in memory, the whole file is
reserved (``posix_fallocate``), and each tensor is read from the checkpoint and written into its
record with ``pwrite`` (``sparse_save``): a full disk or a file-size limit is an error naming the
bytes needed and free, never a SIGBUS. The output is pickled once, by torch, and never unpickled
here, so any hyperparameters the trainer state holds (an OmegaConf ``DictConfig``) are written as
they are. A safetensors output is staged that way too (a flat torch file beside it, removed
afterwards), and ``save_file`` reads its tensors from a private memory map of it: page cache, not
process memory. Every read goes through the safe reader.

The output is written under a temporary name in its own directory (created exclusively, with an
unpredictable name) and renamed into place only when complete: whatever fails (a damaged checkpoint,
a full disk, Ctrl-C), nothing is left at the output path and no temporary file either.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import pickle
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_zeroq.checkpoint import atomic, deepspeed, sparse_save
from lightning_zeroq.checkpoint.agree import CheckpointError, advising
from lightning_zeroq.checkpoint.checkpointer import Opened, open_checkpoint
from lightning_zeroq.checkpoint.chunks import BytesTarget
from lightning_zeroq.checkpoint.engine_io import FROZEN_EXCLUDED
from lightning_zeroq.checkpoint.safe import read_entries
from lightning_zeroq.checkpoint.store import MODEL_KEY, OPTIMIZER_KEY, classify, lightning_version, moved_entries
from lightning_zeroq.nulls import nothing
from lightning_zeroq.ranks import LOCAL

SAFETENSORS_EXTRA = "pip install safetensors"  # what the extra installs; this package is on no index


def _read(opened: Opened, targets: dict) -> None:
    """``read_entries``, its errors naming the checkpoint and the item in one line."""
    try:
        read_entries(opened.reader, targets)
    except Exception as error:
        items = ", ".join(sorted(targets)[:3])
        text = str(error).strip()
        if isinstance(error, pickle.UnpicklingError) or "Weights only load failed" in text:
            why = "its bytes do not decode: the file is damaged"
        else:
            why = (text.splitlines() or [type(error).__name__])[0]
        raise ConvertError(f"reading {items} from {opened.path} failed ({why}).") from error


def tensor_keys(opened: Opened, prefix: str) -> list[str]:
    """The checkpoint's tensor keys under ``prefix``, in its order."""
    return [k for k, v in opened.keys().items() if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)]


def _empty(opened: Opened, key: str) -> Tensor:
    md = opened.keys()[key]
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def read_tensor(opened: Opened, key: str) -> Tensor:
    """The whole tensor stored under ``key`` (through the safe reader, its checksums checked)."""
    tensor = _empty(opened, key)
    _read(opened, {key: tensor})
    return tensor


def _param_groups(opened: Opened) -> list[dict]:
    prefix = f"{OPTIMIZER_KEY}.param_groups."
    targets = {k: BytesTarget() for k in opened.keys() if k.startswith(prefix)}
    _read(opened, targets)
    groups: dict[int, dict] = {}
    for key, target in targets.items():
        index, name = key[len(prefix) :].split(".", 1)
        groups.setdefault(int(index), {})[name] = target.value
    return [groups[i] for i in sorted(groups)]


def optimizer_layout(opened: Opened) -> tuple[list[dict], dict[str, dict[str, str]]]:
    """torch-format param groups (integer ids) and, per parameter name, state key -> checkpoint key."""
    groups = _param_groups(opened)
    base = f"{OPTIMIZER_KEY}.state."
    per_name: dict[str, dict[str, str]] = {}
    for key in opened.keys():
        if key.startswith(base):
            name, _, state_key = key[len(base) :].rpartition(".")
            per_name.setdefault(name, {})[state_key] = key
    out_groups, index = [], 0
    ids: dict[str, int] = {}
    for group in groups:
        names = list(group.get("params", []))
        for name in names:
            ids[name] = index
            index += 1
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [ids[n] for n in names]})
    layout = {name: keys for name, keys in per_name.items() if name in ids}
    return out_groups, {str(ids[n]): keys for n, keys in layout.items()}


def skeleton(opened: Opened, *, optimizer: bool, lightning: bool) -> tuple[dict, list[tuple[Tensor, str]]]:
    """The output's structure with empty (never touched) tensors, and each of them with its checkpoint key."""
    sources: list[tuple[Tensor, str]] = []
    model = {}
    nested = lightning or optimizer
    for key in tensor_keys(opened, MODEL_KEY + "."):
        name = key[len(MODEL_KEY) + 1 :]
        model[name] = _empty(opened, key)
        sources.append((model[name], key))
    if not nested:
        return model, sources
    out: dict[str, Any] = dict(opened.trainer_state())
    out.pop("zeroq", None)
    out.setdefault("pytorch-lightning_version", lightning_version())  # none in a foreign DCP directory
    out["state_dict"] = model
    for entry in moved_entries(opened.keys()) if opened.manifest is not None else ():
        out[entry] = {}  # where a callback moved the module's state (Lightning's weight averaging)
        for key in tensor_keys(opened, entry + "."):
            tensor = out[entry][key[len(entry) + 1 :]] = _empty(opened, key)
            sources.append((tensor, key))
    if optimizer:
        groups, layout = optimizer_layout(opened)
        state: dict[int, dict[str, Any]] = {}
        for index, keys in layout.items():
            state[int(index)] = {}
            for state_key, ckpt_key in keys.items():
                if isinstance(opened.keys()[ckpt_key], TensorStorageMetadata):
                    state[int(index)][state_key] = _empty(opened, ckpt_key)
                    sources.append((state[int(index)][state_key], ckpt_key))
        out["optimizer_states"] = [{"state": state, "param_groups": groups}]
    return out, sources


def write_torch(
    opened: Opened, out: Path, *, optimizer: bool, lightning: bool, only: Optional[set[str]] = None
) -> None:
    """``only``: the names of the parameters to write (a bare state dict of them; ``trainable_names``)."""
    structure, sources = skeleton(opened, optimizer=optimizer, lightning=lightning)
    if only is not None:
        structure = {name: value for name, value in structure.items() if name in only}
        sources = [(tensor, key) for tensor, key in sources if key[len(MODEL_KEY) + 1 :] in only]
    _write_filled(opened, out, structure, sources)


def _write_filled(
    opened: Opened, out: Path, structure: Any, sources: list[tuple[Tensor, str]], *, fsync: bool = True
) -> None:
    """``torch.save(structure, out)`` with each tensor of ``sources`` read from its checkpoint key into
    its place in the file, one tensor in memory at a time (``sparse_save``); ``fsync=False`` for a file
    that is read back and removed. A full disk or a file-size limit is one line with the sizes."""
    keys = {tensor.untyped_storage()._cdata: key for tensor, key in sources}
    skeleton = sparse_save.save_skeleton(structure)
    del structure, sources
    with open(out, "r+b") as f:
        offsets = sparse_save.write_skeleton(skeleton, f, out)
        for record, storage in skeleton.storages.items():
            key = keys.get(storage._cdata)
            data: Any
            if key is None:  # the trainer state's own tensors (ModelCheckpoint's scores, a scheduler's)
                data = storage
            else:  # the skeleton's tensor stays untouched (no memory); the checkpoint's is read beside it
                data = _empty(opened, key)
                _read(opened, {key: data})
                data = data.untyped_storage()  # the only reference to the tensor's memory
            try:
                sparse_save.pwrite_all(f.fileno(), sparse_save.as_bytes(data), offsets[record])
            except OSError as error:
                raise sparse_save.no_room(error, out, skeleton.size) from error
            del data  # one tensor in memory at a time
        if fsync:
            os.fsync(f.fileno())


def _map(path: Path) -> Any:
    """``torch.load`` of ``path``, memory-mapped privately (page cache the kernel can drop)."""
    previous = torch.serialization.get_default_mmap_options()
    torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    finally:
        torch.serialization.set_default_mmap_options(previous or mmap.MAP_PRIVATE)


def iter_named_tensors(opened: Opened, *, optimizer: bool) -> Iterator[tuple[str, Tensor]]:
    for key in tensor_keys(opened, MODEL_KEY + "."):
        tensor = _empty(opened, key)
        _read(opened, {key: tensor})
        yield key[len(MODEL_KEY) + 1 :], tensor
    if optimizer:
        for key in tensor_keys(opened, f"{OPTIMIZER_KEY}.state."):
            tensor = _empty(opened, key)
            _read(opened, {key: tensor})
            yield "optimizer." + key[len(OPTIMIZER_KEY) + 1 :], tensor


def safetensors_save_file() -> Any:
    """``safetensors.torch.save_file``, or a one-line error saying how to install it."""
    try:
        from safetensors.torch import save_file
    except ImportError as error:
        raise ConvertError(
            f"writing .safetensors needs the safetensors package: {SAFETENSORS_EXTRA} (or write a .pt file)."
        ) from error
    return save_file


def write_safetensors(opened: Opened, out: Path, *, optimizer: bool, only: Optional[set[str]] = None) -> None:
    """``only``: the names of the parameters to write (``trainable_names``)."""
    save_file = safetensors_save_file()
    keys = [
        (k[len(MODEL_KEY) + 1 :], k)
        for k in tensor_keys(opened, MODEL_KEY + ".")
        if only is None or k[len(MODEL_KEY) + 1 :] in only
    ]
    if optimizer:
        keys += [
            ("optimizer." + k[len(OPTIMIZER_KEY) + 1 :], k) for k in tensor_keys(opened, f"{OPTIMIZER_KEY}.state.")
        ]
    meta = {"format": "pt", "source": "lightning_zeroq"}
    if optimizer:
        meta["optimizer_param_groups"] = json.dumps(_param_groups(opened))
    # save_file takes every tensor at once: staged in a flat torch file and memory-mapped from there,
    # they are page cache the kernel can drop, so memory stays near one tensor as for a .pt output.
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".staged", dir=out.parent)
    os.close(fd)
    staged = Path(name)
    try:
        structure = {n: _empty(opened, k) for n, k in keys}
        _write_filled(opened, staged, structure, [(structure[n], k) for n, k in keys], fsync=False)
        del structure
        tensors = _map(staged)
        _save_safetensors(save_file, tensors, out, meta)
        del tensors
    finally:
        os.unlink(staged)
    with open(out, "rb+") as f:
        os.fsync(f.fileno())


def _save_safetensors(save_file: Any, tensors: dict, out: Path, meta: dict) -> None:
    """``save_file``, a full disk or a file-size limit said as for a torch output (safetensors reports
    them as its own error, the OS's code in its text)."""
    try:
        save_file(tensors, str(out), metadata=meta)
    except Exception as error:
        code = error.errno if isinstance(error, OSError) else None
        found = re.search(r"(?:os error |code: )(\d+)", str(error))
        code = code or (int(found.group(1)) if found else None)
        if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        data = sum(t.numel() * t.element_size() for t in tensors.values())
        raise sparse_save.no_room(OSError(code, os.strerror(code)), out, data, at_least=True) from error


TORCH_SUFFIXES = (".pt", ".pth", ".ckpt")
"""The output suffixes written as a torch file; ``.safetensors`` is the other format. Any other suffix is
refused (``.bin``, say, could be either, or neither)."""
OUTPUTS = "OUT.pt, OUT.pth or OUT.ckpt (a torch file) or OUT.safetensors"


class ConvertError(CheckpointError, ValueError):
    """What ``zeroq-convert`` prints after ``error:``: one line naming the path and what to do. A
    ``CheckpointError`` too: ``load_from_checkpoint(dir)`` reads through the same code and raises it."""


DEEPSPEED_EXPORT = (
    "{checkpoint} is a DeepSpeed checkpoint: --adapters-only and --hf read checkpoint directories "
    "ZeroQ (or torch.distributed.checkpoint) wrote; resume it with strategy='zeroq' "
    "(fit(ckpt_path=...)) and save again, or convert all its weights to one file (zeroq-convert "
    "{checkpoint} OUT.pt)."
)


def check_input(checkpoint: Path) -> None:
    """Our own words for an input that is no checkpoint directory (the loader's speak of the Trainer)."""
    located = classify(checkpoint)
    if located.is_missing:
        raise ConvertError(
            f"{checkpoint} does not exist: pass the checkpoint directory trainer.save_checkpoint() "
            "or ModelCheckpoint wrote."
        )
    if located.is_inside:
        raise ConvertError(
            f"{checkpoint} is a file inside the checkpoint directory {located.directory}: pass the directory."
        )
    if located.is_single_file:
        kind = _file_kind(checkpoint)
        if kind == "safetensors":
            raise ConvertError(
                f"{checkpoint} is a safetensors file, which is one file already: read it with "
                f"safetensors.torch.load_file({str(checkpoint)!r})."
            )
        if kind is None:
            raise ConvertError(
                f"{checkpoint} is neither a checkpoint directory (ZeroQ's, DeepSpeed's, FSDP's or another "
                "torch.distributed.checkpoint's) nor a torch or safetensors file: pass the directory "
                "trainer.save_checkpoint() wrote."
            )
        raise ConvertError(
            f"{checkpoint} is a single-file checkpoint (e.g. from strategy='ddp'), which is one file already: read "
            f"its weights with torch.load({str(checkpoint)!r}, weights_only=True)['state_dict'], or resume it with "
            "Trainer(strategy='zeroq').fit(ckpt_path=...), which reads single files too."
        )
    if located.is_deepspeed:
        raise ConvertError(DEEPSPEED_EXPORT.format(checkpoint=checkpoint))
    if not located.is_directory_checkpoint:
        raise ConvertError(
            f"{checkpoint} is a directory but no checkpoint (no zeroq.json, no .metadata): pass "
            "the directory trainer.save_checkpoint() wrote."
        )


TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
"""How a file ``torch.save`` wrote in its legacy (non-zip) format starts: pickle protocol 2 and torch's magic number."""


def _file_kind(path: Path) -> Optional[str]:
    """``"torch"`` (a zip archive, as ``torch.save`` writes, or its legacy format), ``"safetensors"`` (an
    8-byte header length, then that many bytes of JSON) or None, from the file's first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(TORCH_LEGACY_MAGIC))
            size = os.fstat(f.fileno()).st_size
            if zipfile.is_zipfile(f) or head == TORCH_LEGACY_MAGIC:
                return "torch"
            f.seek(8)
            if len(head) >= 8 and 2 <= int.from_bytes(head[:8], "little") <= size - 8 and f.read(1) == b"{":
                return "safetensors"
    except OSError:
        pass
    return None


def _output_format(out: Path, lightning: bool) -> str:
    if not out.parent.is_dir():
        raise ConvertError(f"{out}: the directory {out.parent} does not exist; create it first.")
    if out.is_dir() and not out.is_symlink():
        raise ConvertError(f"{out} is a directory: name the file to write ({OUTPUTS}).")
    if out.suffix == ".safetensors":
        if lightning:
            raise ConvertError(
                "--lightning needs a torch output, .pt, .pth or .ckpt (a Lightning checkpoint is a "
                "torch file), not .safetensors."
            )
        safetensors_save_file()  # missing: said before any work
        return "safetensors"
    if out.suffix in TORCH_SUFFIXES:
        return "torch"
    what = f"the suffix {out.suffix} names no format zeroq-convert writes" if out.suffix else "it has no suffix"
    raise ConvertError(f"{out}: {what}; the output's suffix decides its format: {OUTPUTS}.")


def left_out_frozen(opened: Opened) -> list[str]:
    """The frozen parameters a checkpoint saved with ``exclude_frozen_parameters`` left out (its manifest's record)."""
    record = opened.manifest.extra.get(FROZEN_EXCLUDED) if opened.manifest is not None else None
    return [name for name in record or [] if isinstance(name, str)]


def trainable_names(opened: Opened) -> set[str]:
    """The trainable parameters' names: those the optimizer's param groups hold (a frozen parameter is in none).
    A checkpoint without optimizer state cannot tell them: refused, with what to do."""
    if not any(key.startswith(f"{OPTIMIZER_KEY}.param_groups.") for key in opened.keys()):
        raise ConvertError(
            f"{opened.path} holds no optimizer state, whose param groups name the trainable parameters "
            "(it was saved without the optimizer): --adapters-only cannot tell them from the frozen "
            "ones; drop it to convert every weight."
        )
    names = {name for group in _param_groups(opened) for name in group.get("params", [])}
    stored = {key[len(MODEL_KEY) + 1 :] for key in tensor_keys(opened, MODEL_KEY + ".")}
    missing = sorted(names - stored)
    if missing:
        raise ConvertError(
            f"{opened.path}: the optimizer's param groups name {missing[:4]}, which its model state "
            "lacks: the checkpoint was edited or saved by another tool."
        )
    return names


def _check_optimizer(opened: Opened) -> None:
    """``--optimizer`` of a checkpoint without optimizer state would write an empty one: refused."""
    if not any(key.startswith(f"{OPTIMIZER_KEY}.") for key in opened.keys()):
        raise ConvertError(
            f"{opened.path} holds no optimizer state zeroq-convert reads (no {OPTIMIZER_KEY}.* entries: "
            "it was saved without the optimizer, or in another layout), so --optimizer cannot keep "
            "it: drop --optimizer to convert the weights."
        )


def consolidate(
    checkpoint: Path,
    out: Path,
    *,
    optimizer: bool = False,
    lightning: bool = False,
    adapters_only: bool = False,
    note: Callable[[str], None] = nothing,
) -> Path:
    """Write checkpoint directory ``checkpoint`` as one file ``out`` (``.pt``, ``.pth``, ``.ckpt`` or
    ``.safetensors``: another suffix is refused); see the module docstring. Returns ``out``. On any error
    nothing is left at ``out`` (an existing file there is kept as it was). ``adapters_only``: the trainable
    parameters alone (``trainable_names``), fp32, as a bare state dict. ``note`` hears what the output lacks (a
    checkpoint saved without its frozen parameters)."""
    checkpoint, out = Path(checkpoint), Path(out)
    if adapters_only and (optimizer or lightning):
        raise ConvertError(
            "--adapters-only writes the trainable parameters alone, as a bare state dict: drop "
            f"{' and '.join(f for f, on in (('--optimizer', optimizer), ('--lightning', lightning)) if on)}."
        )
    kind = _output_format(out, lightning)
    if deepspeed.is_deepspeed(checkpoint) and adapters_only:
        raise ConvertError(DEEPSPEED_EXPORT.format(checkpoint=checkpoint))
    if deepspeed.is_deepspeed(checkpoint):
        with atomic.new_file(out) as (fd, tmp):
            os.close(fd)
            write_deepspeed(
                deepspeed.read(checkpoint, optimizer=optimizer), tmp, kind, optimizer=optimizer, lightning=lightning
            )
        return out
    check_input(checkpoint)
    with advising("Convert an earlier checkpoint."):
        opened = open_checkpoint(checkpoint, LOCAL)
        if optimizer:
            _check_optimizer(opened)
        only = trainable_names(opened) if adapters_only else None
        left_out = left_out_frozen(opened)
        if left_out and not adapters_only:
            note(
                f"{checkpoint} was saved with exclude_frozen_parameters=True: {out.name} lacks its {len(left_out)} "
                f"frozen parameters (e.g. {left_out[:2]}); load it with strict=False into a model that holds them."
            )
        with atomic.new_file(out) as (fd, tmp):
            os.close(fd)  # the writers open it by name
            if kind == "safetensors":
                write_safetensors(opened, tmp, optimizer=optimizer, only=only)
            else:
                write_torch(opened, tmp, optimizer=optimizer, lightning=lightning, only=only)
    return out


def write_deepspeed(state: deepspeed.DeepSpeedState, out: Path, kind: str, *, optimizer: bool, lightning: bool) -> None:
    """``zeroq-convert`` of a DeepSpeed checkpoint (read whole into memory: DeepSpeed's files are one
    pickle per rank): a torch file (the weights, or with ``optimizer``/``lightning`` a Lightning
    checkpoint) or safetensors (the weights, and with ``optimizer`` each state as ``optimizer.state.<name>.<key>``).
    A tied parameter is written under each of its names: in a torch file as one tensor, in safetensors (which
    refuses tensors that share memory) as a copy."""
    if kind == "safetensors":
        tensors = {n: t.clone() if n in state.tied else t for n, t in state.params.items()}
        meta = {"format": "pt", "source": "lightning_zeroq (from DeepSpeed)"}
        if optimizer:
            tensors.update({f"optimizer.state.{n}.{k}": v for n, st in state.state.items() for k, v in st.items()})
            meta["optimizer_param_groups"] = json.dumps(
                [
                    {**{k: v for k, v in h.items() if isinstance(v, (int, float, str, bool, list, tuple))}, "params": g}
                    for h, g in zip(state.hyperparameters, state.groups)
                ]
            )
        _save_safetensors(safetensors_save_file(), tensors, out, meta)
        return
    torch.save(deepspeed.as_lightning_checkpoint(state, optimizer) if optimizer or lightning else state.params, out)


def lightning_checkpoint(checkpoint: Path, map_location: Any = None) -> dict:
    """In memory (one process): the Lightning checkpoint dict of a checkpoint directory, weights only
    (what ``LightningModule.load_from_checkpoint`` needs)."""
    with advising("Load an earlier checkpoint."):
        opened = open_checkpoint(Path(checkpoint), LOCAL)
        out = dict(opened.trainer_state())
        out.pop("zeroq", None)
        out["state_dict"] = dict(iter_named_tensors(opened, optimizer=False))
    if map_location is not None and not callable(map_location):
        out["state_dict"] = {
            k: v.to(map_location if not isinstance(map_location, dict) else "cpu") for k, v in out["state_dict"].items()
        }
    return out
