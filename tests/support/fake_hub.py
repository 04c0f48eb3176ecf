"""A loopback stand-in for the part of the Hugging Face Hub HTTP API that `huggingface_hub` uses to push and pull a
model repo, so push_to_hub → download → load can be tested with no network (point HF_ENDPOINT at `FakeHub.url`).

Endpoints (read from huggingface_hub 2.4's client code): create repo, validate card YAML, preupload (every file
"regular", i.e. inline base64 in the commit), NDJSON commit, revision info, tree listing, and file resolve
(HEAD + GET with the ETag / X-Repo-Commit headers the download cache relies on). Anything else answers 404 and is
recorded in `unhandled`, so a test can show what a newer client started asking for.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_REPO = r"(?P<repo>[^/]+/[^/]+)"


def git_blob_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, list[str]] = {}  # repo -> commit oids, newest last
        self.history: list[tuple[str, dict[str, bytes]]] = []  # (repo, its files after each commit), oldest first
        self.unhandled: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def head(self, repo: str) -> str:
        return self.commits[repo][-1] if self.commits.get(repo) else "0" * 40

    def commit(self, repo: str, lines: list[dict]) -> str:
        files = self.repos[repo]
        for line in lines:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key != "header":
                raise ValueError(f"unsupported commit operation {key!r} (only regular files are faked)")
        oid = hashlib.sha1(f"{repo}:{len(self.commits[repo])}:{sorted(files)}".encode()).hexdigest()
        self.commits[repo].append(oid)
        self.history.append((repo, dict(files)))
        return oid


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        # ------------------------------------------------------------ plumbing
        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, include_body=True) -> None:
            self.send_response(status)
            for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if include_body:
                self.wfile.write(body)

        def _json(self, status: int, payload, headers: dict | None = None) -> None:
            self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _missing(self, code: str, message: str) -> None:
            self._json(404, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

        def _path(self) -> str:
            return unquote(urlsplit(self.path).path)

        # ------------------------------------------------------------ routes
        def do_POST(self) -> None:  # noqa: N802
            path, body = self._path(), self._body()
            if path == "/api/repos/create":
                request = json.loads(body)
                owner = request.get("organization")
                repo = f"{owner}/{request['name']}" if owner else request["name"]
                if repo in hub.repos:
                    return self._json(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo}"})
                hub.repos[repo], hub.commits[repo] = {}, []
                return self._json(200, {"url": f"{hub.url}/{repo}", "name": repo})
            if path == "/api/validate-yaml":
                return self._json(200, {"errors": [], "warnings": []})
            if match := re.fullmatch(rf"/api/models/{_REPO}/preupload/[^/]+", path):
                files = hub.repos.get(match["repo"])
                if files is None:
                    return self._missing("RepoNotFound", "Repository not found")
                return self._json(
                    200,
                    {
                        "files": [
                            {
                                "path": f["path"],
                                "uploadMode": "regular",
                                "shouldIgnore": False,
                                "oid": git_blob_oid(files[f["path"]]) if f["path"] in files else None,
                            }
                            for f in json.loads(body)["files"]
                        ]
                    },
                )
            if match := re.fullmatch(rf"/api/models/{_REPO}/commit/[^/]+", path):
                if match["repo"] not in hub.repos:
                    return self._missing("RepoNotFound", "Repository not found")
                oid = hub.commit(match["repo"], [json.loads(line) for line in body.splitlines() if line.strip()])
                return self._json(
                    200,
                    {"commitUrl": f"{hub.url}/{match['repo']}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None},
                )
            hub.unhandled.append(f"POST {path}")
            return self._missing("EntryNotFound", "not faked")

        def do_GET(self) -> None:  # noqa: N802
            self._get(include_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._get(include_body=False)

        def _get(self, include_body: bool) -> None:
            path = self._path()
            if match := re.fullmatch(rf"/api/models/{_REPO}(?:/revision/[^/]+)?", path):
                files = hub.repos.get(match["repo"])
                if files is None:
                    return self._missing("RepoNotFound", "Repository not found")
                return self._json(
                    200,
                    {
                        "id": match["repo"],
                        "modelId": match["repo"],
                        "sha": hub.head(match["repo"]),
                        "private": False,
                        "siblings": [{"rfilename": f} for f in sorted(files)],
                    },
                )
            if match := re.fullmatch(rf"/api/models/{_REPO}/tree/[^/]+(?:/(?P<sub>.*))?", path):
                files = hub.repos.get(match["repo"])
                if files is None:
                    return self._missing("RepoNotFound", "Repository not found")
                prefix = f"{match['sub']}/" if match["sub"] else ""
                return self._json(
                    200,
                    [
                        {"type": "file", "path": name, "size": len(data), "oid": git_blob_oid(data)}
                        for name, data in sorted(files.items())
                        if name.startswith(prefix)
                    ],
                )
            if match := re.fullmatch(rf"/{_REPO}/resolve/[^/]+/(?P<file>.+)", path):
                files = hub.repos.get(match["repo"])
                if files is None:
                    return self._missing("RepoNotFound", "Repository not found")
                if match["file"] not in files:
                    return self._missing("EntryNotFound", f"{match['file']} does not exist")
                data = files[match["file"]]
                headers = {
                    "ETag": f'"{git_blob_oid(data)}"',
                    "X-Repo-Commit": hub.head(match["repo"]),
                    "Content-Type": "application/octet-stream",
                }
                return self._send(200, data, headers, include_body)
            hub.unhandled.append(f"{self.command} {path}")
            return self._missing("EntryNotFound", "not faked")

    return Handler
