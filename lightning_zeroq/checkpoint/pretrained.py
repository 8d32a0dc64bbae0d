"""Pretrained weights into a built engine, each rank reading only its own part of them.

``load_pretrained(engine, module, path)`` (collective; ``lightning_zeroq.load_pretrained`` finds the engine)
reads one of:

- a Hugging Face safetensors checkpoint: ``model.safetensors``, or a sharded one through its
  ``model.safetensors.index.json`` (a directory holding either, or the file itself). ``safetensors.safe_open``
  validates each file and gives each tensor's shape and dtype; the rank's flat range of a tensor is cut into
  rectangular boxes (``boxes.flat_range_boxes``: a partial row at each end, the whole rows between), each one
  contiguous in the file, and each box's bytes are read (``os.preadv``) into one reused buffer and copied into
  the shard: exactly the rank's elements leave the file, one box at a time, and no page of the file is mapped
  into the process;
- a ``torch.save`` state dict (LitGPT's ``lit_model.pth``, ``pytorch_model.bin``; at the top level or under
  ``"model"`` / ``"state_dict"``), loaded with ``torch.load(mmap=True, weights_only=True)``: each box is a
  view of the mapped file, copied straight into the shard (only its pages are read), and a tensor's pages are
  dropped from the mapping once it is read;
- a ``torch.distributed.checkpoint`` directory (ZeroQ's, FSDP2's, or ``dcp.save`` of a full state dict),
  read as every DCP checkpoint here is (``checkpointer.open_checkpoint``, ``safe.read_entries``): the stored
  items that hold the rank's range are read whole, one at a time (a checkpoint saved by one process holds
  each tensor as one item).

Where it goes: the engine's sharded view (``zero/state_dict.py``), as ``engine_io.load_sharded`` walks it:
every trainable parameter's range into its fp32 master shard, stage 3's frozen parameters' ranges into their
shards (in their own dtype), and the entries every rank holds whole (buffers, frozen parameters no unit
shards) into the module; then the engine publishes the working weights. Optimizer state is not touched.

Names: ``name_map`` turns each of the model's names (relative to ``module``) into the checkpoint's key: a
dict of prefixes (``{"base_model.model.": ""}``; the longest that matches is replaced), a function, or
``"peft"`` (``peft_name_map``). ``allow_missing`` (the model's names that may be absent: leave them as they
are) and ``allow_unexpected`` (checkpoint keys the model may lack: ignore them) take glob patterns, a function
of the name, or, for ``allow_missing``, ``"adapters"``: the parameters of PEFT's tuner layers (LoRA's
``lora_A``/``lora_B``, ...), found on the module itself.

Validated on every rank before any weight changes, then agreed (``agree.agree_once``: every rank raises the
same ``CheckpointError``, one line per problem): the path and its files (a missing shard, a truncated or
damaged file), missing and unexpected keys, shapes, and dtypes (a floating tensor for a floating entry, and
the same dtype for any other). Rank 0 logs its progress (logger ``lightning_zeroq``, INFO) every
``progress_bytes`` it reads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_zeroq.checkpoint.agree import CheckpointError, agree_once, checkpoint_group, describe
from lightning_zeroq.checkpoint.checkpointer import Opened, open_checkpoint
from lightning_zeroq.checkpoint.chunks import LocalChunks
from lightning_zeroq.checkpoint.engine_io import MODEL_PREFIXES, load_sharded
from lightning_zeroq.checkpoint.safe import METADATA_FILE, read_entries
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero.state_dict import ShardedParts, ShardedView

log = logging.getLogger("lightning_zeroq")

NameMap = Union[None, str, Mapping[str, str], Callable[[str], str]]
"""``None`` (the model's names are the checkpoint's), a dict of prefixes, a function, or ``"peft"``."""
Allowance = Union[None, str, Sequence[str], Callable[[str], bool]]
"""``None`` (nothing), a glob pattern or several, ``"adapters"`` (``allow_missing`` only), or a function."""

ADAPTERS = "adapters"
PEFT = "peft"
PROGRESS_BYTES = 1 << 30
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    **{
        name: getattr(torch, attr)
        for name, attr in (
            ("U16", "uint16"),
            ("U32", "uint32"),
            ("U64", "uint64"),
            ("F8_E4M3", "float8_e4m3fn"),
            ("F8_E5M2", "float8_e5m2"),
        )
        if hasattr(torch, attr)
    },
}
TORCH_FILES = ("lit_model.pth", "pytorch_model.bin", "model.pth", "model.pt")
"""Torch state dict files a directory may hold, in the order they are looked for."""
WHAT_IT_READS = (
    "a Hugging Face checkpoint (model.safetensors, or model.safetensors.index.json and its shards, "
    "or a directory holding them), a torch.save state dict (lit_model.pth, pytorch_model.bin) or a "
    "torch.distributed.checkpoint directory"
)

_PEFT_ROOT = re.compile(r"^(?:.*?\.)?base_model\.model\.")
_PEFT_WRAPPERS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def peft_name_map(name: str) -> str:
    """A PEFT model's parameter name as the plain model's checkpoint has it: everything up to PEFT's
    ``base_model.model.`` dropped (also where the PEFT model sits inside another module), a tuner layer's
    ``.base_layer`` and ``modules_to_save``'s ``.original_module`` / ``.modules_to_save.<adapter>`` taken out:
    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``. Adapter parameters map to names a base checkpoint lacks:
    allow them with ``allow_missing="adapters"``."""
    return _PEFT_WRAPPERS.sub("", _PEFT_ROOT.sub("", name, count=1))


# ---------------------------------------------------------------------- the arguments


def name_mapper(name_map: NameMap, where: str) -> Callable[[str], str]:
    """``name_map`` as a function (``where`` names the argument in the error, e.g. ``load_pretrained(name_map=...)``)."""
    if name_map is None:
        return lambda name: name
    if isinstance(name_map, str):
        if name_map == PEFT:
            return peft_name_map
        raise ValueError(
            f"{where}: {name_map!r} is no name map; pass {PEFT!r} (PEFT's names), a dict of prefixes "
            "such as {'base_model.model.': ''}, or a function from the model's name to the checkpoint's."
        )
    if isinstance(name_map, Mapping):
        bad = [(k, v) for k, v in name_map.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(
                f"{where}: {bad[0][0]!r}: {bad[0][1]!r} is not a pair of strings; a dict maps prefixes of "
                "the model's names to prefixes of the checkpoint's, e.g. {'base_model.model.': ''}."
            )
        prefixes = sorted(name_map.items(), key=lambda kv: -len(kv[0]))

        def by_prefix(name: str) -> str:
            for prefix, replacement in prefixes:
                if name.startswith(prefix):
                    return replacement + name[len(prefix) :]
            return name

        return by_prefix
    if callable(name_map):
        return name_map
    raise ValueError(
        f"{where}: a {type(name_map).__name__} is no name map; pass {PEFT!r}, a dict of prefixes such "
        "as {'base_model.model.': ''}, or a function from the model's name to the checkpoint's."
    )


def check_allowance(value: Allowance, where: str, adapters: bool) -> None:
    """The type of an ``allow_missing`` / ``allow_unexpected`` value (``adapters``: ``"adapters"`` is allowed)."""
    if value is None or callable(value):
        return
    items = [value] if isinstance(value, str) else value
    if isinstance(items, (list, tuple, set, frozenset)) and all(isinstance(i, str) for i in items):
        if ADAPTERS in items and not adapters:
            raise ValueError(
                f"{where}: {ADAPTERS!r} names the model's adapter parameters, which are never "
                "unexpected; pass glob patterns of checkpoint keys, e.g. ['*.rotary_emb.inv_freq']."
            )
        return
    raise ValueError(
        f"{where}: {value!r} is neither glob patterns (a string or a list of them) nor a function of "
        "the name; pass e.g. ['*.lora_A.*', '*.lora_B.*']" + (f" or {ADAPTERS!r}." if adapters else ".")
    )


def allowance(value: Allowance, where: str, module: Optional[nn.Module]) -> Callable[[str], bool]:
    """``value`` as a predicate on names (``module``: where ``"adapters"`` are looked up, names relative to it)."""
    check_allowance(value, where, adapters=module is not None)
    if value is None:
        return lambda name: False
    if callable(value) and not isinstance(value, str):
        return value
    items = [value] if isinstance(value, str) else list(value)
    named = adapter_names(module) if module is not None and ADAPTERS in items else set()
    patterns = [i for i in items if i != ADAPTERS]
    return lambda name: name in named or any(fnmatchcase(name, p) for p in patterns)


def adapter_names(module: nn.Module) -> set[str]:
    """The names (relative to ``module``) of the parameters of PEFT's tuner layers' adapters: every module that
    lists its adapter attributes (``adapter_layer_names``: LoRA's ``lora_A``, ``lora_B``, ...) says which."""
    out: set[str] = set()
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr in getattr(owner, "adapter_layer_names", ()) or ():
            child = getattr(owner, attr, None)
            base = f"{prefix}.{attr}" if prefix else attr
            if isinstance(child, nn.Module):
                out.update(f"{base}.{n}" for n, _ in child.named_parameters(remove_duplicate=False))
            elif isinstance(child, nn.Parameter):
                out.add(base)
    return out


def check_path(path: Any, where: str) -> Path:
    """``path`` as a local path that exists (one line naming it otherwise)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{where}: {path!r} is not a path; pass the path of {WHAT_IT_READS}.")
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text) and not text.startswith("file://"):
        raise ValueError(
            f"{where}: {text!r} names a remote file system; download the checkpoint to a local or "
            "mounted path (every rank reads its own part of the files there)."
        )
    local = Path(text.removeprefix("file://")).expanduser()
    if not local.exists():
        raise ValueError(f"{where}: {text} does not exist; pass the path of {WHAT_IT_READS}.")
    return local.absolute()


# ---------------------------------------------------------------------- the sources


@dataclass(frozen=True)
class Stored:
    """A tensor in the checkpoint."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str = ""


@dataclass
class Tally:
    """The bytes a rank reads from the checkpoint's files, and rank 0's progress lines."""

    what: str
    every: int
    rank: int
    share: int = 0
    """The bytes of this rank's part (its ranges and the entries it holds whole), in the checkpoint's dtypes."""
    read: int = 0
    largest: int = 0
    start: float = field(default_factory=time.perf_counter)
    _next: int = 0

    def add(self, nbytes: int) -> None:
        self.read += nbytes
        self.largest = max(self.largest, nbytes)
        if self.rank == 0 and self.read >= self._next:
            if self._next:
                log.info(
                    "%s: rank 0 has read %s (its part of the weights: %s) in %.0f s",
                    self.what,
                    size(self.read),
                    size(self.share),
                    time.perf_counter() - self.start,
                )
            self._next = (self.read // self.every + 1) * self.every


def size(nbytes: int) -> str:
    """``nbytes`` for a log line: GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


class Source:
    """An opened checkpoint: its tensors by key (``entries``), what is wrong with its files (``problems``),
    and ``read``: pairs of (key, ``LocalChunks`` with a target, or a whole tensor to fill)."""

    kind: str = ""
    files: int = 1

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Stored] = {}
        self.problems: list[str] = []

    def read(self, pairs: list[tuple[str, Any]], tally: Tally) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _first_line(error: BaseException) -> str:
    """An error's type and first sentence, for a one-line message."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    first = text.splitlines()[0].split(". ")[0].rstrip(".")
    return f"{type(error).__name__}: {first[:200]}"


def _box_slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


class SafetensorsSource(Source):
    """One ``.safetensors`` file, or the files a ``.safetensors.index.json`` names. ``safetensors.safe_open``
    validates each file (its header, and that the data covers the file exactly: a truncated file is refused)
    and gives each tensor's shape and dtype; the data is then read with ``os.preadv``, each box's bytes straight
    from the file into one buffer reused for a batch (as large as its largest box) and copied into its target.
    No file is memory-mapped while its tensors are read: a mapped page counts in the process's resident set until
    the file is closed, so reading through ``get_slice`` (a mapping held for the load) adds the rank's whole share
    again, in file pages, to the masters it fills (``benchmarks/checkpoints.py pretrained-rss``: 270 MiB for a
    share of 258.5 MiB)."""

    kind = "safetensors"

    def __init__(self, path: Path, index: bool) -> None:
        super().__init__(path)
        self.directory = path.parent
        self.fds: dict[str, int] = {}
        self.offsets: dict[str, int] = {}
        """Each tensor's first byte in its file."""
        self._bytes = bytearray()
        self._buffer = torch.empty(0, dtype=torch.uint8)
        """The reused buffer each box is read into (``_bytes`` as a tensor)."""
        try:
            from safetensors import safe_open
        except ImportError:
            self.problems.append(
                f"{path} is a safetensors checkpoint, and the safetensors package is not installed: "
                "pip install safetensors."
            )
            return
        placed: Optional[dict[str, str]] = None  # key -> file, as the index says
        if index:
            placed = self._read_index(path)
            if placed is None:
                return
            names = sorted(set(placed.values()))
        else:
            names = [path.name]
        absent = [n for n in names if not (self.directory / n).is_file()]
        if absent:
            self.problems.append(
                f"{path.name} names {len(absent)} file(s) that are not in {self.directory}: {', '.join(absent[:4])}"
                f"{' ...' if len(absent) > 4 else ''}; the checkpoint is incomplete: download "
                f"{'it' if len(absent) == 1 else 'them'} again."
            )
            return
        self.files = len(names)
        held: dict[str, set[str]] = {}
        for name in names:
            file = self.directory / name
            try:
                with safe_open(str(file), framework="pt") as handle:  # validates the header and the file's length
                    parts = {k: handle.get_slice(k) for k in handle.keys()}
                    described = {k: (p.get_dtype(), tuple(p.get_shape())) for k, p in parts.items()}
                    del parts
                start, begins = _data_offsets(file)
                self.fds[name] = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except Exception as error:
                self.problems.append(
                    f"{file} cannot be read ({_first_line(error)}): the file is truncated or damaged; "
                    "download it again."
                )
                continue
            held[name] = set(described)
            for key, (kind, shape) in described.items():
                if placed is not None and placed.get(key) != name:
                    continue  # the index places it elsewhere (or nowhere): the index decides, as transformers' loader
                dtype = SAFETENSORS_DTYPES.get(kind)
                if dtype is None:
                    self.problems.append(
                        f"{file}: {key!r} has dtype {kind}, which this torch cannot hold; convert the "
                        "checkpoint to a dtype it has."
                    )
                    continue
                self.entries[key] = Stored(shape, dtype, name)
                self.offsets[key] = start + begins[key]
        if placed is not None and not self.problems:
            lost = [(k, f) for k, f in placed.items() if k not in held.get(f, ())]
            if lost:
                self.problems.append(
                    f"{path.name} places {len(lost)} tensor(s) in files that do not hold them: "
                    f"{lost[0][0]!r} in {lost[0][1]}{' ...' if len(lost) > 1 else ''}; the "
                    "checkpoint is incomplete or mixed from two: download it again."
                )

    def _read_index(self, path: Path) -> Optional[dict[str, str]]:
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            self.problems.append(
                f"{path} cannot be read ({_first_line(error)}): the file is truncated or damaged; download it again."
            )
            return None
        placed = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(placed, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in placed.items()
        ):
            self.problems.append(
                f"{path} has no weight_map of tensor names to files: it is no safetensors index; "
                "pass the checkpoint's directory or its model.safetensors.index.json."
            )
            return None
        outside = sorted({f for f in placed.values() if not f or "/" in f or "\\" in f or f in (".", "..")})
        if outside:
            self.problems.append(
                f"{path} names the file {outside[0]!r}, which is not a file beside it; the index is "
                "damaged: download it again."
            )
            return None
        return placed

    def _pread(self, key: str, first: int, numel: int, tally: Tally) -> Tensor:
        """Elements ``[first, first + numel)`` of ``key`` (flat), in the reused buffer (valid until the next read)."""
        stored = self.entries[key]
        size = stored.dtype.itemsize
        nbytes, offset = numel * size, self.offsets[key] + first * size
        if len(self._bytes) < nbytes:
            self._bytes = bytearray(nbytes)
            self._buffer = torch.frombuffer(self._bytes, dtype=torch.uint8)
        view, got = memoryview(self._bytes)[:nbytes], 0
        while got < nbytes:
            n = os.preadv(self.fds[stored.file], [view[got:]], offset + got)
            if n <= 0:
                raise OSError(
                    f"{self.directory / stored.file} ends inside {key!r}: it was truncated during the load; "
                    "download it again"
                )
            got += n
        tally.add(nbytes)
        return self._buffer[:nbytes].view(stored.dtype)

    def read(self, pairs: list[tuple[str, Any]], tally: Tally) -> None:
        try:
            for key, target in sorted(pairs, key=lambda p: (self.entries[p[0]].file, self.offsets[p[0]])):
                if isinstance(target, LocalChunks):
                    assert target.target is not None  # a loading target
                    for i, box in enumerate(target.boxes):  # contiguous in the file: one read each
                        target.box_view(target.target, i).copy_(
                            self._pread(key, box.flat_start, box.numel, tally).view(box.sizes)
                        )
                else:
                    target.copy_(self._pread(key, 0, target.numel(), tally).view(target.shape))
        finally:  # freed before the engine publishes what was read (stage 3 gathers a unit at a time then)
            self._bytes, self._buffer = bytearray(), torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        fds, self.fds = list(self.fds.values()), {}
        for fd in fds:
            os.close(fd)
        self._bytes, self._buffer = bytearray(), torch.empty(0, dtype=torch.uint8)


def _data_offsets(file: Path) -> tuple[int, dict[str, int]]:
    """Where a safetensors file's data starts, and each tensor's first byte after it (its header, after
    ``safe_open`` validated it)."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return 8 + length, {k: int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}


class _Mapped:
    """Drops pages of a memory-mapped file from this process once read (Linux: ``madvise(MADV_DONTNEED)``, only
    inside the address ranges ``/proc/self/maps`` shows the file at), so the pages a load touched, and the large
    folios the kernel maps around them, do not pile up in its resident set. The file is never written through
    the mapping: a dropped page is read from the file again if touched again. Elsewhere: nothing."""

    MADV_DONTNEED = 4

    def __init__(self, path: Path) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.madvise: Any = None
        self.page = 4096
        if not os.path.exists("/proc/self/maps"):
            return
        try:
            import ctypes

            info = os.stat(path)
            device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}"
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split()
                    if len(fields) >= 6 and fields[3] == device and fields[4] == str(info.st_ino):
                        low, high = (int(a, 16) for a in fields[0].split("-"))
                        self.ranges.append((low, high))
            self.page = os.sysconf("SC_PAGE_SIZE")
            self.madvise = ctypes.CDLL(None, use_errno=True).madvise
            self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError, ValueError):
            self.ranges = []

    def drop(self, tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        page = self.page
        low = -(-storage.data_ptr() // page) * page
        high = (storage.data_ptr() + storage.nbytes()) // page * page
        if high > low and any(a <= low and high <= b for a, b in self.ranges):
            self.madvise(low, high - low, self.MADV_DONTNEED)


class TorchFileSource(Source):
    """A ``torch.save`` state dict, memory-mapped (``torch.load(mmap=True, weights_only=True)``): each box is a
    view of the mapped file copied into its target (only its pages are read); a tensor's pages are dropped from
    the mapping once it is read (``_Mapped``)."""

    kind = "torch"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.state: dict[str, Tensor] = {}
        try:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as error:
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
            with open(path, "rb") as f:
                head = f.read(4)
            found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
            if "mmap" in text and head[:1] == b"\x80":  # a pickle, not a zip: torch.save's format before 1.6
                self.problems.append(
                    f"{path} was saved in torch's legacy format, which cannot be memory-mapped; "
                    "load it once and save it again with torch.save (or convert it to safetensors)."
                )
            elif head[:2] != b"PK":
                self.problems.append(
                    f"{path} is no torch.save file (it starts with neither a zip nor a pickle "
                    f"header); pass {WHAT_IT_READS}."
                )
            elif found or "Weights only load failed" in text:
                held = f" ({found.group(1)})" if found else ""
                self.problems.append(
                    f"{path} holds objects other than tensors and plain values{held}, which are not "
                    "loaded (that could run code); save its state dict alone "
                    "(torch.save(model.state_dict(), path))."
                )
            else:
                self.problems.append(
                    f"{path} cannot be read ({_first_line(error)}): the file is truncated or damaged, "
                    "or no torch.save file; save or download it again."
                )
            return
        for key in ("model", "state_dict"):  # LitGPT's and Lightning's training checkpoints nest the weights
            if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
                loaded = loaded[key]
                break
        if not isinstance(loaded, dict):
            self.problems.append(
                f"{path} holds a {type(loaded).__name__}, not a state dict (names to tensors); save "
                "model.state_dict() with torch.save."
            )
            return
        self.state = {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, Tensor)}
        self.entries = {k: Stored(tuple(v.shape), v.dtype, path.name) for k, v in self.state.items()}
        self.mapped = _Mapped(path)

    def read(self, pairs: list[tuple[str, Any]], tally: Tally) -> None:
        for key, target in pairs:
            value = self.state[key]
            if isinstance(target, LocalChunks):
                assert target.target is not None  # a loading target
                for i, box in enumerate(target.boxes):
                    part = value[_box_slices(box)]  # a view of the mapped file: only its pages are read
                    tally.add(part.numel() * part.element_size())
                    target.box_view(target.target, i).copy_(part)
            else:
                tally.add(value.numel() * value.element_size())
                target.copy_(value)
            self.mapped.drop(value)

    def close(self) -> None:
        self.state = {}


class _CountedFiles:
    """A checkpoint's ``Files`` whose reads are counted (the bytes a DCP load takes from the disk)."""

    def __init__(self, files: Any, tally: Callable[[int], None]) -> None:
        self._files, self._tally = files, tally

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        n = self._files.read_into(name, offset, buffer)
        self._tally(n)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._files, name)


class DcpSource(Source):
    """A ``torch.distributed.checkpoint`` directory, opened and read as every DCP checkpoint here is: its
    model entries under the prefix that holds the most of the model's keys (ZeroQ's ``state_dict.``,
    FSDP2's ``model.``, or none)."""

    kind = "dcp"

    def __init__(self, opened: Opened, probe: Iterable[str]) -> None:
        super().__init__(opened.path)
        self.opened = opened
        keys = opened.keys()
        probe = list(probe)
        hits = [sum(p + k in keys for k in probe) for p in MODEL_PREFIXES]
        self.prefix = MODEL_PREFIXES[max(range(len(hits)), key=lambda i: (hits[i], -i))]
        self.entries = {
            k[len(self.prefix) :]: Stored(tuple(int(s) for s in md.size), md.properties.dtype)
            for k, md in keys.items()
            if k.startswith(self.prefix) and isinstance(md, TensorStorageMetadata)
        }
        self.files = len({info.relative_path for info in opened.metadata.storage_data.values()})
        self._tally: Optional[Tally] = None
        opened.reader.files = _CountedFiles(opened.reader.files, self._count)

    def _count(self, nbytes: int) -> None:
        if self._tally is not None:
            self._tally.add(nbytes)

    def read(self, pairs: list[tuple[str, Any]], tally: Tally) -> None:
        self._tally = tally
        try:
            for key, target in pairs:  # one tensor at a time: the reader holds one stored item at a time
                read_entries(self.opened.reader, {self.prefix + key: target})
        finally:
            self._tally = None
            self.opened.reader.release()  # its item buffer, before the engine publishes what was read

    def close(self) -> None:
        self.opened.close()


def locate(path: Path) -> tuple[str, Path]:
    """(kind, the file or directory to open) for ``path``: ``ValueError`` naming it where it holds nothing
    this reads."""
    if path.is_dir():
        if (path / METADATA_FILE).is_file():
            return "dcp", path
        for name in ("model.safetensors.index.json", "model.safetensors"):
            if (path / name).is_file():
                return "safetensors_index" if name.endswith(".json") else "safetensors", path / name
        for pattern in ("*.safetensors.index.json", "*.safetensors"):
            found = sorted(path.glob(pattern))
            if len(found) == 1:
                return "safetensors_index" if pattern.endswith(".json") else "safetensors", found[0]
            if len(found) > 1 and pattern.endswith(".json"):
                raise ValueError(
                    f"{path} holds {len(found)} safetensors indexes ({', '.join(p.name for p in found[:3])}); "
                    "pass the one to load."
                )
        for name in TORCH_FILES:
            if (path / name).is_file():
                return "torch", path / name
        raise ValueError(f"{path} holds no checkpoint this reads; pass {WHAT_IT_READS}.")
    if path.name == METADATA_FILE:
        raise ValueError(
            f"{path} is a file inside a torch.distributed.checkpoint directory; pass the directory {path.parent}."
        )
    if path.name.endswith(".safetensors.index.json"):
        return "safetensors_index", path
    if path.name.endswith(".safetensors"):
        return "safetensors", path
    return "torch", path


# ---------------------------------------------------------------------- what the model holds


@dataclass
class Wanted:
    """One tensor of the model: its names (relative to the engine's module, then to ``module``), shape and dtype."""

    names: list[str]
    relative: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel_here: int
    """The elements this rank reads of it (its range, or all of a tensor it holds whole)."""


def _storage_key(tensor: Tensor) -> Any:
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return id(tensor)
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _whole(state: dict[str, Any]) -> list[tuple[list[str], Tensor]]:
    """A state dict's tensors, the names of each (tied entries share one tensor) together."""
    groups: dict[Any, tuple[list[str], Tensor]] = {}
    for name, value in state.items():
        if isinstance(value, Tensor):
            groups.setdefault(_storage_key(value), ([], value))[0].append(name)
    return list(groups.values())


def _scope(root: nn.Module, module: nn.Module) -> str:
    if module is root:
        return ""
    for name, child in root.named_modules(remove_duplicate=False):
        if child is module:
            return name + "."
    raise ValueError(
        f"the module ({type(module).__name__}) is not a submodule of the module its engine shards "
        f"({type(root).__name__}); pass that module, or the engine."
    )


def _in_scope(names: Sequence[str], prefix: str) -> tuple[list[str], list[str]]:
    kept = [n for n in names if n.startswith(prefix)]
    return kept, [n[len(prefix) :] for n in kept]


def model_tensors(view: Optional[ShardedView], module: nn.Module) -> tuple[list[Wanted], dict[str, Tensor]]:
    """What ``module`` needs (in the engine's view, or the module alone), and the whole tensors a load writes
    in place (by name: buffers, frozen parameters every rank holds, or all of a module without an engine)."""
    wanted: list[Wanted] = []
    if view is None:
        whole = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, Tensor)}
        prefix = ""
    else:
        whole = {k: v for k, v in view.unmanaged().items() if isinstance(v, Tensor)}
        prefix = _scope(view.module, module)
        for pv in view.params:
            names, relative = _in_scope(pv.names, prefix)
            if names:
                here = pv.part.numel if pv.part is not None else 0
                dtype = pv.part.dtype if pv.part is not None else torch.float32
                wanted.append(Wanted(names, relative, tuple(pv.shape), dtype, here))
    for names, tensor in _whole(whole):
        names, relative = _in_scope(names, prefix)
        if names:
            wanted.append(Wanted(names, relative, tuple(tensor.shape), tensor.dtype, tensor.numel()))
    return wanted, whole


