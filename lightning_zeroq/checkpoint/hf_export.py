"""A checkpoint directory as a Hugging Face model directory, LoRA factors merged into their base weights, so a
model fine-tuned under ZeroQ is served without it (``zeroq-convert CKPT OUT_DIR --hf``): no GPU, no process
group, no ``transformers`` or ``peft`` import (the names and files are theirs; the code is ours).

**Names.** Each state-dict name loses everything up to PEFT's ``base_model.model.`` (the wrapper's prefix, and
a LightningModule's attribute before it) and PEFT's ``.base_layer`` infix; ``modules_to_save.<adapter>.`` copies
take their module's name and the ``original_module.`` they replace is dropped; ``lora_A``/``lora_B`` (and
``lora_embedding_A``/``lora_embedding_B``) are merged, never written. What is left are the base model's own
names, as its ``save_pretrained`` writes them.

**Merge.** Per target module, ``W + scale * (B @ A)`` in fp32 (transposed for embeddings and for
``fan_in_fan_out``), with ``scale = lora_alpha / r`` or ``lora_alpha / sqrt(r)`` with ``use_rslora``, ``r`` and
``lora_alpha`` per module from ``rank_pattern``/``alpha_pattern`` as PEFT matches them (``LoraSettings``, from
the ``adapter_config.json`` the user passes or from flags); ``r`` must be the factors' rank. A LoRA bias
(``lora_bias``) is added to the base bias, scaled. DoRA (``lora_magnitude_vector``) and convolution factors are
refused, naming the module. Each merged weight keeps the base weight's dtype (or ``dtype``).

**Base.** A checkpoint saved with ``exclude_frozen_parameters=True`` lacks the frozen base (its manifest names
it): ``base`` (the base model's Hugging Face directory) supplies every weight the checkpoint lacks, and its
``config.json``, generation and tokenizer files are copied, so ``from_pretrained(OUT_DIR)`` works.

**Files.** ``model.safetensors``, or past ``max_shard_size`` (``save_pretrained``'s default, 50GB)
``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json`` (``metadata.total_size``,
``metadata.total_parameters``, ``weight_map``), cut as ``huggingface_hub.split_torch_state_dict_into_shards``
cuts, metadata ``{"format": "pt"}``. One shard's tensors are in memory at a time; ``progress`` gets one line
per shard written. Everything is written into a temporary directory beside ``OUT_DIR`` (created exclusively,
with an unpredictable name), each file fsynced, and renamed into place only when complete: on any error or
Ctrl-C nothing is left at ``OUT_DIR``, and the temporary directory is removed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_zeroq.checkpoint import atomic
from lightning_zeroq.checkpoint.agree import advising
from lightning_zeroq.checkpoint.checkpointer import Opened, open_checkpoint
from lightning_zeroq.checkpoint.convert import (
    ConvertError,
    check_input,
    left_out_frozen,
    read_tensor,
    safetensors_save_file,
    tensor_keys,
)
from lightning_zeroq.checkpoint.pretrained import SAFETENSORS_DTYPES
from lightning_zeroq.checkpoint.store import MODEL_KEY
from lightning_zeroq.config import SIZE_UNITS
from lightning_zeroq.nulls import nothing
from lightning_zeroq.ranks import LOCAL

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "50GB"
"""``save_pretrained``'s default (transformers 5)."""
BASE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""What is copied from the base model's directory beside the weights."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAPTER_CONFIG = "adapter_config.json"

_PEFT_PREFIX = re.compile(r"^(?:.*\.)?base_model\.model\.")
_LORA = re.compile(r"^(?P<module>.+)\.(?P<factor>lora_A|lora_B)\.(?P<adapter>[^.]+)\.(?P<leaf>weight|bias)$")
_LORA_EMBEDDING = re.compile(r"^(?P<module>.+)\.(?P<factor>lora_embedding_A|lora_embedding_B)\.(?P<adapter>[^.]+)$")
_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")
_UNSUPPORTED = {
    "lora_magnitude_vector": "DoRA (use_dora=True), whose magnitude vector is not merged",
    "lora_E": "AdaLoRA",
    "hada_w1": "LoHa",
    "lokr_w1": "LoKr",
    "ia3_l": "IA3",
}


