"""The Hugging Face hub, used as transformers and datasets use it: which names are hub ids, a revision
resolved to its commit, a repository's files fetched into the standard cache (`HF_HOME`,
`HF_HUB_CACHE`) with huggingface_hub's progress bars, and every failure as one line.

Nothing here decides which files a model or a dataset needs (distzo.models, distzo.data) or who
fetches on a mesh (distzo.run.hub_pins): this module is the hub's protocol and its errors. The
environment is the user's: `HF_ENDPOINT` (a mirror), `HF_TOKEN` or the stored login, `HF_HUB_OFFLINE`
and `HF_DATASETS_OFFLINE` (cache only) are read by huggingface_hub and honoured as they are; distzo
sets none of them. Metadata requests time out after `HF_HUB_ETAG_TIMEOUT` seconds (default 10) and
are not retried, so an unreachable hub costs one bounded wait and one line, not a hang.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from .errors import ConfigError

# A repository id: `name` or `org/name`, each part letters, digits, `-`, `_` and `.` (the hub's rule),
# neither part starting or ending with `-` or `.`, no `--` or `..`.
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")
# Names that are files, never repositories: `task.path=reviews.csv` that does not exist is a missing
# file, not a dataset called `reviews.csv`.
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".gguf", ".safetensors", ".bin")
KINDS = ("model", "dataset")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(ConfigError):
    """The hub cannot give what a setting names: a missing repository or revision, a gated one, no
    network, no cached copy. The message names the setting and the fix."""


def is_hub_id(value: Any) -> bool:
    """Whether a setting names a hub repository rather than a local path: it does not exist on disk,
    looks like `org/name` (or a bare legacy name such as `gpt2`) and not like a path or a file."""
    if not isinstance(value, str) or not value or os.path.exists(os.path.expanduser(value)):
        return False
    if value.startswith(("/", "./", "../", "~")) or value.lower().endswith(FILE_SUFFIXES):
        return False
    return bool(_REPO_ID.match(value)) and "--" not in value and ".." not in value


def endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT).rstrip("/")


def offline(kind: str = "model") -> bool:
    """Whether the user asked for the cache only: HF_HUB_OFFLINE, or for data HF_DATASETS_OFFLINE too."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    return kind == "dataset" and os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _timeout() -> float:
    from huggingface_hub import constants

    return float(constants.HF_HUB_ETAG_TIMEOUT)


@dataclass(frozen=True)
class Pin:
    """A repository at one commit: what a run fetched and records (run.json, the summary), so that
    evaluation, resume and replay read the same files however the branch has moved since."""

    kind: str  # model | dataset
    repo_id: str
    revision: str  # what was asked for: a branch, a tag or a commit ("main" when unset)
    commit: str  # the 40-hex commit it resolved to

    def record(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Pin:
        return cls(str(record["kind"]), str(record["repo_id"]), str(record["revision"]), str(record["commit"]))

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.commit[:10]}"


@dataclass(frozen=True)
class Setting:
    """Which settings named the repository and its revision, for messages."""

    key: str  # e.g. model.path
    revision_key: str  # e.g. model.revision


def resolve(kind: str, repo_id: str, revision: str | None, setting: Setting,
            recorded: Pin | None = None) -> tuple[Pin, list[str]]:
    """The commit `revision` (None: the default branch) of a repository names, and the files of that
    commit. Online: one metadata request. Offline (HF_HUB_OFFLINE): the cache's record of the
    revision and the files of its cached snapshot. recorded: the pin an earlier run of the same
    settings recorded; its commit is used, whatever the branch points at now."""
    if recorded is not None and (recorded.kind, recorded.repo_id) == (kind, repo_id):
        pin, files = resolve(kind, repo_id, recorded.commit, setting)
        return Pin(kind, repo_id, recorded.revision, pin.commit), files
    revision = revision or "main"
    if offline(kind):
        folder = cached_folder(Pin(kind, repo_id, revision, revision), setting)
        files = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()]
        return Pin(kind, repo_id, revision, folder.name), files
    from huggingface_hub import HfApi

    try:
        info = HfApi().repo_info(repo_id, repo_type=kind, revision=revision, timeout=_timeout())
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line naming the fix
        raise explain(exc, kind, repo_id, revision, setting) from None
    files = [s.rfilename for s in info.siblings or []]
    return Pin(kind, repo_id, revision, str(info.sha)), files


@dataclass(frozen=True)
class Fetch:
    """What a run fetches of one repository: the pin, the files (patterns; None: every file) and the
    settings that named it. role: what it is to the run (model, tokenizer, dataset)."""

    role: str
    pin: Pin
    patterns: tuple[str, ...] | None
    setting: Setting

    def download(self) -> Path:
        return download(self.pin, self.patterns, self.setting)


def fetch_here(fetches: Iterable[Fetch | None]) -> dict[str, Pin]:
    """Fetch into this process's cache (a process on its own; a mesh fetches once per node,
    distzo.run.hub_pins); the pins by role."""
    out = {}
    for f in fetches:
        if f is not None:
            f.download()
            out[f.role] = f.pin
    return out


def download(pin: Pin, patterns: Iterable[str] | None, setting: Setting) -> Path:
    """Fetch the files of `pin` that match `patterns` into the hub cache (files already there are not
    fetched again); the snapshot folder. Offline: the cached snapshot, which must hold them."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(pin.repo_id, repo_type=pin.kind, revision=pin.commit,
                                   allow_patterns=None if patterns is None else list(patterns),
                                   local_files_only=offline(pin.kind), etag_timeout=_timeout())
    except Exception as exc:  # noqa: BLE001
        raise explain(exc, pin.kind, pin.repo_id, pin.revision, setting) from None
    _record_ref(pin)
    return Path(folder)


def _storage(pin: Pin) -> Path:
    """The repository's folder in the hub cache (`models--org--name`, `datasets--org--name`)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=pin.repo_id, repo_type=pin.kind)