# ---------------------------------------------------------------------- matching names, shapes and dtypes


@dataclass
class Plan:
    keys: dict[str, str] = field(default_factory=dict)
    """The engine module's name -> the checkpoint key it reads (names whose key is there)."""
    missing: list[str] = field(default_factory=list)
    """Allowed to be missing: left as they are."""
    unexpected: list[str] = field(default_factory=list)
    """Allowed to be unexpected: not read."""
    share: int = 0
    errors: list[str] = field(default_factory=list)


def _listed(items: Sequence[str], limit: int = 4) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _missing_hint(name: str, key: str, entries: Mapping[str, Stored]) -> str:
    if ".base_layer." in key or _PEFT_ROOT.match(key):
        return 'this is a PEFT model: map its names with name_map="peft" (lightning_zeroq.peft_name_map)'
    if re.search(r"\.lora_", name):
        return 'adapters are not in a base checkpoint: leave them as they are with allow_missing="adapters"'
    for stored in entries:
        if key.endswith("." + stored):
            return f"the checkpoint has {stored!r}: name_map={{{key[: len(key) - len(stored)]!r}: ''}} may be the map"
        if stored.endswith("." + key):
            return (
                f"the checkpoint has {stored!r}: name_map={{'': {stored[: len(stored) - len(key)]!r}}} may be the map"
            )
    return "map the model's names to the checkpoint's with name_map=..., or leave them as they are with allow_missing=[...]"


