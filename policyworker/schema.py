"""Config dataclasses from mappings, below every layer: each value checked against its field's
type (`from_dict`), sub-configs given as dicts (`sections_from_dicts`), unknown keys refused.
Imports nothing of ours, so the config package and the losses (NeMo-RL's loss configs are
dicts) build their dataclasses with the same rules and messages.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal


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
    try:
        return cls(**kwargs)
    except ValueError as e:  # the dataclass's own checks name its field: name the path
        if not prefix or str(e).startswith(prefix):
            raise
        raise ValueError(f"{prefix}{e}") from None


def refuse_non_finite(cfg: Any) -> None:
    """A `ValueError` naming the first number field of dataclass `cfg` that is NaN or infinite:
    comparisons with NaN are all false, so a NaN passes every range check after it."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name}: expected a finite number, got {value}")


def build[T](cls: type[T], cfg: T | Mapping[str, Any] | None, *, name: str = "cfg") -> T:
    """`cfg` as a `cls`: itself, its defaults (None), or built from a mapping of its fields by
    `from_dict` (NeMo-RL passes its configs as dicts); anything else is a `ValueError`."""
    if cfg is None:
        return cls()
    if isinstance(cfg, cls):
        return cfg
    check(isinstance(cfg, Mapping), name, f"a {cls.__name__} or a mapping", cfg)
    return from_dict(cls, dict(cfg))  # type: ignore[arg-type]


def first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The dotted name of the first field where dataclasses `a` and `b` differ (None: equal)."""
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        for f in dataclasses.fields(a):
            found = first_difference(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
            if found is not None:
                return found
        return None
    return None if a == b else prefix.removesuffix(".")


def first_value(cfg: Any, dotted: str) -> Any:
    """The value at a dotted field name of a (nested) dataclass."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
