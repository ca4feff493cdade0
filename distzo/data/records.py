"""Reading a task's records with Hugging Face `datasets`, from local files or a hub dataset.

`task.path` is one of:

- a file (`.jsonl` / `.json`, `.csv`, `.tsv`, `.parquet`): one pool of records, split by distzo;
- a folder of split files named `train`, `validation` (or `val`, `dev`, `valid`) and `test`, each
  with one of those extensions: the layout of the GLUE (`train.tsv`, `dev.tsv`) and SuperGLUE
  (`train.jsonl`, `val.jsonl`) distributions;
- a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (a `datasets` export);
- a dataset repository, on the hub (`org/name`, fetched into the hub cache at one commit) or a local
  copy of one: its card's `configs` (the YAML header of README.md, as `datasets` reads it) name each
  subset's split files (`task.subset` picks one); without them, files whose names say their split
  (`data/train-00000-of-00001.parquet`).

Every record comes back as a plain dict, nested fields included, in file order. Reading goes through
`datasets` (its JSON, CSV and Parquet builders and `load_from_disk`), so anything those read, this
reads; TSV is read as CSV with a tab delimiter and no quoting (GLUE's files quote nothing). Split
names a repository uses beyond these (`validation_matched`) are mapped with `task.split_names`.
"""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import hub
from ..errors import ConfigError

log = logging.getLogger("distzo")

Records = list[dict[str, Any]]
SPLIT_NAMES = {"train": "train", "validation": "validation", "val": "validation", "dev": "validation",
               "valid": "validation", "test": "test"}
EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
CARD = "README.md"  # a dataset repository's card: its YAML header lists the subsets' files
DATA_SETTING = hub.Setting("task.path", "task.revision")


class DataError(ConfigError):
    """A task's data cannot be read or does not hold what the configuration asks for."""


def read_records(path: str | Path, fmt: str = "auto", json_object: Callable[[dict[str, Any]], Records] | None = None,
                 subset: str | None = None, split_names: Mapping[str, str | None] | None = None,
                 shown: str | None = None) -> dict[str, Records]:
    """The records under `path` by split (`train` / `validation` / `test`; a single file or a
    single-split export gives `all`). json_object: how a preset turns a JSON file that is one object
    (SQuAD's, DROP's distributed files) into records. subset / split_names: a dataset repository's
    subset, and which of its splits are distzo's (distzo's name -> the repository's). shown: what
    messages call it (a hub dataset, for its cached snapshot)."""
    where = Path(path).expanduser()
    if not where.exists():
        raise DataError(f"task.path={str(path)!r} does not exist; give a data file (.jsonl, .csv, .tsv, .parquet), a "
                        "folder of split files or of a datasets export (save_to_disk), or a hub dataset id (org/name)")
    if where.is_dir():
        if fmt == "arrow" or _is_export(where):
            return _read_export(where)
        files = {split: [f] for split, f in _split_files(where).items()}
        configs = card_configs(where / CARD)
        if configs or not files:  # a repository's layout (a preset's subset means nothing to plain split files)
            files = repository_split_files(where, configs, subset if configs else None, split_names, shown or str(path))
        if not files:
            raise DataError(f"task.path={str(path)!r} is a folder without split files "
                            "(train / validation / val / dev / test with .jsonl, .json, .csv, .tsv or .parquet), "
                            "a datasets export (save_to_disk) or a dataset card listing its files; "
                            "point task.path at the data file or at such a folder")
        return {split: [r for f in group for r in _read_file(f, fmt, json_object)] for split, group in files.items()}
    return {"all": _read_file(where, fmt, json_object)}


# --- dataset repositories (the hub's layout) -----------------------------------------------------------

def card_configs(card: Path) -> dict[str, dict[str, list[str]]]:
    """A dataset card's subsets: name -> split -> file patterns, from the `configs` list of its YAML
    header (the format `datasets` documents), the default subset first; {} when the card is missing
    or lists none. A subset marked `default: true` is keyed under its name and also as `""`."""
    if not card.is_file():
        return {}
    text = card.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return {}
    import yaml

    try:
        meta = yaml.safe_load(text[3:].split("\n---", 1)[0]) or {}
    except yaml.YAMLError as exc:
        raise DataError(f"{card}: its YAML header is unreadable ({_first_line(exc)})") from None
    configs: dict[str, dict[str, list[str]]] = {}
    entries = meta.get("configs") if isinstance(meta, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict):
            name = str(entry.get("config_name", "default"))
            configs[name] = _split_patterns(entry.get("data_files"), entry.get("data_dir"))
            if entry.get("default"):
                configs[""] = configs[name]
    return configs


