"""A loopback, in-memory Hub-compatible HTTP server for tests.

Implements the routes huggingface_hub 2.x uses to create a repo, commit files ("regular"
uploads, inlined as base64), read repo info and trees, and download files. A commit is applied
atomically only once its whole NDJSON body has been read and checked, so a failed request leaves
the previous revision untouched. `fail_next_commit` makes the next commit fail (for retry tests):
True answers HTTP 500, an int answers that status, "drop" closes the connection without an answer.
`requests` lists every request ("METHOD path"), to show when the Hub was never contacted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    private: bool = False
    sha: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)


class HubState:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()
        self.fail_next_commit: bool | int | str = False
        self.authorizations: list[str] = []
        self.requests: list[str] = []


def _git_sha(files: dict[str, bytes], message: str) -> str:
    hasher = hashlib.sha1(message.encode())
    for path in sorted(files):
        hasher.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    hasher.update(str(time.time_ns()).encode())
    return hasher.hexdigest()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState
    endpoint: str

    def log_message(self, *args):  # keep test output quiet
        pass

    # -- helpers --------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _json(self, status: int, payload, headers: dict[str, str] | None = None):
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        return repo

    def _record_request(self):
        self.state.requests.append(f"{self.command} {self.path}")
        auth = self.headers.get("Authorization")
        if auth:
            self.state.authorizations.append(auth)

    # -- routes ---------------------------------------------------------------------------------

    def do_POST(self):
        self._record_request()
        path = urlparse(self.path).path
        body = self._body()
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if path == "/api/repos/create":
            payload = json.loads(body)
            repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
            url = {"url": f"{self.endpoint}/{repo_id}"}
            with self.state.lock:
                if repo_id in self.state.repos:
                    self._json(409, {**url, "error": "You already created this model repo"})
                    return
                private = payload.get("private", payload.get("visibility") == "private")
                self.state.repos[repo_id] = Repo(private=bool(private))
            self._json(200, url)
        elif path == "/api/validate-yaml":
            self._json(200, {"errors": [], "warnings": []})
        elif len(parts) >= 6 and parts[0] == "api" and parts[4] in ("preupload", "commit"):
            repo_id = f"{parts[2]}/{parts[3]}"
            repo = self._repo(repo_id)
            if repo is None:
                return
            if parts[4] == "preupload":
                files = json.loads(body)["files"]
                answer = [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files
                ]
                self._json(200, {"files": answer})
            else:
                self._commit(repo_id, repo, body)
        else:
            self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"})

    def _commit(self, repo_id: str, repo: Repo, body: bytes):
        with self.state.lock:
            failure, self.state.fail_next_commit = self.state.fail_next_commit, False
            if failure == "drop":
                self.close_connection = True  # the body was read; close the socket without answering
                return
            if failure:
                self._json(500 if failure is True else int(failure), {"error": "injected failure"})
                return
            files = dict(repo.files)
            header = None
            for line in body.decode().splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "header":
                    header = value
                elif key == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    files.pop(value["path"], None)
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: b for p, b in files.items() if not p.startswith(prefix)}
                else:
                    self._json(400, {"error": f"unsupported commit operation {key}"})
                    return
            if header is None:
                self._json(400, {"error": "commit without header"})
                return
            sha = _git_sha(files, header.get("summary", ""))
            repo.files, repo.sha = files, sha
            repo.commits.append(sha)
        url = f"{self.endpoint}/{repo_id}/commit/{sha}"
        self._json(200, {"commitUrl": url, "commitOid": sha, "pullRequestUrl": None})

    def do_GET(self):
        self._get(head=False)

    def do_HEAD(self):
        self._get(head=True)

    def _get(self, head: bool):
        self._record_request()
        path = urlparse(self.path).path
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if len(parts) >= 4 and parts[0] == "api" and parts[1] == "models":
            repo_id = f"{parts[2]}/{parts[3]}"
            repo = self._repo(repo_id)
            if repo is None:
                return
            if len(parts) >= 6 and parts[4] == "tree":
                prefix = "/".join(parts[6:])
                entries = self._tree(repo, prefix, "recursive=true" in self.path.lower())
                self._json(200, entries)
                return
            if repo.sha is None:
                self._send(404, b'{"error": "empty repo"}', {"X-Error-Code": "RevisionNotFound"})
                return
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.sha,
                "siblings": [{"rfilename": name} for name in sorted(repo.files)],
                "private": repo.private,
                "tags": [],
                "lastModified": "2026-11-30T00:00:00.000Z",
            }
            self._json(200, info)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id = f"{parts[0]}/{parts[1]}"
            repo = self._repo(repo_id)
            if repo is None:
                return
            file_path = "/".join(parts[4:])
            commit = {"X-Repo-Commit": repo.sha or ""}
            if file_path not in repo.files:
                self._send(404, b"{}", {"X-Error-Code": "EntryNotFound", **commit}, head=head)
                return
            content = repo.files[file_path]
            etag = '"' + hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest() + '"'
            self._send(200, content, {"ETag": etag, **commit, "Content-Type": "application/octet-stream"}, head=head)
        else:
            self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head=head)

    @staticmethod
    def _tree(repo: Repo, prefix: str, recursive: bool) -> list[dict]:
        prefix = prefix.strip("/")
        entries, directories = [], set()
        for name in sorted(repo.files):
            if prefix and not name.startswith(prefix + "/"):
                continue
            rest = name[len(prefix) + 1 :] if prefix else name
            if "/" in rest and not recursive:
                directories.add((prefix + "/" if prefix else "") + rest.split("/")[0])
                continue
            if recursive:
                pieces = rest.split("/")[:-1]
                for depth in range(1, len(pieces) + 1):
                    directories.add((prefix + "/" if prefix else "") + "/".join(pieces[:depth]))
            content = repo.files[name]
            oid = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
            entries.append({"type": "file", "path": name, "size": len(content), "oid": oid})
        entries += [{"type": "directory", "path": d, "oid": "0" * 40} for d in sorted(directories)]
        return entries


class LoopbackHub:
    """Start with `with LoopbackHub() as hub:`; `hub.endpoint` is the HF_ENDPOINT to use."""

    def __init__(self):
        self.state = HubState()
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        handler.endpoint = self.endpoint
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
