"""The trainer state (loops, callbacks, schedulers, precision, hyperparameters) as JSON, no pickle.

Reading JSON runs no code, so a checkpoint's trainer state can come from anywhere. Values are kept
exactly: JSON's own types (``NaN`` and infinities included, as Python's ``json`` writes them),
tuples, dicts with non-string keys, tensors (dtype, shape and the raw little-endian bytes in
base64, so bit for bit), dtypes, ``torch.Size`` and paths are tagged objects ``{"__zeroq__": kind,
...}``. Dict subclasses and a few containers are rebuilt from an allow-list of types registered by
name (``register_type``; the Lightning glue adds ``AttributeDict``, ``Namespace`` and OmegaConf's
containers); such a registered class may itself be a value (Lightning's ``hparams_type``). Anything else is refused when saving, with the path of the value in the checkpoint
and its type, before any file is written.
"""

from __future__ import annotations

import base64
import json
import math
import numbers
import pathlib
from collections import OrderedDict
from typing import Any, Callable

import torch

TAG = "__zeroq__"

_TYPES: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any], Any]]] = {}
"""name -> (type, to plain value, from plain value)"""


def register_type(name: str, cls: type, to_plain: Callable[[Any], Any], from_plain: Callable[[Any], Any]) -> None:
    """Allow ``cls`` in the trainer state: saved as ``to_plain(obj)`` and rebuilt with ``from_plain``."""
    _TYPES[name] = (cls, to_plain, from_plain)


register_type("OrderedDict", OrderedDict, dict, OrderedDict)

DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class UnsupportedValue(TypeError):
    pass


def encode(value: Any, path: str = "checkpoint") -> Any:
    """``value`` as JSON-compatible data; raises ``UnsupportedValue`` naming the path and the type."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return {
            TAG: "tensor",
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(raw.numpy().tobytes()).decode("ascii"),
        }
    if isinstance(value, torch.Size):
        return {TAG: "size", "items": list(value)}
    if isinstance(value, torch.dtype):
        return {TAG: "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, pathlib.PurePath):
        return {TAG: "path", "value": str(value)}
    for name, (cls, to_plain, _) in _TYPES.items():
        if type(value) is cls:
            try:
                plain = to_plain(value)
            except Exception as error:
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                raise UnsupportedValue(
                    f"{path} is a {name} that cannot be stored ({type(error).__name__}: {first}); "
                    "fix the value or keep it out of the checkpoint."
                ) from None
            return {TAG: "type", "name": name, "value": encode(plain, path)}
        if value is cls:  # the class itself (Lightning saves ``hparams_type`` for OmegaConf hyperparameters)
            return {TAG: "class", "name": name}
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, f"{path}[{k!r}]") for k, v in value.items()}
        return {
            TAG: "dict",
            "items": [[encode(k, f"{path} key"), encode(v, f"{path}[{k!r}]")] for k, v in value.items()],
        }
    if isinstance(value, numbers.Integral):  # numpy integers
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if type(value).__module__.split(".")[0] == "lightning_zeroq":
        raise UnsupportedValue(
            f"{path} is a {type(value).__module__}.{type(value).__qualname__}, part of the module's sharded state, "
            "which ZeroQ stores with the tensors only as a whole dict of the checkpoint's top level (under "
            "'state_dict', or any other key a callback moves it to, as Lightning's weight averaging moves it to "
            "'current_model_state'), not inside the trainer state: keep the module's state dict whole at a "
            "top-level key, or save what the callback needs of it as tensors (e.g. from "
            "ZeroQStrategy.full_state_dict())."
        )
    raise UnsupportedValue(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which a ZeroQ checkpoint cannot store: "
        "its trainer state is JSON so that loading never runs code. Keep such values out of the checkpoint "
        "(hyperparameters, callback and on_save_checkpoint state) or convert them to numbers, strings, lists, "
        "dicts or tensors; a dict subclass can be allowed with lightning_zeroq.checkpoint.codec.register_type."
    )


def decode(data: Any, path: str = "checkpoint") -> Any:
    """The value ``encode`` made ``data`` of; a registered type's ``from_plain`` that refuses its value
    (raises ``ValueError``) is named by its ``path`` in the checkpoint."""
    if isinstance(data, list):
        return [decode(v, f"{path}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    kind = data.get(TAG)
    if kind is None:
        return {k: decode(v, f"{path}[{k!r}]") for k, v in data.items()}
    if kind == "tensor":
        dtype = DTYPES[data["dtype"]]
        raw = bytearray(base64.b64decode(data["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(data["shape"]).clone() if raw else torch.empty(data["shape"], dtype=dtype)
    if kind == "size":
        return torch.Size(data["items"])
    if kind == "dtype":
        return DTYPES[data["name"]]
    if kind == "path":
        return pathlib.Path(data["value"])
    if kind == "tuple":
        return tuple(decode(v, f"{path}[{i}]") for i, v in enumerate(data["items"]))
    if kind == "dict":
        return {_hashable(decode(k)): decode(v, f"{path}[{_hashable(decode(k))!r}]") for k, v in data["items"]}
    if kind == "type" and data["name"] in _TYPES:
        value = decode(data["value"], path)
        try:
            return _TYPES[data["name"]][2](value)
        except ValueError as error:
            raise ValueError(f"{path} {error}") from None
    if kind == "class" and data["name"] in _TYPES:
        return _TYPES[data["name"]][0]
    raise ValueError(f"unknown tagged value {kind!r} (name {data.get('name')!r}) in a checkpoint's trainer state")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def dumps(value: Any) -> str:
    return json.dumps(encode(value), allow_nan=True)


def loads(text: str) -> Any:
    return decode(json.loads(text))


def same(a: Any, b: Any) -> bool:
    """Equality that treats NaN as equal to itself (tests)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b