@dataclass(frozen=True)
class LoraSettings:
    """What the merge reads of a PEFT ``LoraConfig``: ``r`` (None: the factors' rank), ``lora_alpha``,
    ``use_rslora``, ``fan_in_fan_out`` and the per-module ``rank_pattern`` / ``alpha_pattern``."""

    r: Optional[int] = None
    lora_alpha: Optional[float] = None
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    source: str = "the flags"

    @classmethod
    def from_peft_config(cls, path: Union[str, Path]) -> "LoraSettings":
        """From a PEFT ``adapter_config.json`` (or the directory holding one)."""
        path = Path(path)
        file = path / ADAPTER_CONFIG if path.is_dir() else path
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as error:
            raise ConvertError(
                f"{file} could not be read as a PEFT adapter_config.json ({error}): pass the file "
                "peft_model.save_pretrained() wrote, or --lora-alpha (and --lora-r) instead."
            ) from None
        if not isinstance(config, dict):
            raise ConvertError(f"{file} holds no JSON object: pass a PEFT adapter_config.json.")
        kind = config.get("peft_type", "LORA")
        if kind != "LORA":
            raise ConvertError(f"{file} is the config of a {kind} adapter; --hf merges LoRA adapters only.")
        if config.get("use_dora"):
            raise ConvertError(
                f"{file} has use_dora=true: DoRA's magnitude vector is not merged by --hf; merge "
                "with peft's merge_and_unload() instead."
            )
        for name in ("r", "lora_alpha"):
            value = config.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConvertError(f"{file}: {name}={value!r} must be a positive number.")
        return cls(
            r=int(config["r"]),
            lora_alpha=float(config["lora_alpha"]),
            use_rslora=bool(config.get("use_rslora", False)),
            fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
            rank_pattern=dict(config.get("rank_pattern") or {}),
            alpha_pattern=dict(config.get("alpha_pattern") or {}),
            source=str(file),
        )

    def replace(self, **changes: Any) -> "LoraSettings":
        """With the flags' values (None: keep)."""
        given = {k: v for k, v in changes.items() if v is not None}
        if not given:
            return self
        values = {**self.__dict__, **given}
        values["source"] = f"{self.source} and the flags" if self.source != "the flags" else "the flags"
        return LoraSettings(**values)

    def scale(self, module: str, rank: int) -> float:
        """The scale of ``module``'s factors (of rank ``rank``), as PEFT's ``LoraLayer.update_layer`` sets it."""
        if self.lora_alpha is None:
            raise ConvertError(
                f"the checkpoint holds LoRA factors (e.g. of {module}), whose merge needs lora_alpha: "
                "pass --peft-config adapter_config.json, or --lora-alpha (and --lora-r)."
            )
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r) if self.r is not None else rank
        if r != rank:
            raise ConvertError(
                f"{module}'s LoRA factors have rank {rank}, but {self.source} say{'s' if self.source != 'the flags' else ''} "
                f"r={r}: pass the adapter_config.json of the adapter that was trained."
            )
        alpha = float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: dict, module: str) -> str:
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of ``module``'s name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def hf_name(name: str) -> Optional[str]:
    """A state-dict name as the base model names it (None: nothing of the base model: an ``original_module``
    that ``modules_to_save`` replaces)."""
    name = _PEFT_PREFIX.sub("", name, count=1).replace(".base_layer.", ".")
    if ".original_module." in name:
        return None
    return _TO_SAVE.sub(".", name)


@dataclass
class _Lora:
    """A target module's factors (checkpoint keys) and what they merge into."""

    module: str
    a: str = ""
    b: str = ""
    b_bias: str = ""
    embedding: bool = False