def match(
    wanted: list[Wanted],
    entries: Mapping[str, Stored],
    mapper: Callable[[str], str],
    missing_ok: Callable[[str], bool],
    unexpected_ok: Callable[[str], bool],
) -> Plan:
    """Every tensor of the model against the checkpoint: which key each reads, and what is wrong (one line each)."""
    plan = Plan()
    mapped: set[str] = set()
    missing: list[tuple[str, str]] = []
    shapes: list[str] = []
    for w in wanted:
        keys = []
        for rel in w.relative:
            key = mapper(rel)
            if not isinstance(key, str):
                plan.errors.append(
                    f"name_map returned {key!r} for {rel!r}; it must return the checkpoint's key (a str)."
                )
                return plan
            keys.append(key)
        mapped.update(keys)
        present = [(n, k) for n, k in zip(w.names, keys) if k in entries]
        if not present:
            if any(missing_ok(rel) for rel in w.relative):
                plan.missing.append(w.relative[0])
            else:
                missing.append((w.relative[0], keys[0]))
            continue
        key = present[0][1]
        stored = entries[key]
        if stored.shape != w.shape:
            shapes.append(
                f"{w.relative[0]!r} has shape {w.shape} in the model but {stored.shape} in the checkpoint"
                + (f" (as {key!r})" if key != w.relative[0] else "")
                + ": the checkpoint is another configuration's; build the model from the checkpoint's config."
            )
            continue
        if stored.dtype.is_floating_point != w.dtype.is_floating_point or (
            not w.dtype.is_floating_point and stored.dtype != w.dtype
        ):
            plan.errors.append(
                f"{key!r} is {stored.dtype} in the checkpoint, the model's {w.relative[0]!r} is "
                f"{w.dtype}: it cannot hold those values; check name_map (is it another tensor?)."
            )
            continue
        for name, k in present:
            plan.keys[name] = k
        plan.share += w.numel_here * stored.dtype.itemsize
    if missing:
        first, key = missing[0]
        named = [f"{m!r}" + (f" (as {k!r})" if k != m else "") for m, k in missing]
        plan.errors.insert(
            0,
            f"{len(missing)} tensor(s) of the model are not in the checkpoint: {_listed(named)}; "
            f"{_missing_hint(first, key, entries)}.",
        )
    plan.errors += shapes[:5] + ([f"... and {len(shapes) - 5} more of another shape"] if len(shapes) > 5 else [])
    extra = [k for k in entries if k not in mapped]
    plan.unexpected = [k for k in extra if unexpected_ok(k)]
    refused = [k for k in extra if not unexpected_ok(k)]
    if refused:
        plan.errors.append(
            f"the checkpoint holds {len(refused)} tensor(s) the model lacks: "
            f"{_listed([repr(k) for k in refused])}; check name_map, or ignore them with "
            "allow_unexpected=[...] (glob patterns)."
        )
    return plan


