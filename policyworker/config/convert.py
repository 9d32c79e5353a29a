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