@dataclass
class _Output:
    """One tensor of the output: where it comes from and its dtype and shape."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: Optional[str] = None
    """Its checkpoint key, or None: from the base directory."""
    lora: Optional[_Lora] = None
    bias_of: Optional[_Lora] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


class _Base:
    """The base model's Hugging Face directory: its tensors by name, read lazily with ``safe_open``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        if not directory.is_dir():
            raise ConvertError(
                f"--base {directory} is not a directory: pass the base model's Hugging Face directory "
                "(what save_pretrained wrote: config.json and model*.safetensors)."
            )
        index = directory / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            self.files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / SAFE_WEIGHTS_NAME).is_file():
            self.files = dict.fromkeys(self._names(directory / SAFE_WEIGHTS_NAME), directory / SAFE_WEIGHTS_NAME)
        else:
            raise ConvertError(
                f"--base {directory} holds neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}: "
                "pass the directory save_pretrained wrote (safetensors weights)."
            )
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for file in sorted(set(self.files.values())):
            with _safe_open(file) as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    self.meta[name] = (tuple(piece.get_shape()), SAFETENSORS_DTYPES[piece.get_dtype()])

    @staticmethod
    def _names(file: Path) -> list[str]:
        with _safe_open(file) as f:
            return list(f.keys())

    def read(self, name: str) -> Tensor:
        with _safe_open(self.files[name]) as f:
            return f.get_tensor(name)


def _safe_open(file: Path) -> Any:
    from safetensors import safe_open

    return safe_open(str(file), framework="pt", device="cpu")


