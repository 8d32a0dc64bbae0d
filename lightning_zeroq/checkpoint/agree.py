"""Ranks agree on failures, so every rank ends with the same error instead of some waiting forever.

Each step of a save or a load that can fail on one rank only (a missing file, a bad value, a full
disk) collects its error locally and then calls ``agree``: one small ``all_gather_object`` on the
checkpoint group, after which every rank raises the same ``CheckpointError`` naming the failing
ranks, or all go on. No collective that could hang (DCP's own, a barrier) runs before every rank has
said it is fine.

The checkpoint group is a gloo group created once per default process group (``checkpoint_group``):
gloo moves Python objects without a GPU, and a group of its own keeps an asynchronous save's
collectives (on a background thread) apart from training's. Without a process group it is ``LOCAL``
(``lightning_zeroq.ranks``: this process alone), which offline readers such as ``zeroq-convert``
pass too: no collective, even when a default process group is up. ``None`` is the default group, as
everywhere in the package. The exchange is ``lightning_zeroq.ranks.agree``'s, the package's one way to
fail on every rank alike.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import torch.distributed as dist

from lightning_zeroq import ranks
from lightning_zeroq.ranks import LOCAL, Group, is_distributed


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


def checkpoint_group(timeout: Optional[timedelta] = None) -> Group:
    """Collective on first use (every rank must call it at the same point): the gloo group; ``LOCAL``
    without a process group."""
    if not is_distributed():
        return LOCAL
    default = dist.distributed_c10d._get_default_group()
    cached = _groups.get(id(default))
    if cached is None or cached[0] is not default:
        cached = (default, dist.new_group(backend="gloo", timeout=timeout))  # None: the default timeout
        _groups[id(default)] = cached
    return cached[1]


def describe(error: BaseException) -> str:
    if isinstance(error, (CheckpointError, FileNotFoundError, ValueError, RuntimeError, TypeError, OSError)):
        return str(error) or type(error).__name__
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def agree(errors: Sequence[str], what: str, group: Group, payload: Any = None) -> list[Any]:
    """Raise ``CheckpointError`` on every rank if any rank has ``errors``; else return every rank's
    ``payload``."""

    def failure(by_rank: list[list[str]]) -> CheckpointError:
        failed = [(rank, errs) for rank, errs in enumerate(by_rank) if errs]
        lines = [f"{what} failed on {len(failed)} of {len(by_rank)} rank(s):"]
        for rank, errs in failed:
            lines += [f"  rank {rank}: {e}" for e in errs[:5]]
            if len(errs) > 5:
                lines.append(f"  rank {rank}: ... and {len(errs) - 5} more")
        return CheckpointError("\n".join(lines))

    return ranks.agree(errors, group, failure, payload=payload)


def agree_once(errors: Sequence[str], what: str, group: Group, payload: Any = None) -> list[Any]:
    """As ``agree``, for problems every rank finds alike (what a checkpoint holds against what the model
    needs): each distinct problem is one line, said once where every rank has it and after the ranks that
    have it otherwise, so one problem is a one-line ``CheckpointError`` on every rank."""

    def failure(by_rank: list[list[str]]) -> CheckpointError:
        where: dict[str, list[int]] = {}
        for rank, errs in enumerate(by_rank):
            for error in dict.fromkeys(errs):
                where.setdefault(error, []).append(rank)
        lines = [
            error
            if len(found) == len(by_rank)
            else f"rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}: {error}"
            for error, found in where.items()
        ]
        if len(lines) > 10:
            lines = lines[:9] + [f"... and {len(lines) - 9} more"]
        return CheckpointError(f"{what}: {lines[0]}" if len(lines) == 1 else "\n".join([f"{what}:", *lines]))

    return ranks.agree([" ".join(str(e).split()) for e in errors], group, failure, payload=payload)
