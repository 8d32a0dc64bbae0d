"""Activation checkpointing (``ZeroConfig.activation_checkpointing_policy``): the modules of the named
classes recompute their forward in the backward instead of keeping its activations.

Each such module's ``forward`` is replaced, on the instance, by torch's non-reentrant ``checkpoint`` of
the original (which restores the random state for the recomputation, so dropout draws the same and the
gradients are bitwise those without it). The module itself stays where it is, under its name and class:
parameter names, state dicts and checkpoints are those of the model without it, and stage 3's unit
detection sees the same classes. Its hooks run around the checkpointed call, once: stage 3 gathers the
unit for the forward (pre-hook) and, when the first gradient reaches the outputs, again for the
backward, in which the recomputation runs (``stage3.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply(module: nn.Module, class_names: Sequence[str]) -> None:
    """Checkpoint every submodule of ``module`` whose class is named in ``class_names`` (the outermost
    where they nest; a module checkpointed already is left as it is)."""
    if not class_names:
        return
    wanted = set(class_names)
    found = {type(m).__name__ for m in module.modules()}
    missing = sorted(wanted - found)
    if missing:
        raise ValueError(
            f"ZeroConfig.activation_checkpointing_policy names {missing}, which no module of the model is "
            f"(its classes: {', '.join(sorted(found))}); name the classes of its repeated blocks, e.g. "
            f"[{next(iter(sorted(found)))!r}]."
        )
    def visit(m: nn.Module) -> None:
        if type(m).__name__ not in wanted:
            for child in m.children():
                visit(child)
        else:  # nested ones are recomputed with it
            apply_to([m])

    visit(module)


def apply_to(modules: Sequence[nn.Module]) -> None:
    """Checkpoint each of ``modules`` (``offload="auto"`` picks some of the repeated blocks); one
    checkpointed already is left as it is."""
    for m in modules:
        if not getattr(m, "_zeroq_recomputed", False):
            m.forward = functools.partial(_checkpointed, m.forward)
            m._zeroq_recomputed = True  # type: ignore[assignment]


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
