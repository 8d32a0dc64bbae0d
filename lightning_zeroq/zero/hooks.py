"""Hooks the engine installs on parameters, modules and tensors, as small objects.

A ``WeakHook`` calls ``getattr(target, method)(*bound, *args)`` and holds ``target`` weakly: hooks
stored on parameters are not seen by Python's garbage collector, so a strong reference would keep
the engine and all its buffers alive after the last user reference is gone. It pickles as a hook
that does nothing, so a model or Trainer that carries one can be pickled (``torch.save(trainer)``),
as with DDP; what unpickles is a plain model, with no engine behind it.

An ``EagerHook`` is a ``WeakHook`` that ``torch.compile`` never traces: dynamo breaks the graph around
it and runs it as plain Python (as FSDP2 does with its module hooks), so what it does to parameters
(re-allocating a unit's storage, changing a parameter's class, collectives) happens outside any
graph, and the graph on either side sees the parameters as they are then.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class WeakHook:
    __slots__ = ("_target", "_method", "_bound")

    def __init__(self, target: object, method: str, *bound: Any) -> None:
        self._target = weakref.ref(target)
        self._method, self._bound = method, bound

    def __call__(self, *args: Any) -> Any:
        target = self._target()
        if target is None:
            return None
        return getattr(target, self._method)(*self._bound, *args)

    def __reduce__(self) -> tuple:
        return (_inert, ())


class EagerHook(WeakHook):
    __slots__ = ()

    # Disabled once, here: dynamo neither traces the call nor compiles a frame of it.
    __call__ = torch._dynamo.disable(WeakHook.__call__, recursive=True)


def _inert(*args: Any) -> None:
    return None
