"""YAML data to config dataclasses: each value checked against its field's type, dotted
overrides, and reading a YAML file (with NeMo-RL's `defaults:` inheritance). Knows no config
class: `config/__init__.py` holds them and `load_config`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


def check(ok: bool, name: str, expected: str, value: Any) -> None:
    """A `ValueError` naming field `name`, what was expected and the value, unless `ok`."""
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def finite(value: Any) -> bool:
    """A real number (not a bool) that is neither inf nor NaN."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


_SCALARS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _convert(tp: Any, value: Any, name: str) -> Any:
    """Coerce a YAML value to the annotated field type; a value of the wrong type is a ValueError.

    Handles nested dataclasses, tuples, Literals, `X | None` and the scalars (an int is accepted
    where a float is expected, a whole float where an int is).
    """
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        check(isinstance(value, dict), name, "a mapping", value)
        return from_dict(tp, value, prefix=f"{name}.")  # type: ignore[arg-type]
    if origin is tuple:
        args = typing.get_args(tp)
        ok = isinstance(value, list | tuple) and len(value) == len(args)
        check(ok, name, f"a list of {len(args)} values", value)
        return tuple(_convert(t, v, name) for t, v in zip(args, value, strict=True))
    if origin is Literal:
        choices = typing.get_args(tp)
        check(value in choices, name, f"one of {list(choices)}", value)
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None:
            check(type(None) in args, name, "a value (not null)", value)
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` unions are used
        return _convert(inner, value, name)
    if tp in _SCALARS:
        if tp is float and isinstance(value, int | str) and not isinstance(value, bool):
            try:  # YAML reads "1e-5" (no dot) as a string
                return float(value)
            except ValueError:
                raise ValueError(f"{name}: expected a number, got {value!r}") from None
        if tp is int and isinstance(value, float) and value.is_integer():
            return int(value)
        check(type(value) is tp, name, _SCALARS[tp], value)
    return value


def sections_from_dicts(cfg: Any) -> None:
    """A sub-config given as a dict (`PolicyConfig(parallel={...})`) becomes its dataclass;
    anything else that is not one is a `ValueError` naming the field."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        tp, value = hints[f.name], getattr(cfg, f.name)
        if not dataclasses.is_dataclass(tp) or isinstance(value, tp):
            continue
        check(isinstance(value, dict), f.name, f"{tp.__name__} or a mapping", value)
        setattr(cfg, f.name, from_dict(tp, value, prefix=f"{f.name}."))  # type: ignore[arg-type]


def from_dict[T](cls: type[T], data: dict[str, Any], *, prefix: str = "") -> T:
    """Build dataclass `cls` from a (nested) dict; an unknown key is a `ValueError`."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: unknown field; known: {', '.join(sorted(names))}")
    kwargs = {k: _convert(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key.path=value")
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p} is not a section")
        try:  # YAML's null is `null` or `~`; Python users write None
            node[leaf] = None if raw == "None" else yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ValueError(f"override {item!r}: the value is not valid YAML") from None
    return data


def read_data(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A YAML file (with NeMo-RL's `defaults:` inheritance) as a dict, the overrides applied."""
    from policyworker.config import nemo_rl

    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(f"config file {path}: no such file")
        try:
            data = nemo_rl.read_recipe(Path(path))
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path}: not valid YAML ({e})") from None
    return apply_overrides(data, overrides or [])


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain YAML-able data."""
    return _tuples_to_lists(dataclasses.asdict(cfg))


def _tuples_to_lists(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tuples_to_lists(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_tuples_to_lists(v) for v in x]
    return x
