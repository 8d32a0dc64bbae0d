"""Hooks the engine installs on parameters, modules and tensors, as small objects.

A ``WeakHook`` calls ``getattr(target, method)(*bound, *args)`` and holds ``target`` weakly: hooks
stored on parameters are not seen by Python's garbage collector, so a strong reference would keep
the engine and all its buffers alive after the last user reference is gone. It pickles as a hook
that does nothing, so a model or Trainer that carries one can be pickled (``torch.save(trainer)``),
as with DDP; what unpickles is a plain model, with no engine behind it.
"""

from __future__ import annotations

import weakref
from typing import Any


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


def _inert(*args: Any) -> None:
    return None
