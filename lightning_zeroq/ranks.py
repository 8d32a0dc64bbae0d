"""Who this process is among the ranks of a group, and the one way ranks fail alike (``agree``).

**What ``group`` means**, in this module and everywhere in the package: a process group as
``torch.distributed`` takes it, ``None`` being the default group (every rank of the job). ``LOCAL`` is this
process alone: no collective, even while a default process group is up (what offline readers such as
``zeroq-convert`` and ``load_from_checkpoint`` pass, and what ``checkpoint.agree.checkpoint_group`` gives
without a process group). Without a process group every group is this process alone.

**Failing alike.** A step that can fail on one rank only (a file, a path, a full disk, a compiler, a setting)
must not leave the other ranks waiting in the next collective until the timeout. Each rank collects what went
wrong as lines of text and then every rank calls ``agree`` at the same point: the ranks exchange their errors
(and a payload), then all go on, or all raise. Its uses keep their own exceptions and messages: the engine's
build (``zero/agreement.py``: ``BuildAgreement``), rank-local work before the engine's collectives
(``zero/comm.py``: ``agreed``) and every step of a checkpoint's save or load (``checkpoint/agree.py``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Final, Optional, Sequence, Union

import torch
import torch.distributed as dist


class Local:
    """The type of ``LOCAL``, its one value: this process alone, as a group."""

    def __repr__(self) -> str:
        return "LOCAL"

    def __reduce__(self) -> str:
        return "LOCAL"  # the same object after pickling (a module attribute)


LOCAL: Final = Local()
"""This process alone: no collective, whatever process group is up."""

Group = Union[dist.ProcessGroup, None, Local]
"""A process group (None: the default group) or ``LOCAL``."""


def is_distributed() -> bool:
    """A default process group is up."""
    return dist.is_available() and dist.is_initialized()


def rank_and_size(group: Group) -> tuple[int, int]:
    """(this process's rank, the number of ranks) in ``group``; (0, 1) for ``LOCAL`` or without a process group."""
    if group is LOCAL or not is_distributed():
        return 0, 1
    assert not isinstance(group, Local)
    return dist.get_rank(group), dist.get_world_size(group)


def exchange(value: Any, group: Group) -> list[Any]:
    """Collective: every rank's ``value`` (picklable), in rank order (one ``all_gather_object``; ``LOCAL`` or no
    process group: ``[value]``, no collective)."""
    if group is LOCAL or not is_distributed():
        return [value]
    assert not isinstance(group, Local)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


Failure = Callable[[list[list[str]]], BaseException]
"""Every rank's errors, in rank order (the same list on every rank) -> the exception each rank raises."""
Compare = Callable[[list[Any]], Optional[BaseException]]
"""Every rank's payload, in rank order -> the exception every rank raises where they disagree, or None."""


def agree(
    errors: Sequence[str],
    group: Group,
    failure: Failure,
    *,
    payload: Any = None,
    own: Optional[BaseException] = None,
    compare: Optional[Compare] = None,
    quick: bool = False,
) -> list[Any]:
    """Collective: fail on every rank alike. Every rank of ``group`` calls it at the same point with the
    ``errors`` it met (none: all is well here) and a ``payload`` (picklable) for the others; every rank then
    knows every rank's errors and payloads, and

    1. ``compare(payloads)`` (if given): an exception where the ranks' payloads disagree, raised on every rank
       (caused by ``own``);
    2. if any rank has errors, every rank raises: the rank given ``own`` (the exception its errors describe)
       re-raises it, every other rank raises ``failure(errors by rank)``;
    3. else it returns every rank's payload, in rank order.

    ``quick``: the ranks first compare a digest of their errors and payload (one small all-reduce, on ``group``'s
    own backend and device, NCCL's included), and the errors and payloads travel only where the digests differ:
    for calls where all is usually well and every rank's payload is alike (the engine's build). Otherwise one
    ``all_gather_object`` (the checkpoint's gloo group). One rank (``LOCAL``, no process group, a group of one)
    issues no collective."""
    mine = (list(errors), payload)
    size = rank_and_size(group)[1]
    if size == 1 or (quick and _same_digest(mine, group)):
        reports = [mine] * size  # alone, or every rank's report is this one (by the digest)
    else:
        reports = exchange(mine, group)
    if compare is not None:
        differs = compare([p for _, p in reports])
        if differs is not None:
            raise differs from own
    if any(errs for errs, _ in reports):
        if own is not None:
            raise own
        raise failure([errs for errs, _ in reports])
    return [p for _, p in reports]


def _same_digest(report: Any, group: Group) -> bool:
    """Collective: every rank's ``report`` has the same digest (one all-reduce of the digest and its negation: the
    largest digest is the smallest)."""
    assert not isinstance(group, Local)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if str(dist.get_backend(group)) == "nccl"
        else torch.device("cpu")
    )
    text = repr(report).encode("utf-8", "backslashreplace")
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little", signed=True)  # |digest| < 2**55
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    return int(extremes[0]) == -int(extremes[1])
