"""The docs' settings tables, from the registry: each estimator's and optimizer's settings (its
`Settings` dataclass: key, default, range, the field's doc line) as a markdown table, and the fields
the registry gives `distzo.hf.ZOArguments` (`zo_argument_fields`).

A doc holds a table between `<!-- settings: estimator=agzo -->` and `<!-- /settings -->`, or
`<!-- settings: zoarguments=all -->`; tests/unit/test_settings_tables.py checks every block against
the registry, and

    python -m distzo.config.tables docs/*.md

rewrites them after a component's settings change.
"""

from __future__ import annotations

import re
import sys
import typing
from dataclasses import MISSING, fields
from enum import Enum
from pathlib import Path
from typing import Any

from ..registry import registry
from .compose import SETTINGS_BASES, component_settings

GROUP_POINTS = {"estimator": "estimator", "optim": "optimizer"}
BLOCK = re.compile(r"(<!-- settings: (\w+)=([\w.-]+) -->\n)(.*?)(<!-- /settings -->)", re.S)


def _value(value: Any) -> str:
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "null" if value is None else str(value)


def settings_table(group: str, name: str) -> str:
    """The markdown table of component `name`'s settings (`group`: estimator or optim)."""
    point = GROUP_POINTS[group]
    cls = registry(point).get(name, key=group)
    settings = component_settings(point, name, cls, SETTINGS_BASES[point])
    rows = ["| key | default | range | what |", "|---|---|---|---|"]
    for f in fields(settings):
        if f.name == "name" or f.default is MISSING and f.default_factory is MISSING:
            continue
        value, bound, doc = _value(getattr(settings, f.name)), f.metadata.get("range", ""), f.metadata.get("doc", "")
        rows.append(f"| `{group}.{f.name}` | {value} | {bound} | {doc} |")
    return "\n".join(rows) + "\n"


OPTIM_PREFIX = "optim_"


def zo_argument_fields() -> dict[str, tuple[str, str, Any]]:
    """ZOArguments' field name -> (config group, the setting's name, its type) for every setting of
    every registered estimator (its own name) and of every optimizer but the learning rate, weight
    decay and schedule that TrainingArguments carries (`optim_<name>`); the first component declaring
    a name gives its type."""
    shared_optim = {f.name for f in fields(SETTINGS_BASES["optimizer"])}
    out: dict[str, tuple[str, str, Any]] = {}
    for group, point in GROUP_POINTS.items():
        for name, _ in registry(point).items():
            settings = registry(point).settings(name)
            hints = typing.get_type_hints(settings)
            for f in fields(settings):
                if f.name == "name" or (point == "optimizer" and f.name in shared_optim):
                    continue
                key = (OPTIM_PREFIX if point == "optimizer" else "") + f.name
                out.setdefault(key, (group, f.name, hints[f.name]))
    return out


def owners(group: str, setting: str) -> list[str]:
    """The registered components of `group` that have `setting`."""
    point = GROUP_POINTS[group]
    return [n for n, _ in registry(point).items() if setting in {f.name for f in fields(registry(point).settings(n))}]


def builtin(group: str) -> list[str]:
    """The components of `group` distzo itself registers (the docs' tables leave plugins out)."""
    return [n for n, cls in registry(GROUP_POINTS[group]).items() if cls.__module__.startswith("distzo.")]


def zo_arguments_table() -> str:
    """The markdown table of the ZOArguments fields that distzo's own components give it."""
    rows = ["| `ZOArguments` field | distzo key | of |", "|---|---|---|"]
    for key, (group, setting, _) in zo_argument_fields().items():
        of = [o for o in owners(group, setting) if o in builtin(group)]
        if not of:
            continue  # a plugin's setting
        every = len(of) == len(builtin(group))
        rows.append(f"| `{key}` | `{group}.{setting}` | {'every ' + group if every else ', '.join(of)} |")
    return "\n".join(rows) + "\n"


def render(group: str, name: str) -> str:
    return zo_arguments_table() if group == "zoarguments" else settings_table(group, name)


def refreshed(text: str) -> str:
    """`text` with every settings block regenerated."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), m.group(3)) + m.group(5), text)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(group, component, the block's current table) of every settings block of a doc."""
    return [(m.group(2), m.group(3), m.group(4)) for m in BLOCK.finditer(text)]


def main(paths: list[str]) -> int:
    for path in map(Path, paths):
        text = path.read_text()
        new = refreshed(text)
        if new != text:
            path.write_text(new)
            print(f"rewrote the settings tables of {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
