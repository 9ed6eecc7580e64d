"""A recording HTTP proxy on loopback in front of the moto server, for SageMaker's JSON API.

Tests point AWS_ENDPOINT_URL_SAGEMAKER at it (S3 and CloudWatch Logs still go straight to moto), so they see the
requests exactly as botocore sent them: moto keeps no `Environment` of a training job and replaces its
`MetricDefinitions`, so its DescribeTrainingJob cannot show them. `fake` answers an operation here instead of
moto: moto 5.2.5 answers StopTrainingJob with 500 NotImplemented, and always reports jobs as Completed, which a
test of `stop` must change (`rewrite`). Everything else is forwarded unchanged.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from support.ports import free_port


class SageMakerProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream)
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (operation, JSON body), in order
        self.fake: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}
        self.rewrite: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                operation = self.headers.get("X-Amz-Target", "").split(".")[-1]
                request = json.loads(body or b"{}")
                proxy.requests.append((operation, request))
                if operation in proxy.fake:
                    self._answer(200, json.dumps(proxy.fake[operation](request)).encode(), {})
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                conn.request("POST", self.path, body, dict(self.headers))
                response = conn.getresponse()
                data = response.read()
                if operation in proxy.rewrite and response.status == 200:
                    data = json.dumps(proxy.rewrite[operation](json.loads(data))).encode()
                self._answer(response.status, data, dict(response.getheaders()))
                conn.close()

            def _answer(self, status: int, data: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("Content-Type", headers.get("Content-Type", "application/x-amz-json-1.1"))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def sent(self, operation: str) -> list[dict[str, Any]]:
        return [body for op, body in self.requests if op == operation]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
