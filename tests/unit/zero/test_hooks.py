"""``zero/hooks.py``: hooks that call a bound method held weakly, and pickle as nothing."""

from __future__ import annotations

import gc
import pickle

import pytest

from lightning_zeroq.zero.hooks import EagerHook, WeakHook


class _Target:
    def __init__(self) -> None:
        self.calls: list = []

    def hook(self, *args) -> str:
        self.calls.append(args)
        return "called"


@pytest.mark.parametrize("kind", [WeakHook, EagerHook])
def test_hooks_call_a_bound_method_held_weakly_and_pickle_as_nothing(kind):
    target = _Target()
    hook = kind(target.hook, 1)
    assert hook(2, 3) == "called" and target.calls == [(1, 2, 3)]
    assert pickle.loads(pickle.dumps(hook)) is None  # what unpickles holds no engine
    del target
    gc.collect()
    assert hook(5) is None  # the hook kept nothing alive
