"""Closed-book question answering from the trivia lists shipped in the `red-discordbot` wheel.

`redbot/cogs/trivia/data/lists/<name>.yaml` maps each question to its accepted answers (plus `AUTHOR`,
`DESCRIPTION` and `CONFIG` keys, skipped). The lists are GPL-3.0 data: distzo reads them at run time
from the installed wheel (`pip install --no-deps --ignore-requires-python red-discordbot==3.5.24`;
`launch/setup.sh` does it) and neither imports the package nor copies a line of them (docs/tasks.md,
NOTICE there). `task.path` may point at a folder of such lists instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Sequence

from .records import DataError

WHEEL = "red-discordbot==3.5.24"
META_KEYS = {"AUTHOR", "DESCRIPTION", "CONFIG"}


def lists_folder(path: str | None) -> Path:
    if path:
        return Path(path).expanduser()
    spec = importlib.util.find_spec("redbot")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"task=trivia reads the trivia lists of the red-discordbot wheel, which is not installed; "
                        f"pip install --no-deps {WHEEL} (or point task.path at a folder of trivia .yaml lists)")
    return Path(list(spec.submodule_search_locations)[0]) / "cogs" / "trivia" / "data" / "lists"


def trivia_records(path: str | None, lists: Sequence[str]) -> list[dict[str, Any]]:
    """One record per question of the named lists, in list order: {question, answers, list}."""
    import yaml

    folder = lists_folder(path)
    available = sorted(p.stem for p in folder.glob("*.yaml"))
    missing = [name for name in lists if name not in available]
    if not lists or missing:
        raise DataError(f"task.subsets={list(lists)}: "
                        f"{'name the trivia lists to read' if not lists else f'no list {missing[0]!r}'} "
                        f"in {folder}; available: {', '.join(available)}")
    out = []
    for name in lists:
        try:
            data = yaml.safe_load((folder / f"{name}.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise DataError(f"cannot read the trivia list {folder / name}.yaml: {exc}") from None
        for question, answers in (data or {}).items():
            if str(question) in META_KEYS or not isinstance(answers, list):
                continue
            accepted = [str(a).strip() for a in answers if str(a).strip()]
            if accepted:
                out.append({"question": str(question).strip(), "answers": accepted, "list": name})
    return out
