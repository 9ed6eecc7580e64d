"""A loopback stand-in for the Hugging Face hub: the endpoints huggingface_hub's model_info and snapshot_download
use (repo info at a revision, the recursive tree listing, HEAD/GET of a file under /resolve/), serving the files
of local directories as commits. Point HF_ENDPOINT at `url`; `requests` logs every request, so a test can assert
that a process made none. Not a mock of our code: the real huggingface_hub client talks HTTP to it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, str]] = {}  # repo -> {branch or commit: commit}
        self.commits: dict[str, dict[str, bytes]] = {}  # commit -> {path: content}
        self.requests: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet: the log is `requests`
                pass

            def do_HEAD(self) -> None:
                stand_in._serve(self, body=False)

            def do_GET(self) -> None:
                stand_in._serve(self, body=True)

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
        digest = hashlib.sha1(repo.encode())
        for path, data in files.items():
            digest.update(path.encode() + hashlib.sha1(data).digest())
        digest.update(str(len(self.commits)).encode())  # the same files published twice: two commits
        commit = digest.hexdigest()
        self.commits[commit] = files
        self.repos.setdefault(repo, {})[branch] = commit
        return commit

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
