"""YAML data to config dataclasses: each value checked against its field's type, dotted
overrides, and reading a YAML file (with NeMo-RL's `defaults:` inheritance). Knows no config
class: `config/__init__.py` holds them and `load_config`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from policyworker.schema import check, finite, from_dict, sections_from_dicts  # noqa: F401


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: true / false only. PyYAML's 1.1 rules also read yes, no,
    on and off as booleans (`sequence_packing.enabled=yes` was taken as true, a key `on` as
    True); here they stay strings, which a boolean field refuses."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def load_yaml(text: str) -> Any:
    """`text` as YAML (safe: plain data only; YAML 1.2 booleans)."""
    return yaml.load(text, Loader=_Loader)


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
            node[leaf] = None if raw == "None" else load_yaml(raw)
        except yaml.YAMLError:
            raise ValueError(f"override {item!r}: the value is not valid YAML") from None
    return data


def read_data(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A YAML file (with NeMo-RL's `defaults:` inheritance) as a dict, the overrides applied."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(f"config file {path}: no such file")
        try:
            data = read_recipe(Path(path))
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


MAX_VALUES = 200_000
"""The most values (leaves and sections, each alias counted where it is used) a config may
expand to: a few YAML aliases nested can stand for billions of them."""


def read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe YAML with its `defaults:` (one or a list, relative to the file) merged under it,
    as NeMo-RL composes them; nothing resolved yet. A `ValueError` naming the file for YAML
    that does not parse (one line), a `defaults:` cycle, or a file that expands to more than
    `MAX_VALUES` values."""
    here = path.resolve()
    if here in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(here) :], here))
        raise ValueError(f"config file {path}: defaults form a cycle ({cycle})")
    data = _load_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping at the top level")
    _check_size(data, path)
    parents = data.pop("defaults", None) or []
    merged: dict[str, Any] = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        if not isinstance(parent, str):
            raise ValueError(f"config file {path}: defaults: expected file names, got {parent!r}")
        base = Path(parent) if parent.startswith("/") else path.parent / parent
        if not base.is_file():
            raise ValueError(f"config file {path}: defaults {parent}: no such file ({base})")
        merged = merge(merged, read_recipe(base, (*chain, here)))
    return merge(merged, data)


def _load_yaml(path: Path) -> Any:
    """The file's YAML; a syntax error as one line: the file, where, and what."""
    try:
        return load_yaml(path.read_text())
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        raise ValueError(f"config file {path}: not valid YAML{where}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path}: not valid YAML: {str(e).splitlines()[0]}") from None


def _check_size(data: Any, path: Path) -> None:
    """Count the values `data` stands for (an alias counted each place it is used), stopping
    at `MAX_VALUES`: merging or resolving an alias bomb would exhaust the memory."""
    stack, count = [data], 0
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ValueError(
                f"config file {path}: expands to more than {MAX_VALUES} values (YAML aliases "
                "nested inside each other?)"
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and v.pop("_override_", False):
            out[k] = v
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out