def parse_size(size: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: an int, or a number with a unit as ``save_pretrained`` takes it (``"5GB"``,
    ``"500MB"``; ``"2GiB"`` too)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip()
    unit = next((u for u in sorted(SIZE_UNITS, key=len, reverse=True) if text.lower().endswith(u)), None)
    try:
        number = float(text[: -len(unit)] if unit else text) * (SIZE_UNITS[unit] if unit else 1)
    except ValueError:
        number = -1.0
    if not 0 < number < float("inf"):
        raise ConvertError(
            f"--max-shard-size {size!r} is not a size: use bytes or a number with a unit, e.g. 5GB, 500MB or 2GiB."
        )
    return int(number)


def _plan(opened: Opened, base: Optional[_Base], lora: LoraSettings, dtype: Optional[torch.dtype]) -> list[_Output]:
    """Every output tensor, in the checkpoint's order (then the base's), with its source."""
    keys = tensor_keys(opened, MODEL_KEY + ".")
    merges: dict[str, _Lora] = {}
    plain: dict[str, str] = {}  # output name -> checkpoint key
    adapters: set[str] = set()
    for key in keys:
        name = key[len(MODEL_KEY) + 1 :]
        unsupported = next((kind for marker, kind in _UNSUPPORTED.items() if f".{marker}." in f".{name}."), None)
        if unsupported is not None:
            raise ConvertError(f"{name} belongs to {unsupported}: --hf merges LoRA factors (lora_A, lora_B) only.")
        found = _LORA.match(name) or _LORA_EMBEDDING.match(name)
        if found is None:
            out = hf_name(name)
            if out is not None:
                plain.setdefault(out, key)
            continue
        adapters.add(found["adapter"])
        module = hf_name(found["module"] + ".x")
        assert module is not None
        entry = merges.setdefault(module[:-2], _Lora(module[:-2]))
        factor = found["factor"]
        if factor.startswith("lora_embedding"):
            entry.embedding = True
        if factor.endswith("A"):
            entry.a = key
        elif found.groupdict().get("leaf") == "bias":
            entry.b_bias = key
        else:
            entry.b = key
    if len(adapters) > 1:
        raise ConvertError(
            f"{opened.path} holds the factors of {len(adapters)} LoRA adapters ({sorted(adapters)}): "
            "--hf merges one; train (or save) one adapter per checkpoint."
        )
    lacking = [n for n in (hf_name(n) for n in left_out_frozen(opened)) if n is not None and n not in plain]
    if lacking and base is None:
        raise ConvertError(
            f"{opened.path} was saved with exclude_frozen_parameters=True: it lacks the frozen base "
            f"({len(lacking)} tensors, e.g. {lacking[:3]}); pass --base DIR, the base model's Hugging "
            "Face directory, to read them from."
        )
    missing = [n for n in lacking if n not in base.meta] if base is not None else []
    if base is not None and missing:
        raise ConvertError(
            f"{opened.path} lacks its frozen base, and --base {base.directory} lacks {len(missing)} of "
            f"those tensors too, e.g. {missing[:3]}: pass the base model the adapter was trained on."
        )
    # The checkpoint's order (the module's), then what it left out (the module's order too), then the base's rest.
    names = list(dict.fromkeys([*plain, *lacking, *(base.meta if base is not None else {})]))
    outputs = []
    for name in names:
        source = plain.get(name)
        if source is not None:
            md = opened.keys()[source]
            shape, stored = tuple(md.size), md.properties.dtype
        else:
            assert base is not None
            shape, stored = base.meta[name]
        outputs.append(
            _Output(name, shape, dtype if dtype is not None and stored.is_floating_point else stored, source)
        )
    by_name = {o.name: o for o in outputs}
    for module, entry in merges.items():
        if not (entry.a and entry.b):
            raise ConvertError(
                f"{opened.path} holds only one of {module}'s LoRA factors (A: {entry.a or 'none'}, B: "
                f"{entry.b or 'none'}): the checkpoint is incomplete."
            )
        target = by_name.get(f"{module}.weight")
        if target is None:
            fix = (
                "pass --base DIR, the base model's directory"
                if base is None
                else f"is --base {base.directory} the model the adapter was trained on?"
            )
            raise ConvertError(
                f"{module} has LoRA factors but no base weight {module}.weight to merge them into: {fix}"
            )
        a_shape, b_shape = tuple(opened.keys()[entry.a].size), tuple(opened.keys()[entry.b].size)
        if len(a_shape) != 2 or len(b_shape) != 2:
            raise ConvertError(
                f"{module}'s LoRA factors have shapes {a_shape} and {b_shape}: --hf merges the factors of "
                "linear and embedding layers only."
            )
        rank = a_shape[0]  # lora_A (and lora_embedding_A) is (r, in)
        product = (b_shape[0], a_shape[1])
        want = product[::-1] if entry.embedding or lora.fan_in_fan_out else product
        if want != target.shape:
            raise ConvertError(
                f"{module}'s LoRA factors make a {want} update, its base weight is {target.shape}"
                f"{' (fan_in_fan_out: ' + str(lora.fan_in_fan_out) + ')' if not entry.embedding else ''}."
            )
        lora.scale(module, rank)  # checked here, before anything is written
        target.lora = entry
        if entry.b_bias:
            bias = by_name.get(f"{module}.bias")
            if bias is None:
                raise ConvertError(
                    f"{module} has a LoRA bias (lora_bias=True) but no base bias {module}.bias to merge it into."
                )
            bias.bias_of = entry
    return outputs


@torch.no_grad()
def _value(opened: Opened, base: Optional[_Base], out: _Output, lora: LoraSettings) -> Tensor:
    value = read_tensor(opened, out.key) if out.key is not None else base.read(out.name)  # type: ignore[union-attr]
    entry = out.lora or out.bias_of
    if entry is not None:
        a, b = read_tensor(opened, entry.a).float(), read_tensor(opened, entry.b).float()
        scale = lora.scale(entry.module, a.shape[0])
        if out.bias_of is not None:
            value = value.float() + read_tensor(opened, entry.b_bias).float() * scale
        else:
            delta = (b @ a) * scale
            value = value.float() + (delta.t() if entry.embedding or lora.fan_in_fan_out else delta)
    return value.to(out.dtype).contiguous()


def _shards(outputs: list[_Output], max_bytes: int) -> list[list[_Output]]:
    """``huggingface_hub.split_torch_state_dict_into_shards``'s cut: in order, a new shard where the next tensor
    would pass ``max_bytes``, a tensor larger than that alone."""
    shards: list[list[_Output]] = []
    current: list[_Output] = []
    size = 0
    for out in outputs:
        if out.nbytes > max_bytes:
            shards.append([out])
            continue
        if size + out.nbytes > max_bytes and current:
            shards.append(current)
            current, size = [], 0
        current.append(out)
        size += out.nbytes
    if current:
        shards.append(current)
    return shards


def _write_json(path: Path, value: Any) -> None:
    with open(path, "x", encoding="utf-8") as f:
        f.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _check_output(out: Path) -> None:
    if not out.parent.is_dir():
        raise ConvertError(f"{out}: the directory {out.parent} does not exist; create it first.")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConvertError(f"{out} exists and is no directory: --hf writes a directory; name a new one.")
    if out.is_dir() and any(out.iterdir()):
        raise ConvertError(
            f"{out} is a directory that is not empty: --hf writes a whole model directory; name a new "
            "(or empty) one, so nothing of another model is mixed in or removed."
        )


def export_hf(
    checkpoint: Union[str, Path],
    out: Union[str, Path],
    *,
    lora: Optional[LoraSettings] = None,
    base: Union[str, Path, None] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    dtype: Optional[str] = None,
    progress: Callable[[str], None] = nothing,
) -> Path:
    """Write checkpoint directory ``checkpoint`` as the Hugging Face model directory ``out`` (see the module
    docstring); returns ``out``. ``dtype``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` for every floating tensor (None:
    each keeps its stored dtype, a merged weight its base's)."""
    checkpoint, out = Path(checkpoint), Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}.")
    cast = DTYPES[dtype] if dtype is not None else None
    max_bytes = parse_size(max_shard_size)
    _check_output(out)
    check_input(checkpoint)
    with advising("Convert an earlier checkpoint."):
        opened = open_checkpoint(checkpoint, LOCAL)
        try:
            home = _Base(Path(base)) if base is not None else None
            settings = lora or LoraSettings()
            outputs = _plan(opened, home, settings, cast)
            _write_directory(opened, home, settings, outputs, out, max_bytes, cast, progress)
        finally:
            opened.close()
    return out


