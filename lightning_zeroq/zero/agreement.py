"""Every rank builds the same engine, or every rank raises the same error naming what differs.

A configuration that differs on some ranks (a per-node config file, an override given on one node)
or a model that differs would otherwise make the ranks issue different collectives (other group
sizes, other unit sizes, other process groups) and wait until the process group's timeout. So,
before any other collective of the engine (the process groups of ``shard_group_size`` included),
``BuildAgreement`` compares one digest per rank of

- the settings (``Policies.settings``: every ``ZeroConfig`` field but the rank-local ones, with
  ``shard_group_size="node"`` shown with what it resolved to on this node), the working dtype and
  loss scaling;
- the unit plan: which parameters (name, shape, dtype) form which unit;
- the error this rank met while building them, if any.

Equal digests cost one small all-reduce. Otherwise every rank gathers the others' descriptions
and raises the same ``ValueError``: each setting that differs with the ranks and their values, else
the first unit that differs, else (only some ranks failed) the failing ranks' error. The exchange is
``lightning_zeroq.ranks.agree``'s (``quick``), the package's one way to fail on every rank alike.
"""

from __future__ import annotations

import itertools
from types import TracebackType
from typing import Literal, Optional, Sequence

import torch.distributed as dist
from torch import nn

from lightning_zeroq.ranks import agree
from lightning_zeroq.zero.unit_plan import UnitSpec


def describe_plan(module: nn.Module, specs: Sequence[UnitSpec]) -> list[str]:
    """One line per parameter of each unit, in order: the unit, its kind, the parameter's name, shape, dtype."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [
        f"unit {i} ({'persistent' if spec.persistent else 'transient'}) holds {names.get(id(p), '?')} "
        f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
        for i, spec in enumerate(specs)
        for p in spec.params
    ] + [
        f"unit {i} (frozen part) holds {names.get(id(p), '?')} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
        for i, spec in enumerate(specs)
        for p in spec.frozen
    ]


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0, 2, 5-7``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _by_value(values: Sequence[str]) -> str:
    """``ranks 0-2 have 2, rank 3 has 4``: the ranks holding each value, the most common first."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    order = sorted(ranks, key=lambda v: ranks[v][0])
    return ", ".join(f"{ranks_text(ranks[v])} {'have' if len(ranks[v]) > 1 else 'has'} {v}" for v in order)


def differences(settings: Sequence[dict[str, str]], plans: Sequence[list[str]]) -> Optional[str]:
    """The ``ValueError`` message for the ranks' settings and plans (rank order), or None if all agree."""
    world = len(settings)
    fields = [name for name in settings[0] if len({s.get(name) for s in settings}) > 1]
    fields += [name for s in settings for name in s if name not in settings[0] and name not in fields]
    if fields:
        parts = [
            f"{name} differs across ranks: {_by_value([str(s.get(name, '(unset)')) for s in settings])}"
            for name in fields
        ]
        hint = ""
        if "shard_group_size" in fields and all(s.get("shard_group_size", "").startswith("'node'") for s in settings):
            hint = (
                f" (the nodes run different numbers of ranks: pass shard_group_size as a number that divides the "
                f"world size {world} instead of 'node')"
            )
        return "; ".join(parts) + f"; give every rank the same configuration{hint}."
    for lines in itertools.zip_longest(*plans, fillvalue="no more parameters"):
        if len(set(lines)) > 1:
            return (
                f"the model differs across ranks: {_by_value([repr(line) for line in lines])}; every rank must "
                "build the same model with the same parameters and settings."
            )
    return None


class BuildAgreement:
    """``with BuildAgreement(group, settings) as agreement:`` build what the ranks must agree on, record it
    (``settings[...]``, ``plan``); leaving the block, the ranks compare (see the module docstring). An
    error inside the block is the error of every rank that met it; the others raise one naming it."""

    def __init__(self, group: Optional[dist.ProcessGroup], settings: dict[str, str]) -> None:
        self.group, self.settings = group, dict(settings)
        self.plan: list[str] = []

    def __enter__(self) -> "BuildAgreement":
        return self

    def __exit__(
        self, kind: Optional[type], error: Optional[BaseException], tb: Optional[TracebackType]
    ) -> Literal[False]:
        if error is not None and not isinstance(error, Exception):
            return False  # KeyboardInterrupt, SystemExit: this process stops, as it would anyway
        said = [] if error is None else [f"{type(error).__name__}: {error}"]
        agree(said, self.group, _failed, payload=(self.settings, self.plan), own=error, compare=_differ, quick=True)
        return False


def _differ(everyone: list[tuple[dict[str, str], list[str]]]) -> Optional[ValueError]:
    message = differences([settings for settings, _ in everyone], [plan for _, plan in everyone])
    return ValueError(message) if message is not None else None


def _failed(errors: list[list[str]]) -> RuntimeError:
    failed = [r for r, errs in enumerate(errors) if errs]
    return RuntimeError(
        f"{ranks_text(failed)} failed while building the ZeRO engine; rank {failed[0]} said: {errors[failed[0]][0]}"
    )
