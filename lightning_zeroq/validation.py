"""The value checks every config dataclass of the package shares (``ZeroConfig``, the model, data and
trainer sections of ``zeroq-train``). Each raises ``ValueError`` naming ``<Owner>.<field>=<value>``,
the form ``zeroq-train`` turns into a Hydra key."""

from __future__ import annotations

import os
import re
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


def check_callable(owner: str, name: str, value: Any, fix: str) -> Any:
    """``value`` if it is None or callable; a ``ValueError`` naming it and ``fix`` otherwise."""
    if value is not None and not callable(value):
        raise ValueError(f"{owner}({name}={value!r}) is not a function; {fix}.")
    return value


def check_choice(owner: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{owner}.{name}={value!r} is not one of {list(choices)}; use one of them.")
    return value


def check_local_path(owner: str, name: str, value: Any) -> str:
    """``value`` as a local path: a string or ``os.PathLike``, not the URL of a remote file system (every
    rank reads and writes its own files there with local I/O; ``s3://b`` would become the directory ``s3:/b``)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{owner}.{name}={value!r} must be a path to a local directory (a non-empty string).")
    text = os.fspath(value)
    if isinstance(text, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise ValueError(
            f"{owner}.{name}={text!r} names a remote file system; use a local directory (for NVMe "
            "swap, a fast local disk such as /local_nvme)."
        )
    return str(text)
