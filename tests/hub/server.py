"""A local HTTP server that speaks the Hugging Face hub's protocol, for tests that must not reach the
real hub.

It answers what `huggingface_hub` (and through it transformers and datasets) asks of a hub when it
resolves a revision, lists a repository and downloads files:

    GET  /api/{models|datasets}/{repo}[/revision/{rev}]        repository info: sha, siblings
    GET  /api/{models|datasets}/{repo}/tree/{rev}[/{path}]     file listing (recursive or one level)
    POST /api/{models|datasets}/{repo}/paths-info/{rev}        listing of named paths
    HEAD|GET /{repo}/resolve/{rev}/{file}                     a model's file (X-Repo-Commit, ETag)
    HEAD|GET /datasets/{repo}/resolve/{rev}/{file}            a dataset's file

Errors carry the hub's `X-Error-Code` header (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo), which huggingface_hub turns into its typed errors. Each repository holds commits built
from local files; a branch points at one of them and can be moved (a new commit on `main`). Every
request is logged, so a test can count the downloads of each file.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterable
from urllib.parse import parse_qs, unquote, urlsplit

KINDS = {"models": "model", "datasets": "dataset"}


@dataclass
class Repo:
    """A repository: commits (sha -> {path: bytes}) and branches (name -> sha)."""

    kind: str  # model | dataset
    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    gated: bool = False

    def commit(self, files: dict[str, bytes], branch: str = "main") -> str:
        """Add a commit holding exactly `files` and point `branch` at it; its sha."""
        digest = hashlib.sha1(repr((self.repo_id, branch, len(self.commits),
                                    sorted((p, hashlib.sha1(b).hexdigest()) for p, b in files.items()))).encode())
        sha = digest.hexdigest()
        self.commits[sha] = dict(files)
        self.branches[branch] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.branches.get(revision)


def folder_files(folder: str | Path, prefix: str = "") -> dict[str, bytes]:
    """Every file under `folder` by its path relative to it (with `prefix` in front)."""
    folder = Path(folder)
    return {prefix + p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class HubServer:
    """The server, run on a thread of the test process: `start()`, `url`, `stop()`, `requests`."""

    def __init__(self, tokens: Iterable[str] = ()):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.tokens = set(tokens)
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- repositories -------------------------------------------------------------------------------

    def repo(self, kind: str, repo_id: str, gated: bool = False) -> Repo:
        key = (kind, repo_id)
        if key not in self.repos:
            self.repos[key] = Repo(kind, repo_id, gated=gated)
        return self.repos[key]

    def add(self, kind: str, repo_id: str, files: dict[str, bytes], branch: str = "main", gated: bool = False) -> str:
        """Commit `files` to a repository (created on first use); the commit's sha."""
        return self.repo(kind, repo_id, gated).commit(files, branch)

    # --- running ----------------------------------------------------------------------------------

    def start(self, port: int = 0) -> HubServer:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def log(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, status))

    def clear_log(self) -> None:
        with self._lock:
            self.requests.clear()

    def downloads(self, repo_id: str | None = None) -> dict[str, int]:
        """GET requests answered with a file body, counted by file path (`repo@rev/file`)."""
        counts: dict[str, int] = {}
        with self._lock:
            for method, path, status in self.requests:
                if method == "GET" and "/resolve/" in path and status == 200:
                    repo, rest = path.lstrip("/").removeprefix("datasets/").split("/resolve/", 1)
                    if repo_id is None or repo == repo_id:
                        rev, file = rest.split("/", 1)
                        counts[f"{repo}/{file}"] = counts.get(f"{repo}/{file}", 0) + 1
        return counts


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the hub's own log keeps what tests read
        pass

    # --- replies ------------------------------------------------------------------------------------

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
               content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        # logged before the body goes: a client that has the reply finds its request in the log
        self.hub.log(self.command, urlsplit(self.path).path, status)
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._reply(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, code: str, message: str) -> None:
        self._json({"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message})

    # --- lookups ------------------------------------------------------------------------------------

    def _repo(self, kind: str, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get((kind, repo_id))
        if repo is None:
            self._error(404 if "/" in repo_id else 401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated:
            auth = self.headers.get("Authorization", "")
            if not (auth.startswith("Bearer ") and auth[len("Bearer "):] in self.hub.tokens):
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                            "and be authenticated to access it. Please log in.")
                return None
        return repo

    def _commit(self, repo: Repo, revision: str) -> str | None:
        sha = repo.resolve(unquote(revision))
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    @staticmethod
    def _entry(path: str, data: bytes) -> dict:
        return {"type": "file", "oid": _etag(data)[:40], "size": len(data), "path": path}

    # --- routes -------------------------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def _route(self) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = parse_qs(parts.query)
        if path.startswith("/api/"):
            self._api(path[len("/api/"):], query)
        elif "/resolve/" in path:
            self._resolve(path.lstrip("/"))
        else:
            self._error(404, "EntryNotFound", "not found")

    def _split_repo(self, rest: str, marker: str) -> tuple[str, str] | None:
        """(repo id, what follows `/marker/`) of `org/name/marker/...` or `name/marker/...`."""
        if f"/{marker}/" in rest:
            repo_id, tail = rest.split(f"/{marker}/", 1)
            return repo_id, tail
        if rest.endswith(f"/{marker}"):
            return rest[: -len(marker) - 1], ""
        return None

    def _api(self, rest: str, query: dict[str, list[str]]) -> None:
        kind_plural, _, rest = rest.partition("/")
        kind = KINDS.get(kind_plural)
        if kind is None:
            self._error(404, "EntryNotFound", f"unknown api {kind_plural}")
            return
        for marker in ("tree", "paths-info", "revision"):
            split = self._split_repo(rest, marker)
            if split is not None:
                repo_id, tail = split
                break
        else:
            repo_id, marker, tail = rest, "revision", "main"
        repo = self._repo(kind, repo_id)
        if repo is None:
            return
        revision, _, sub = tail.partition("/")
        sha = self._commit(repo, revision or "main")
        if sha is None:
            return
        files = repo.commits[sha]
        if marker == "revision":
            self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                        "gated": "auto" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                        "tags": [], "lastModified": "2026-11-26T00:00:00.000Z",
                        "siblings": [{"rfilename": p} for p in sorted(files)]})
        elif marker == "tree":
            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
            prefix = sub.strip("/")
            entries, dirs = [], set()
            for p in sorted(files):
                if prefix and not p.startswith(prefix + "/"):
                    continue
                rel = p[len(prefix) + 1:] if prefix else p
                if recursive or "/" not in rel:
                    entries.append(self._entry(p, files[p]))
                if "/" in rel:
                    top = (prefix + "/" if prefix else "") + rel.split("/", 1)[0]
                    if top not in dirs:
                        dirs.add(top)
                        entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": top})
                    if recursive:  # every directory level on the way
                        parts = rel.split("/")[:-1]
                        for i in range(2, len(parts) + 1):
                            d = (prefix + "/" if prefix else "") + "/".join(parts[:i])
                            if d not in dirs:
                                dirs.add(d)
                                entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": d})
            if prefix and not entries:
                self._error(404, "EntryNotFound", f"{prefix} does not exist")
                return
            self._json(entries)
        else:  # paths-info
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode() if length else ""
            asked = _paths_of(raw, self.headers.get("Content-Type", ""))
            out = []
            for p in asked:
                if p in files:
                    out.append(self._entry(p, files[p]))
                elif any(f.startswith(p.rstrip("/") + "/") for f in files):
                    out.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": p})
            self._json(out)

    def _resolve(self, rest: str) -> None:
        kind = "model"
        if rest.startswith("datasets/"):
            kind, rest = "dataset", rest[len("datasets/"):]
        repo_id, tail = rest.split("/resolve/", 1)
        repo = self._repo(kind, repo_id)
        if repo is None:
            return
        revision, _, file = tail.partition("/")
        sha = self._commit(repo, revision)
        if sha is None:
            return
        files = repo.commits[sha]
        if file not in files:
            self._error(404, "EntryNotFound", f"{file} does not exist at {revision}")
            return
        data = files[file]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{_etag(data)}"', "Accept-Ranges": "bytes"}
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and self.command == "GET":
            start = int(rng[len("bytes="):].split("-", 1)[0] or 0)
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self._reply(206, data[start:], headers, "application/octet-stream")
            return
        self._reply(200, data, headers, "application/octet-stream")


def _paths_of(raw: str, content_type: str) -> list[str]:
    if "json" in content_type:
        try:
            return list(json.loads(raw).get("paths", []))
        except ValueError:
            return []
    return [unquote(v) for v in parse_qs(raw).get("paths", [])]


def silent_endpoint() -> tuple[socket.socket, str]:
    """A port that accepts connections and never answers (a hub behind a dropped route): the socket to
    keep open while the test runs, and its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


_HELD: list[socket.socket] = []  # closed_endpoint's ports, bound for the rest of the test process


def closed_endpoint() -> str:
    """The URL of a local port where nothing listens (connections are refused). The port stays bound,
    never listening, for the rest of the process: a port closed again could be taken by a listener
    of the other test worker before the URL is used, which would then answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"