def _write_directory(
    opened: Opened,
    base: Optional[_Base],
    lora: LoraSettings,
    outputs: list[_Output],
    out: Path,
    max_bytes: int,
    cast: Optional[torch.dtype],
    progress: Callable[[str], None],
) -> None:
    save_file = safetensors_save_file()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".zeroq-tmp", dir=out.parent))
    try:
        shards = _shards(outputs, max_bytes)
        count = len(shards)
        names = (
            [SAFE_WEIGHTS_NAME]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        for i, (file, shard) in enumerate(zip(names, shards)):
            tensors = {o.name: _value(opened, base, o, lora) for o in shard}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            _fsync(tmp / file)
            size = sum(o.nbytes for o in shard)
            del tensors
            progress(f"wrote {file} ({len(shard)} tensors, {size / 2**20:.1f} MiB) [{i + 1}/{count}]")
        if count > 1:
            _write_json(
                tmp / SAFE_WEIGHTS_INDEX_NAME,
                {
                    "metadata": {
                        "total_size": sum(o.nbytes for o in outputs),
                        "total_parameters": sum(math.prod(o.shape) for o in outputs),
                    },
                    "weight_map": {o.name: file for file, shard in zip(names, shards) for o in shard},
                },
            )
        for name in BASE_FILES if base is not None else ():
            source = base.directory / name  # type: ignore[union-attr]
            if source.is_file():
                if name == "config.json" and cast is not None:
                    config = json.loads(source.read_text())
                    for key in ("dtype", "torch_dtype"):
                        if key in config:
                            config[key] = str(cast).removeprefix("torch.")
                    _write_json(tmp / name, config)
                else:
                    shutil.copyfile(source, tmp / name)
                    _fsync(tmp / name)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
        atomic.fsync_dir(tmp)
        os.rename(tmp, out)  # replaces an empty directory there (checked), atomically
        atomic.fsync_dir(out.parent)
    except BaseException:
        atomic.remove(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
