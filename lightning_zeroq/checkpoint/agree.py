"""Ranks agree on failures, so every rank ends with the same error instead of some waiting forever.

Each step of a save or a load that can fail on one rank only (a missing file, a bad value, a full
disk) collects its error locally and then calls ``agree``: one small ``all_gather_object`` on the
checkpoint group, after which every rank raises the same ``CheckpointError`` naming the failing
ranks, or all go on. No collective that could hang (DCP's own, a barrier) runs before every rank has
said it is fine.

The checkpoint group is a gloo group created once per default process group (``checkpoint_group``):
gloo moves Python objects without a GPU, and a group of its own keeps an asynchronous save's
collectives (on a background thread) apart from training's. ``group=None`` is this process alone
(what ``checkpoint_group`` gives without a process group, and what offline readers such as
``zeroq-convert`` pass): no collective, even when a default process group is up.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import torch.distributed as dist


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised alike on every rank."""


_earlier: ContextVar[str] = ContextVar("zeroq_earlier", default="Resume from an earlier checkpoint.")


def earlier() -> str:
    """The advice a message about a damaged or incomplete checkpoint ends with: what the reader can do
    instead, which depends on who reads (resume from an earlier checkpoint, unless ``advising``)."""
    return _earlier.get()


@contextmanager
def advising(text: str) -> Iterator[None]:
    """Within the block, damaged-checkpoint messages advise ``text`` (``zeroq-convert``: convert an
    earlier checkpoint; ``load_from_checkpoint``: load one)."""
    token = _earlier.set(text)
    try:
        yield
    finally:
        _earlier.reset(token)


_groups: dict[int, tuple[Any, Any]] = {}


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def checkpoint_group(timeout: Optional[timedelta] = None) -> Optional[dist.ProcessGroup]:
    """Collective on first use (every rank must call it at the same point): the gloo group."""
    if not distributed():
        return None
    default = dist.distributed_c10d._get_default_group()
    cached = _groups.get(id(default))
    if cached is None or cached[0] is not default:
        cached = (default, dist.new_group(backend="gloo", timeout=timeout))  # None: the default timeout
        _groups[id(default)] = cached
    return cached[1]


def rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None or not distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def describe(error: BaseException) -> str:
    if isinstance(error, (CheckpointError, FileNotFoundError, ValueError, RuntimeError, TypeError, OSError)):
        return str(error) or type(error).__name__
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def exchange(value: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's ``value`` (a picklable object), in rank order; ``group=None``: this process's alone."""
    if group is None or not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree(errors: Sequence[str], what: str, group: Optional[dist.ProcessGroup], payload: Any = None) -> list[Any]:
    """Raise ``CheckpointError`` on every rank if any rank has ``errors``; else return every rank's
    ``payload``."""
    replies = exchange((list(errors), payload), group)
    failed = [(rank, errs) for rank, (errs, _) in enumerate(replies) if errs]
    if failed:
        lines = [f"{what} failed on {len(failed)} of {len(replies)} rank(s):"]
        for rank, errs in failed:
            lines += [f"  rank {rank}: {e}" for e in errs[:5]]
            if len(errs) > 5:
                lines.append(f"  rank {rank}: ... and {len(errs) - 5} more")
        raise CheckpointError("\n".join(lines))
    return [p for _, p in replies]


def agree_once(errors: Sequence[str], what: str, group: Optional[dist.ProcessGroup], payload: Any = None) -> list[Any]:
    """As ``agree``, for problems every rank finds alike (what a checkpoint holds against what the model
    needs): each distinct problem is one line, said once where every rank has it and after the ranks that
    have it otherwise, so one problem is a one-line ``CheckpointError`` on every rank."""
    replies = exchange(([" ".join(str(e).split()) for e in errors], payload), group)
    ranks: dict[str, list[int]] = {}
    for rank, (errs, _) in enumerate(replies):
        for error in dict.fromkeys(errs):
            ranks.setdefault(error, []).append(rank)
    if ranks:
        lines = [error if len(where) == len(replies) else
                 f"rank{'s' if len(where) > 1 else ''} {', '.join(map(str, where))}: {error}"
                 for error, where in ranks.items()]
        if len(lines) > 10:
            lines = lines[:9] + [f"... and {len(lines) - 9} more"]
        raise CheckpointError(f"{what}: {lines[0]}" if len(lines) == 1 else "\n".join([f"{what}:", *lines]))
    return [p for _, p in replies]
