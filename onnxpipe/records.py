"""JSON into frozen dataclasses, every value checked against the field's type on the way in.

Manifests and plans are files a user may have edited (or been handed): a null, a list or a string
where a number belongs must stop at the reader with the field's path, not deep inside a command.
One reader for both, driven by the dataclasses' own type hints, so a field added to either is checked
without another line here.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from onnxpipe.errors import OnnxpipeError

__all__ = ["RecordError", "from_json", "read_record"]

T = TypeVar("T")


class RecordError(ValueError):
    """A JSON value that does not fit its field; the message starts with the field's path."""


def read_record(cls: type[T], data: object, origin: str, fmt: str, check: Callable[[T], None], *, kind: str, write: str, rewrite: str) -> T:
    """A `kind` file's `data` as `cls`: its "format" must be `fmt`, then every field's type (`from_json`) and value
    (`check`, raising RecordError) is checked; any fault is one OnnxpipeError naming `origin`, the field and the way out."""
    found = data.get("format") if isinstance(data, Mapping) else None
    if found != fmt:
        raise OnnxpipeError(f"{origin}: not an onnxpipe {kind} (format {found!r}, expected {fmt!r}); {write}")
    try:
        record = from_json(cls, data)
        check(record)
    except RecordError as exc:
        raise OnnxpipeError(f"{origin}: {exc}; {rewrite}") from None
    return record


def from_json(cls: type[T], data: object, where: str = "") -> T:
    """An instance of dataclass `cls` from a JSON object; keys that are no field are ignored (e.g. "format")."""
    if not isinstance(data, Mapping):
        raise RecordError(f"{where or 'the file'}: expected an object, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        path = f"{where}.{f.name}" if where else f.name
        if f.name in data:
            values[f.name] = _convert(hints[f.name], data[f.name], path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecordError(f"{path}: missing")
    return cls(**values)


def _convert(tp: Any, value: object, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _convert(option, value, path)
            except RecordError:
                continue
        raise RecordError(f"{path}: expected {' or '.join(_name(a) for a in args)}, got {_kind(value)}")
    if tp is type(None):
        if value is not None:
            raise RecordError(f"{path}: expected null, got {_kind(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise RecordError(f"{path}: expected true or false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{path}: expected an integer, got {_kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RecordError(f"{path}: expected a finite number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecordError(f"{path}: expected a string, got {_kind(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):  # tuples: a dataclass's own asdict() read back
            raise RecordError(f"{path}: expected a list, got {_kind(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecordError(f"{path}: expected a list of {len(args)}, got {len(value)} items")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (Mapping, dict, typing.Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise RecordError(f"{path}: expected an object, got {_kind(value)}")
        inner = args[1] if len(args) == 2 else Any
        return {k: _convert(inner, v, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_json(tp, value, path)
    raise TypeError(f"records: no reader for {tp!r} at {path}")  # a field type this module does not know: a bug


def _name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