# ---------------------------------------------------------------------- the load


@dataclass
class PretrainedReport:
    """What ``load_pretrained`` did on this rank."""

    path: Path
    kind: str
    """``"safetensors"``, ``"torch"`` or ``"dcp"``."""
    loaded: int
    """The model's tensors read (each tied tensor once)."""
    missing: list[str]
    """The model's tensors left as they were (``allow_missing``), by name relative to the module."""
    unexpected: list[str]
    """Checkpoint keys not read (``allow_unexpected``)."""
    share_bytes: int
    """This rank's part of the weights in the checkpoint's dtypes: its ranges of the sharded tensors and the
    tensors it holds whole."""
    bytes_read: int
    """The bytes this rank read from the files (safetensors and torch files: exactly ``share_bytes``; DCP: the
    stored items that hold its ranges, whole)."""
    largest_read: int
    """The largest single read: one box of a tensor (safetensors), a view of the mapped file (torch), a read of a
    stored item (DCP)."""
    seconds: float


def _open(kind: str, path: Path, group: Any, probe: Iterable[str]) -> Source:
    """The source at ``path``; what is wrong with it in its ``problems`` (DCP: agreed here already)."""
    if kind == "dcp":
        return DcpSource(open_checkpoint(path, group), probe)  # collective; agreed inside
    try:
        return TorchFileSource(path) if kind == "torch" else SafetensorsSource(path, index=kind == "safetensors_index")
    except Exception as error:  # what the sources do not expect (a file that cannot be opened): agreed all the same
        source = Source(path)
        source.problems.append(f"{path} cannot be read ({_first_line(error)}).")
        return source