def _split_patterns(data_files: Any, data_dir: Any) -> dict[str, list[str]]:
    """`data_files` as a card writes it (a pattern, a list of them, or a list of {split, path}) ->
    split -> patterns; `data_dir` (no data_files): every file under it, split by name."""
    def as_list(v: Any) -> list[str]:
        return [str(v)] if isinstance(v, str) else [str(x) for x in v or []]

    if data_files is None:
        return {"*": [f"{str(data_dir).strip('/')}/**"] if data_dir else ["**"]}
    if isinstance(data_files, (str, list)) and not (isinstance(data_files, list) and data_files
                                                   and isinstance(data_files[0], dict)):
        return {"train": as_list(data_files)}
    if isinstance(data_files, dict):
        return {str(k): as_list(v) for k, v in data_files.items()}
    return {str(e.get("split", "train")): as_list(e.get("path")) for e in data_files if isinstance(e, dict)}


def pick_subset(configs: Mapping[str, Any], subset: str | None, origin: str) -> str | None:
    """The subset to read: `subset` (which the card must list), else the card's default or only one;
    None for a repository whose card lists no subsets."""
    names = [n for n in configs if n]
    if subset is not None:
        if not names:
            raise DataError(f"task.subset={subset!r}: {origin} has no subsets (its card lists none); leave task.subset "
                            "unset")
        if subset not in names:
            raise DataError(f"task.subset={subset!r}: {origin} has no such subset; it has {', '.join(names)}")
        return subset
    if not names:
        return None
    if "" in configs:
        return next(n for n in names if configs[n] is configs[""])
    if len(names) == 1:
        return names[0]
    raise DataError(f"{origin} has several subsets ({', '.join(names)}); name one with task.subset=NAME")


def repository_patterns(card: Path | None, subset: str | None, origin: str) -> list[str] | None:
    """What to fetch of a dataset repository for `subset`: its card and the subset's files (None:
    every file, for a repository whose card lists no subsets)."""
    configs = card_configs(card) if card is not None else {}
    name = pick_subset(configs, subset, origin)
    if name is None:
        return None
    return [CARD, *(p for patterns in configs[name].values() for p in patterns)]


def repository_split_files(folder: Path, configs: Mapping[str, dict[str, list[str]]], subset: str | None,
                           split_names: Mapping[str, str | None] | None, origin: str) -> dict[str, list[Path]]:
    """The split files of a dataset repository's subset, by distzo's split names."""
    name = pick_subset(configs, subset, origin)
    if name is not None:
        by_split: dict[str, list[Path]] = {}
        for split, patterns in configs[name].items():
            found = sorted({f for pattern in patterns for f in folder.glob(pattern) if f.is_file()
                            and f.suffix.lower() in EXTENSIONS})
            if not found:
                raise DataError(f"{origin}: the {split} files of subset {name} ({', '.join(patterns)}) "
                                f"are missing from {folder}; fetch the dataset again")
            by_split[split] = found
        if set(by_split) == {"*"}:  # data_dir: split by the files' names
            by_split = _group_by_split_word(by_split["*"], folder)
    else:
        files = [f for f in sorted(folder.rglob("*")) if f.is_file() and f.suffix.lower() in EXTENSIONS
                 and not any(part.startswith(".") for part in f.relative_to(folder).parts)]
        by_split = _group_by_split_word(files, folder)
    return _distzo_splits(by_split, split_names, origin)


def _group_by_split_word(files: list[Path], folder: Path) -> dict[str, list[Path]]:
    """Files by the split a word of their path names (`data/train-00000-of-00001.parquet`)."""
    out: dict[str, list[Path]] = {}
    for f in files:
        words = [w for part in f.relative_to(folder).with_suffix("").parts for w in re.split(r"[-_.\s]+", part.lower())]
        split = next((w for w in words if w in SPLIT_NAMES), None)
        if split is not None:
            out.setdefault(split, []).append(f)
    return out


def _distzo_splits(by_split: Mapping[str, list[Path]], split_names: Mapping[str, str | None] | None,
                   origin: str) -> dict[str, list[Path]]:
    """A repository's splits under distzo's names: `split_names` (distzo's -> the repository's) first,
    then the usual spellings (dev, val, valid); other splits are left out with a note."""
    chosen = {ours: str(theirs) for ours, theirs in (split_names or {}).items() if theirs}
    for ours, theirs in chosen.items():
        if theirs not in by_split:
            raise DataError(f"task.split_names.{ours}={theirs!r}: {origin} has no split {theirs!r}; it has "
                            f"{', '.join(sorted(by_split))}")
    out = {ours: list(by_split[theirs]) for ours, theirs in chosen.items()}
    for theirs, files in by_split.items():
        ours = SPLIT_NAMES.get(theirs.lower())
        if theirs in chosen.values():
            continue
        if ours is None or ours in out:
            log.info("%s: split %r not read (distzo reads train, validation and test; map it with "
                     "task.split_names.<split>=%s)", origin, theirs, theirs)
            continue
        out[ours] = list(files)
    return out


