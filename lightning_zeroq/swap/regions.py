"""What a swapper holds and is handed: regions (a key's size, dtype and file) and the checks of the
arguments that describe them and the swapper."""

from __future__ import annotations

import os
import re
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

from lightning_zeroq.swap.buffers import align_up

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
DEFAULT_BUFFER_BYTES = 32 * 1024 * 1024
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}")

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Region:
    key: str
    numel: int
    dtype: torch.dtype
    nbytes: int
    file_bytes: int
    name: str  # the file's name in the swapper's directory (opened relative to its descriptor)
    path: Path  # the same file, for messages


def new_region(
    key: str, numel: int, dtype: torch.dtype, alignment: int, directory: Path, registered: Container[str]
) -> Region:
    """The region ``register(key, numel, dtype)`` declares, its file in ``directory``."""
    if not isinstance(key, str) or not _KEY_PATTERN.fullmatch(key):
        raise ValueError(
            f"NvmeSwapper.register: key={key!r} must be 1-200 characters from [A-Za-z0-9_.-] not "
            "starting with '.', since it names a file"
        )
    if key in registered:
        raise ValueError(f"NvmeSwapper.register: key={key!r} is already registered")
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"NvmeSwapper.register({key!r}): numel={numel!r} must be an int >= 0")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"NvmeSwapper.register({key!r}): dtype={dtype} is not supported; use one of "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    name = f"{key}.swp"
    return Region(key, numel, dtype, nbytes, align_up(nbytes, alignment), name, directory / name)


def check_arguments(
    rank: int, num_buffers: int, alignment: int, buffer_bytes: int, num_threads: int, prefix: str
) -> None:
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"NvmeSwapper: rank={rank!r} must be an int >= 0")
    if not isinstance(num_buffers, int) or num_buffers < 1:
        raise ValueError(f"NvmeSwapper: num_buffers={num_buffers!r} must be an int >= 1 (4 is typical)")
    if not isinstance(alignment, int) or alignment < 512 or alignment & (alignment - 1):
        raise ValueError(f"NvmeSwapper: alignment={alignment!r} must be a power of two >= 512 (4096 is typical)")
    if not isinstance(buffer_bytes, int) or buffer_bytes <= 0 or buffer_bytes % alignment:
        raise ValueError(
            f"NvmeSwapper: buffer_bytes={buffer_bytes!r} must be a positive multiple of alignment={alignment} "
            f"(e.g. {DEFAULT_BUFFER_BYTES})"
        )
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"NvmeSwapper: num_threads={num_threads!r} must be an int >= 1 (2 is typical)")
    if not _KEY_PATTERN.fullmatch(prefix):
        raise ValueError(f"NvmeSwapper: prefix={prefix!r} must be characters from [A-Za-z0-9_.-]")


def check_tensor(region: Region, tensor: torch.Tensor, op: str) -> None:
    where = f"NvmeSwapper.{op}({region.key!r})"
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.numel() != region.numel or tensor.dtype != region.dtype:
        raise ValueError(
            f"{where}: tensor has numel={tensor.numel()} dtype={tensor.dtype}, but the region was "
            f"registered with numel={region.numel} dtype={region.dtype}"
        )
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: tensor is on {tensor.device}; swap from a CPU (ideally pinned) tensor")
    if not tensor.is_contiguous():
        raise ValueError(f"{where}: tensor must be contiguous; pass tensor.contiguous() or a flat buffer")
