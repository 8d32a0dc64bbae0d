"""Activation checkpointing (``ZeroConfig.activation_checkpointing_policy``): the modules of the named
classes (or of the qualified names given) recompute their forward in the backward instead of keeping its
activations.

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

from lightning_zeroq.nulls import nothing
from lightning_zeroq.zero.unit_plan import repeated_blocks


def apply(module: nn.Module, names: Sequence[str]) -> None:
    """Checkpoint every submodule of ``module`` that ``names`` names: its class, or its qualified name
    (``"blocks.0"``), the outermost where they nest (``select``); a module checkpointed already is left as
    it is."""
    apply_to(select(module, names, "activation_checkpointing_policy"))


def select(
    module: nn.Module, names: Sequence[str], field: str, inside: Callable[[nn.Module, str], None] = nothing
) -> list[nn.Module]:
    """The submodules of ``module`` whose class or qualified name is in ``names``, the outermost where they
    nest (nested ones go with them), in module order; a ``ValueError`` naming ``field`` where a name names
    none. ``inside(m, name)``: called for each module passed on the way down (``activation_offload.py``'s
    check of what encloses a module)."""
    if not names:
        return []
    named = dict(module.named_modules())
    classes = {type(m).__name__ for m in named.values()}
    missing = sorted(n for n in names if n not in classes and n not in named)
    if missing:
        blocks = repeated_blocks(module)
        qualified = {id(m): n for n, m in named.items()}
        example = qualified[id(blocks[0])] if blocks else next((n for n in named if n.count(".") == 1), "")
        raise ValueError(
            f"ZeroConfig.{field} names {missing}, which no module of the model is (its classes: "
            f"{', '.join(sorted(classes))}); name the classes of its repeated blocks, e.g. [{next(iter(sorted(classes)))!r}]"
            f"{f', or modules by their qualified names, e.g. [{example!r}]' if example else ''}."
        )
    wanted = set(names)
    chosen: list[nn.Module] = []

    def visit(m: nn.Module, name: str) -> None:
        if type(m).__name__ in wanted or name in wanted:
            chosen.append(m)
            return
        inside(m, name)
        for child_name, child in m.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(module, "")
    return chosen


def apply_to(modules: Sequence[nn.Module]) -> None:
    """Checkpoint each of ``modules`` (``offload="auto"`` picks some of the repeated blocks); one
    checkpointed already is left as it is."""
    for m in modules:
        if not getattr(m, "_zeroq_recomputed", False):
            m.forward = functools.partial(_checkpointed, m.forward)
            m._zeroq_recomputed = True  # type: ignore[assignment]


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
