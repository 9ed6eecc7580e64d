"""A loopback stand-in for the Hugging Face hub: the endpoints huggingface_hub's model_info and snapshot_download
use (repo info at a revision, the recursive tree listing, HEAD/GET of a file under /resolve/), serving the files
of local directories as commits, and the ones a push uses (create_repo, create_branch, create_commit's preupload
and commit). Point HF_ENDPOINT at `url`; `requests` logs every request, so a test can assert that a process made
none. Not a mock of our code: the real huggingface_hub client talks HTTP to it.

Pushed files are all taken as regular files (inline in the commit): the preupload answers "regular" for each, so
huggingface_hub's LFS and Xet transfers of large files are not exercised here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import yaml


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, str]] = {}  # repo -> {branch or commit: commit}
        self.commits: dict[str, dict[str, bytes]] = {}  # commit -> {path: content}
        self.requests: list[str] = []
        self.private: dict[str, bool] = {}  # repo -> created private
        self.cards: list[dict] = []  # the metadata of every model card validated
        self.fail_pushes_with: int | None = None  # an HTTP status every push endpoint answers, when set
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet: the log is `requests`
                pass

            def do_HEAD(self) -> None:
                stand_in._serve(self, body=False)

            def do_GET(self) -> None:
                stand_in._serve(self, body=True)

            def do_POST(self) -> None:
                stand_in._write(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def publish(self, repo: str, directory: Path, branch: str = "main") -> str:
        """The files of `directory` as a new commit of `repo`, the head of `branch`; returns the commit."""
        files = {
            p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        }
        return self.publish_files(repo, files, branch)  # the same files published twice: two commits

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _commit(self, repo: str, revision: str) -> str | None:
        refs = self.repos.get(repo)
        if refs is None:
            return None
        if revision in refs:
            return refs[revision]
        return revision if revision in self.commits else None

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append(f"{h.command} {h.path}")
        parts = [unquote(p) for p in urlparse(h.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
            commit = self._commit(repo, revision)
            if commit is None:
                return self._send(h, 404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            files = self.commits[commit]
            if kind == "revision":
                info = {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
            else:
                info = [
                    {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for f, d in files.items()
                ]
            return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, revision, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            commit = self._commit(repo, revision)
            data = None if commit is None else self.commits[commit].get(path)
            if data is None:
                return self._send(h, 404, b"not found", {"X-Error-Code": "EntryNotFound"}, body)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            return self._send(h, 200, data, headers, body)
        self._send(h, 404, b"not found", {}, body)

    def _write(self, h: BaseHTTPRequestHandler) -> None:
        self.requests.append(f"POST {h.path}")
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        parts = [unquote(p) for p in urlparse(h.path).path.strip("/").split("/")]
        as_json = {"Content-Type": "application/json"}
        if self.fail_pushes_with is not None:
            return self._send(
                h, self.fail_pushes_with, b'{"error": "refused by the stand-in"}', as_json, True
            )
        if parts == [
            "api",
            "validate-yaml",
        ]:  # the model card's metadata header, before a commit with a README
            content = json.loads(raw)["content"]
            header = content.split("---")[1] if content.startswith("---") else ""
            try:
                meta = yaml.safe_load(header) or {}
            except yaml.YAMLError as e:
                return self._send(h, 400, json.dumps({"error": str(e)}).encode(), as_json, True)
            self.cards.append(meta)
            return self._send(h, 200, b'{"errors": [], "warnings": []}', as_json, True)
        if parts == ["api", "repos", "create"]:
            payload = json.loads(raw)
            repo = f"{payload.get('organization') or 'user'}/{payload['name']}"
            url = json.dumps({"url": f"{self.url}/{repo}", "error": "exists"}).encode()
            if repo in self.repos:
                return self._send(h, 409, url, as_json, True)
            self.private[repo] = payload.get("visibility") == "private" or bool(payload.get("private"))
            self.publish_files(repo, {".gitattributes": b""})
            return self._send(h, 200, url, as_json, True)
        if parts[:2] != ["api", "models"] or len(parts) < 6 or "/".join(parts[2:4]) not in self.repos:
            return self._send(h, 404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, True)
        repo, action, revision = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
        if action == "preupload":
            files = [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                for f in json.loads(raw)["files"]
            ]
            return self._send(h, 200, json.dumps({"files": files}).encode(), as_json, True)
        if action == "branch":
            self.repos[repo].setdefault(revision, self.repos[repo]["main"])
            return self._send(h, 200, b"{}", as_json, True)
        if action == "commit":
            parent = self._commit(repo, revision)
            if parent is None:
                return self._send(
                    h, 404, b'{"error": "no such revision"}', {"X-Error-Code": "RevisionNotFound"}, True
                )
            files = dict(self.commits[parent])
            for line in raw.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] != "header":  # lfsFile, deletedFile, ...: not what a model push sends here
                    return self._send(
                        h, 400, json.dumps({"error": f"unsupported {item['key']}"}).encode(), as_json, True
                    )
            commit = self.publish_files(repo, files, revision)
            answer = {"commitOid": commit, "commitUrl": f"{self.url}/{repo}/commit/{commit}", "success": True}
            return self._send(h, 200, json.dumps(answer).encode(), as_json, True)
        self._send(h, 404, b'{"error": "not found"}', {}, True)

    def publish_files(self, repo: str, files: dict[str, bytes], branch: str = "main") -> str:
        """`files` as a new commit of `repo`, the head of `branch`; returns the commit."""
        digest = hashlib.sha1(repo.encode())
        for path, data in sorted(files.items()):
            digest.update(path.encode() + hashlib.sha1(data).digest())
        digest.update(str(len(self.commits)).encode())
        commit = digest.hexdigest()
        self.commits[commit] = files
        self.repos.setdefault(repo, {})[branch] = commit
        return commit

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool
    ) -> None:
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)
