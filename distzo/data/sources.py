"""Reading a task's records from local files with Hugging Face `datasets`.

`task.path` is one of:

- a file (`.jsonl` / `.json`, `.csv`, `.tsv`, `.parquet`): one pool of records, split by distzo;
- a folder of split files named `train`, `validation` (or `val`, `dev`, `valid`) and `test`, each
  with one of those extensions: the layout of the GLUE (`train.tsv`, `dev.tsv`) and SuperGLUE
  (`train.jsonl`, `val.jsonl`) distributions;
- a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (a `datasets` export).

Every record comes back as a plain dict, nested fields included, in file order. Reading goes through
`datasets` (its JSON, CSV and Parquet builders and `load_from_disk`), so anything those read, this
reads; TSV is read as CSV with a tab delimiter and no quoting (GLUE's files quote nothing).
"""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError

log = logging.getLogger("distzo")

Records = list[dict[str, Any]]
SPLIT_NAMES = {"train": "train", "validation": "validation", "val": "validation", "dev": "validation",
               "valid": "validation", "test": "test"}
EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}


class DataError(ConfigError):
    """A task's data cannot be read or does not hold what the configuration asks for."""


def read_records(path: str, fmt: str = "auto", json_object: Callable[[dict[str, Any]], Records] | None = None
                 ) -> dict[str, Records]:
    """The records under `path` by split (`train` / `validation` / `test`; a single file or a
    single-split export gives `all`). json_object: how a preset turns a JSON file that is one object
    (SQuAD's, DROP's distributed files) into records."""
    where = Path(path).expanduser()
    if not where.exists():
        raise DataError(f"task.path={path!r} does not exist; give a data file (.jsonl, .csv, .tsv, .parquet) or a "
                        "folder of split files or of a datasets export (save_to_disk)")
    if where.is_dir():
        if fmt == "arrow" or _is_export(where):
            return _read_export(where)
        files = _split_files(where)
        if not files:
            raise DataError(f"task.path={path!r} is a folder without split files (train / validation / val / dev / "
                            "test with .jsonl, .json, .csv, .tsv or .parquet) or a datasets export (save_to_disk); "
                            "point task.path at the data file or at such a folder")
        return {split: _read_file(f, fmt, json_object) for split, f in files.items()}
    return {"all": _read_file(where, fmt, json_object)}


def _is_export(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("dataset_dict.json", "dataset_info.json", "state.json"))


def _split_of(stem: str) -> str | None:
    """The split a file's name says: `train.jsonl`, `dev.tsv`, or a word of it (`train-v1.1.json`,
    `drop_dataset_dev.json`)."""
    stem = stem.lower()
    if stem in SPLIT_NAMES:
        return SPLIT_NAMES[stem]
    words = [w for w in re.split(r"[-_.\s]+", stem) if w in SPLIT_NAMES]
    return SPLIT_NAMES[words[0]] if len(set(SPLIT_NAMES[w] for w in words)) == 1 else None


def _split_files(folder: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for f in sorted(folder.iterdir()):
        split = _split_of(f.stem)
        if f.is_file() and split and f.suffix.lower() in EXTENSIONS:
            if split in found:
                raise DataError(f"{folder} holds two {split} files ({found[split].name}, {f.name}); keep one")
            found[split] = f
    return found


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    kind = EXTENSIONS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"cannot tell the format of {path} from its extension; name it .jsonl, .json, .csv, .tsv "
                        "or .parquet, or set task.format=json|csv|tsv|parquet")
    return kind


def _read_file(path: Path, fmt: str, json_object: Callable[[dict[str, Any]], Records] | None = None) -> Records:
    import datasets

    kind = _format_of(path, fmt)
    if path.stat().st_size == 0:
        return []  # an empty split file (the JSON builder cannot read one)
    if kind == "json" and json_object is not None and path.suffix.lower() == ".json":
        import json

        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {path} as JSON: {_first_line(exc)}") from None
        if isinstance(obj, dict):
            return json_object(obj)
    builder, kwargs = {"json": ("json", {}), "csv": ("csv", {}), "parquet": ("parquet", {}),
                       "tsv": ("csv", {"delimiter": "\t", "quoting": csv.QUOTE_NONE})}[kind]
    try:
        with _quiet_datasets():
            ds = datasets.load_dataset(builder, data_files={"data": str(path)}, split="data", **kwargs)
    except Exception as exc:  # the builders raise many kinds: arrow, pandas, json, OS errors
        raise DataError(f"cannot read {path} as {kind}: {_first_line(exc)}; check the file, or set task.format to "
                        "its real format") from None
    return ds.to_list()


def _read_export(folder: Path) -> dict[str, Records]:
    import datasets

    try:
        with _quiet_datasets():
            loaded = datasets.load_from_disk(str(folder))
    except Exception as exc:
        raise DataError(f"cannot read {folder} as a datasets export (save_to_disk): {_first_line(exc)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        out: dict[str, Records] = {}
        for name, ds in loaded.items():
            split = SPLIT_NAMES.get(name.lower())
            if split is None:
                log.warning("%s: ignoring split %r (distzo reads train, validation and test)", folder, name)
                continue
            out[split] = ds.to_list()
        return out
    return {"all": loaded.to_list()}


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


class _quiet_datasets:
    """`datasets` draws progress bars for every file it prepares; a task reads small files once."""

    def __enter__(self):
        import datasets

        self._enabled = datasets.utils.logging.is_progress_bar_enabled()
        datasets.utils.logging.disable_progress_bar()
        return self

    def __exit__(self, *exc):
        import datasets

        if self._enabled:
            datasets.utils.logging.enable_progress_bar()