def load_pretrained(
    engine: Optional[ShardedParts],
    module: nn.Module,
    path: Any,
    *,
    name_map: NameMap = None,
    allow_missing: Allowance = None,
    allow_unexpected: Allowance = None,
    progress_bytes: int = PROGRESS_BYTES,
    where: str = "load_pretrained",
) -> PretrainedReport:
    """Collective (every rank calls it; a lone process need not be distributed): the weights at ``path`` into
    ``module``, through ``engine``'s sharded view (each rank reads only its part), or, without an engine, into
    the module's own tensors (every rank reads them all). See the module docstring."""
    start = time.perf_counter()
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{where}: {path!r} is not a path; pass the path of {WHAT_IT_READS}.")
    mapper = name_mapper(name_map, f"{where}(name_map=...)")
    missing_ok = allowance(allow_missing, f"{where}(allow_missing=...)", module)
    unexpected_ok = allowance(allow_unexpected, f"{where}(allow_unexpected=...)", None)
    if isinstance(progress_bytes, bool) or not isinstance(progress_bytes, int) or progress_bytes <= 0:
        raise ValueError(f"{where}(progress_bytes={progress_bytes!r}) must be a positive number of bytes.")
    view = ShardedView(engine.parts, None) if engine is not None else None
    if view is not None and view.closed:
        raise ValueError(
            f"{where}: the engine was closed (a new fit replaced it); load into the module it hands back, "
            "or into the new engine."
        )
    if view is None:
        on_meta = [n for n, t in module.state_dict(keep_vars=True).items() if isinstance(t, Tensor) and t.is_meta]
        if on_meta:
            raise ValueError(
                f"{where}: the module's {on_meta[0]!r} is on the meta device (stage 3 builds models there); "
                "weights load once the engine has made them: pass pretrained=<path> to the strategy, or "
                "call load_pretrained after fabric.setup(model) or in on_fit_start."
            )
    wanted, whole = model_tensors(view, module)  # the same on every rank: no collective yet
    try:
        probe = [mapper(rel) for w in wanted for rel in w.relative[:1]]
    except Exception:
        probe = []  # match() says what is wrong with the name map
    group = checkpoint_group()
    rank = rank_and_size(group)[0]
    what = f"Loading pretrained weights from {path}"
    errors: list[str] = []
    kind, located = "", Path(os.fspath(path)).absolute()
    try:
        if not located.exists():
            raise ValueError(f"{path} does not exist; pass the path of {WHAT_IT_READS}.")
        kind, located = locate(located)
    except (ValueError, OSError) as error:
        errors.append(str(error))
    agree_once(errors, what, group)
    source = _open(kind, located, group, probe)
    try:
        plan = Plan(errors=list(source.problems))
        if not plan.errors:
            try:
                plan = match(wanted, source.entries, mapper, missing_ok, unexpected_ok)
            except Exception as error:  # a name_map or allowance that raised
                plan.errors.append(f"matching the model's names failed: {_first_line(error)}")
        agree_once(plan.errors, what, group)
        tally = Tally(what, progress_bytes, rank, share=plan.share)
        if rank == 0:
            log.info("%s (%s, %d file(s)): rank 0 reads %s", what, source.kind, source.files, size(plan.share))

        def read(targets: dict[str, Any]) -> None:
            pairs = [(plan.keys[name], target) for name, target in targets.items() if name in plan.keys]
            try:
                source.read(pairs, tally)
            except CheckpointError:
                raise
            except Exception as error:
                raise RuntimeError(
                    f"{describe(error)} (the weights are partly loaded: load them again before training)"
                ) from error

        agree_errors = lambda errs: agree_once(errs, what, group)  # noqa: E731
        if engine is not None:
            load_sharded(engine, read, model_prefix="", stored=set(plan.keys), agree_errors=agree_errors)
        else:
            failed = []
            with torch.no_grad():
                try:
                    read(whole)
                except Exception as error:
                    failed.append(describe(error))
            agree_errors(failed)
    finally:
        source.close()
    seconds = time.perf_counter() - start
    if rank == 0:
        log.info(
            "Loaded pretrained weights from %s in %.1f s: rank 0 read %s%s",
            path,
            seconds,
            size(tally.read),
            "".join(
                f"; {len(items)} {label}"
                for items, label in (
                    (plan.missing, "left as they were (allow_missing)"),
                    (plan.unexpected, "ignored (allow_unexpected)"),
                )
                if items
            ),
        )
    loaded = sum(1 for w in wanted if any(n in plan.keys for n in w.names))
    return PretrainedReport(
        located,
        source.kind,
        loaded,
        sorted(plan.missing),
        sorted(plan.unexpected),
        plan.share,
        tally.read,
        tally.largest,
        seconds,
    )