def dataset_fetch(t: Any, recorded: hub.Pin | None = None) -> hub.Fetch | None:
    """What to fetch of the hub dataset a task configuration names (its commit, its card and the
    subset's files: one metadata request and the card), or None for local data. recorded: the commit
    an earlier run of this configuration read, used instead of the branch's current one."""
    if not hub.is_hub_id(t.path):
        return None
    pin, files = hub.resolve("dataset", str(t.path), t.revision, DATA_SETTING, recorded)
    card = hub.download_file(pin, CARD, DATA_SETTING) if CARD in files else None
    patterns = repository_patterns(card, t.subset, f"{t.path} (dataset on {hub.endpoint()})")
    return hub.Fetch("dataset", pin, tuple(patterns) if patterns is not None else None, DATA_SETTING)


def hub_records(t: Any, pin: hub.Pin | None, json_object: Callable[[dict[str, Any]], Records] | None = None
                ) -> tuple[dict[str, Records], str]:
    """The records of the hub dataset `task.path` names, by split, and where they come from: read
    from the cached snapshot of `pin` (fetched beforehand, on a mesh once per node), or fetched here
    when no pin is given."""
    if pin is None:
        pin = hub.fetch_here([dataset_fetch(t)])["dataset"]
    folder = hub.cached_folder(pin, DATA_SETTING)
    origin = f"{t.path}{f' ({t.subset})' if t.subset else ''} at commit {pin.commit[:10]}"
    return read_records(folder, str(t.format), json_object, t.subset, split_names(t), shown=origin), origin


def split_names(t: Any) -> dict[str, str | None]:
    """`task.split_names` as distzo's split -> the repository's (None: the usual spellings)."""
    names = t.split_names
    return {split: names[split] if hasattr(names, "__getitem__") else getattr(names, split)
            for split in ("train", "validation", "test")}


def _is_export(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("dataset_dict.json", "dataset_info.json", "state.json"))


def _split_of(stem: str) -> str | None:
    """The split a file's name says: `train.jsonl`, `dev.tsv`, or a word of it (`train-v1.1.json`,
    `drop_dataset_dev.json`)."""
    stem = stem.lower()
    if stem in SPLIT_NAMES:
        return SPLIT_NAMES[stem]
    words = [w for w in re.split(r"[-_.\s]+", stem) if w in SPLIT_NAMES]
    return SPLIT_NAMES[words[0]] if len({SPLIT_NAMES[w] for w in words}) == 1 else None


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
        return ds.to_list()  # arrow decodes a JSON file's strings here, so a byte that is not UTF-8 fails here
    except Exception as exc:  # the builders raise many kinds: arrow, pandas, json, OS errors
        cause = _innermost(exc)
        if "corresponds to no data" in str(cause):  # a header line alone, or blank lines: no records (as empty)
            return []
        if isinstance(cause, UnicodeDecodeError):
            raise DataError(f"cannot read {path}: it is not UTF-8 (byte 0x{cause.object[cause.start]:02x} does not "
                            "decode); re-save it as UTF-8") from None
        raise DataError(f"cannot read {path} as {kind}: {_first_line(cause)}; check the file, or set task.format to "
                        "its real format") from None


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


def _innermost(exc: BaseException) -> BaseException:
    """The error at the bottom of `raise ... from` chains: `datasets` wraps what went wrong (arrow's or
    pandas' parse error, naming the row) in a DatasetGenerationError that says only that one did."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


class _quiet_datasets:
    """`datasets` draws progress bars for every file it prepares (a task reads small files once), and
    logs its own line for a file it cannot parse before raising: the DataError's line says it instead."""

    def __enter__(self):
        import datasets

        self._enabled = datasets.utils.logging.is_progress_bar_enabled()
        datasets.utils.logging.disable_progress_bar()
        self._logger = logging.getLogger("datasets")
        self._level = self._logger.level
        self._logger.setLevel(logging.CRITICAL + 1)
        return self

    def __exit__(self, *exc):
        import datasets

        self._logger.setLevel(self._level)
        if self._enabled:
            datasets.utils.logging.enable_progress_bar()