def _record_ref(pin: Pin) -> None:
    """Point the cache's `refs/<branch>` at the fetched commit, as huggingface_hub does when it is
    given a branch name: the files were fetched by commit (so every node gets the same one), and an
    offline run later names the branch (`HF_HUB_OFFLINE=1`, `model.path=org/name`)."""
    if _COMMIT.fullmatch(pin.revision) or offline(pin.kind):
        return
    ref = _storage(pin) / "refs" / pin.revision
    try:
        if ref.is_file() and ref.read_text().strip() == pin.commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(pin.commit)
        os.replace(tmp, ref)
    except OSError:  # a read-only shared cache: the commit still reads; only offline branch names need it
        pass


def download_file(pin: Pin, filename: str, setting: Setting) -> Path | None:
    """One file of `pin` from the cache or the hub; None when the commit has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(pin.repo_id, filename, repo_type=pin.kind, revision=pin.commit,
                                    local_files_only=offline(pin.kind), etag_timeout=_timeout()))
    except EntryNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001
        raise explain(exc, pin.kind, pin.repo_id, pin.revision, setting) from None


def cached_folder(pin: Pin, setting: Setting) -> Path:
    """The cached snapshot of `pin` (at its commit, or for a pin not resolved yet the commit the
    cache records for its revision), read without any request."""
    storage = _storage(pin)
    commit: str | None = pin.commit
    if not _COMMIT.fullmatch(commit):
        ref = storage / "refs" / commit
        commit = ref.read_text().strip() if ref.is_file() else None
    folder = storage / "snapshots" / commit if commit else None
    if folder is None or not folder.is_dir():
        raise explain(FileNotFoundError(str(storage)), pin.kind, pin.repo_id, pin.revision, setting, cache_only=True)
    return folder


def explain(exc: Exception, kind: str, repo_id: str, revision: str, setting: Setting,
            cache_only: bool = False) -> HubError:
    """One line for a failure of the hub or its cache, naming the setting and the fix."""
    from huggingface_hub import errors

    where, named = endpoint(), f"{setting.key}={repo_id!r}"
    at = "" if revision in ("main", None) else f" at {setting.revision_key}={revision!r}"
    if isinstance(exc, errors.GatedRepoError):
        return HubError(f"{named} is a gated repository on {where}: accept its conditions at {where}/"
                        f"{'datasets/' if kind == 'dataset' else ''}{repo_id}, then log in (hf auth login) or set "
                        "HF_TOKEN to a token of that account")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{setting.revision_key}={revision!r}: {repo_id} has no such branch, tag or commit on {where}; "
                        f"name one it has, or leave {setting.revision_key} unset for its default branch")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubError(f"{named} is neither a local {'folder' if kind == 'model' else 'file or folder'} nor a {kind} "
                        f"repository on {where}; check the name, or if the repository is private, log in "
                        "(hf auth login) or set HF_TOKEN")
    local_only = isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled))
    if (cache_only or local_only) and offline(kind):
        return HubError(f"{named}{at} is not in the hub cache ({hub_cache()}) and HF_HUB_OFFLINE"
                        f"{'/HF_DATASETS_OFFLINE' if kind == 'dataset' else ''} is set; fetch it first where the hub "
                        "is reachable (python -m distzo prepare with the same settings), or give a local "
                        f"{'folder' if kind == 'model' else 'file or folder'}")
    if cache_only:
        return HubError(f"{named}{at} is not in the hub cache ({hub_cache()}) although this node fetched it; check "
                        "that the cache folder (HF_HOME or HF_HUB_CACHE) is writable and the same for every rank of "
                        "a node")
    if local_only and exc.__cause__ is not None:  # huggingface_hub found no cached copy after a failed request
        exc = exc.__cause__
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "an error")
        reason = " ".join(str(exc).split())[:160]
        return HubError(f"{named}{at}: the hub at {where} answered {status} ({reason}); try again later, use a cached "
                        "copy with HF_HUB_OFFLINE=1, or a mirror with HF_ENDPOINT")
    if isinstance(exc, OSError) and not _is_network_error(exc):
        return HubError(f"{named}{at}: cannot write the hub cache {hub_cache()} ({exc.strerror or exc}); free space or "
                        "set HF_HOME (or HF_HUB_CACHE) to a writable folder")
    reason = " ".join(str(exc).split())[:120] or type(exc).__name__
    return HubError(f"{named}{at}: cannot reach the hub at {where} ({type(exc).__name__}: {reason}); without a network "
                    "use a cached copy (HF_HUB_OFFLINE=1, fetched beforehand with python -m distzo prepare), a local "
                    f"{'folder' if kind == 'model' else 'file or folder'}, or a mirror (HF_ENDPOINT=https://...)")


def _is_network_error(exc: BaseException) -> bool:
    """Connection and timeout errors of whichever HTTP client huggingface_hub uses (httpx, requests,
    or the socket layer), told apart from disk errors by name."""
    names = {t.__name__ for t in type(exc).__mro__}
    return bool(names & {"ConnectionError", "TimeoutError", "TransportError", "RequestError", "TimeoutException",
                         "ConnectError", "socket.gaierror", "gaierror"})
