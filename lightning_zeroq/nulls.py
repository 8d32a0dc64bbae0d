"""``nothing``: the null of a bare callback, the one null object that belongs to no protocol of its own.

The rule it serves (``docs/DESIGN.md``, "No feature, one way"): a part that is only told things (a listener, a
callback, a hook) is never ``Optional``; without its feature it is a null object that does nothing, the protocol's
own beside the protocol (``zero/reducer.py``: ``NoListener``) or, for a bare callback, ``nothing``. A part the
caller asks (whose answers or presence pick the path) is ``Optional`` and has no null object.
"""

from __future__ import annotations


def nothing(*args: object, **kwargs: object) -> None:
    """Do nothing: the value of a callback slot no part has filled (module-level, so it pickles by name)."""
    return None
