"""Hooks the engine installs on parameters, modules and tensors, as small objects.

A ``WeakHook`` calls a bound method, ``method(*bound, *args)``, and holds it weakly
(``weakref.WeakMethod``: the object it is bound to is not kept alive by the hook): hooks stored on
parameters are not seen by Python's garbage collector, so a strong reference would keep the engine and
all its buffers alive after the last user reference is gone. Once that object is gone the hook does
nothing. It pickles as a hook that does nothing, so a model or Trainer that carries one can be pickled
(``torch.save(trainer)``), as with DDP; what unpickles is a plain model, with no engine behind it.

An ``EagerHook`` is a ``WeakHook`` that ``torch.compile`` never traces: dynamo breaks the graph around
it and runs it as plain Python (as FSDP2 does with its module hooks), so what it does to parameters
(re-allocating a unit's storage, changing a parameter's class, collectives) happens outside any
graph, and the graph on either side sees the parameters as they are then.

[Note: code compiled before stage 3 sees its parameters change]
Stage 3 changes its parameters in place (a freed parameter is a placeholder of another class and
shape's strides; a gathered one a view of the unit's buffer), and compiled code guards on them. From
torch 2.9 to 2.11 dynamo skips the guards below an ``nn.Module`` whose dictionaries kept their version
tags (``use_recursive_dict_tags_for_guards``, on by default there, off in 2.13; it takes tensors for
immutable): code compiled before the engine existed (a compiled model run once before ``fit``, an
earlier fit at another stage) then runs its old graph on freed placeholders, which the inductor's
stride check stops with an assertion. ``check_guards_in_full`` turns the fast path off, as newer torch
does (a setting of the process: code compiled later guards in full too, as on torch 2.13), and gives
each module of a transient unit a new parameter dictionary, so that code compiled before checks its
guards again and recompiles.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn


class WeakHook:
    __slots__ = ("_method", "_bound")

    def __init__(self, method: Callable[..., Any], *bound: Any) -> None:
        self._method = weakref.WeakMethod(method)  # a bound method: its object is held weakly
        self._bound = bound

    def __call__(self, *args: Any) -> Any:
        method = self._method()
        if method is None:
            return None
        return method(*self._bound, *args)

    def __reduce__(self) -> tuple:
        return (_inert, ())


class EagerHook(WeakHook):
    __slots__ = ()

    # Disabled once, here: dynamo neither traces the call nor compiles a frame of it.
    __call__ = torch._dynamo.disable(WeakHook.__call__, recursive=True)


def _inert(*args: Any) -> None:
    return None


def check_guards_in_full(modules: Iterable[nn.Module]) -> None:
    """[Note: code compiled before stage 3 sees its parameters change]."""
    dynamo = torch._dynamo.config
    if getattr(dynamo, "use_recursive_dict_tags_for_guards", False):
        dynamo.use_recursive_dict_tags_for_guards = False
    for module in modules:
        module._parameters = dict(module._parameters)
