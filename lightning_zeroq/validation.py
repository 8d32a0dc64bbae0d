"""The value checks every config dataclass of the package shares (``ZeroConfig``, the model, data and
trainer sections of ``zeroq-train``). Each raises ``ValueError`` naming ``<Owner>.<field>=<value>``,
the form ``zeroq-train`` turns into a Hydra key."""

from __future__ import annotations

from typing import Any, Sequence


def check_int(owner: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``. Integral floats such as ``2e8`` are accepted, the
    way DeepSpeed users write bucket sizes; booleans are not integers here."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name}={value!r} must be an integer >= {minimum}.")
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name}={value!r} must be true or false.")
    return value


def check_choice(owner: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{owner}.{name}={value!r} is not one of {list(choices)}; use one of them.")
    return value
