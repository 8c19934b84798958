"""A stand-in Hugging Face Hub on 127.0.0.1 for tests: the routes huggingface_hub calls to
download a snapshot (0.x with transformers 4, 1.x/2.x with transformers 5), served from bytes in
memory by the standard library's HTTP server.

* `GET /api/models/{org}/{name}/revision/{revision}` (HfApi.model_info, which
  snapshot_download calls first): `{"id", "sha", "siblings": [{"rfilename"}], ...}`; an unknown repo
  or revision is a 404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound`, as the hub sends.
* `GET /api/models/{org}/{name}/tree/{revision}` (HfApi.list_repo_tree, which huggingface_hub
  2.x's snapshot_download lists the commit's files with): one page of `{"type": "file", "path",
  "size", "oid"}` (and `"lfs"` on `*.safetensors`), the same ids the resolve route sends.
* `HEAD` and `GET /{org}/{name}/resolve/{revision}/{file}` (file_download.get_hf_file_metadata,
  then http_get): `X-Repo-Commit` (the commit sha, required), `ETag` (the blob id the cache is
  keyed by), `Content-Length` (the expected size), and on `*.safetensors` (LFS files on the real
  hub) `X-Linked-Etag` / `X-Linked-Size`, which huggingface_hub prefers. A revision may be a
  branch name or the commit sha (snapshot_download asks for files by sha).

Every request is recorded (`requests`: method, path, Authorization header) so tests can check
what was fetched and that HF_TOKEN was sent. The socket is bound in the constructor (port 0:
the OS picks), so the hub accepts connections before `start()` returns; no waiting needed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

Files = dict[str, bytes]


def files_of(directory: str | Path) -> Files:
    """Every file of `directory` (not recursive) as {name: bytes}."""
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


def commit_sha(files: Files) -> str:
    """A 40-hex commit id for a revision's content (the hub's are git commit shas)."""
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()


def _etag(data: bytes) -> str:
    """A file's id (the hub's ETag / blob id): here the sha256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


class HubStub:
    """`repos`: {repo_id: {revision name: {file name: bytes}}}."""

    def __init__(self, repos: dict[str, dict[str, Files]]):
        self.repos = {repo: {rev: (commit_sha(files), files) for rev, files in revs.items()}
                      for repo, revs in repos.items()}
        self.requests: list[tuple[str, str, str | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                stub._handle(self, body=True)

            def do_HEAD(self):
                stub._handle(self, body=False)

            def log_message(self, *args):       # quiet: the record is `requests`
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.01}, daemon=True)

    def start(self) -> "HubStub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> "HubStub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def sha(self, repo: str, revision: str = "main") -> str:
        return self.repos[repo][revision][0]

    def fetched(self, method: str = "GET") -> list[str]:
        """The paths requested with `method`, in order."""
        return [path for m, path, _ in self.requests if m == method]

    # ---- routes ------------------------------------------------------------------------------
    def _revision(self, repo: str, revision: str) -> tuple[str, Files] | None:
        revs = self.repos.get(repo, {})
        if revision in revs:
            return revs[revision]
        return next((entry for entry in revs.values() if entry[0] == revision), None)

    def _handle(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((handler.command, path, handler.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if len(parts) >= 5 and parts[:2] == ["api", "models"] and parts[4] == "revision":
            self._model_info(handler, f"{parts[2]}/{parts[3]}", "/".join(parts[5:]), body)
        elif len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "tree":
            self._tree(handler, f"{parts[2]}/{parts[3]}", parts[5], body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._file(handler, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), body)
        else:
            self._send(handler, 404, b"not a hub route", {}, body)

    def _model_info(self, handler, repo: str, revision: str, body: bool) -> None:
        if repo not in self.repos:
            return self._error(handler, "RepoNotFound", body)
        entry = self._revision(repo, revision)
        if entry is None:
            return self._error(handler, "RevisionNotFound", body)
        sha, files = entry
        data = json.dumps({"id": repo, "modelId": repo, "sha": sha, "private": False,
                           "downloads": 0, "likes": 0, "tags": [],      # 0.23 requires these
                           "siblings": [{"rfilename": name} for name in files]}).encode()
        self._send(handler, 200, data, {"Content-Type": "application/json"}, body)

    def _tree(self, handler, repo: str, revision: str, body: bool) -> None:
        entry = self._revision(repo, revision) if repo in self.repos else None
        if entry is None:
            return self._error(handler, "RepoNotFound" if repo not in self.repos
                               else "RevisionNotFound", body)
        listing = []
        for name, data in entry[1].items():
            item = {"type": "file", "path": name, "size": len(data), "oid": _etag(data)}
            if name.endswith(".safetensors"):
                item["lfs"] = {"oid": _etag(data), "size": len(data), "pointerSize": 134}
            listing.append(item)
        self._send(handler, 200, json.dumps(listing).encode(),
                   {"Content-Type": "application/json"}, body)

    def _file(self, handler, repo: str, revision: str, name: str, body: bool) -> None:
        entry = self._revision(repo, revision) if repo in self.repos else None
        if entry is None:
            return self._error(handler, "RepoNotFound" if repo not in self.repos
                               else "RevisionNotFound", body)
        sha, files = entry
        if name not in files:
            return self._error(handler, "EntryNotFound", body, {"X-Repo-Commit": sha})
        data = files[name]
        etag = _etag(data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"'}
        if name.endswith(".safetensors"):
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        self._send(handler, 200, data, headers, body)

    def _error(self, handler, code: str, body: bool, headers: dict | None = None) -> None:
        self._send(handler, 404, code.encode(), {"X-Error-Code": code, **(headers or {})}, body)

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict, body: bool) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
