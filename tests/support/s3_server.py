"""A real moto S3 server (a subprocess speaking HTTP on 127.0.0.1) for tests; nothing leaves the machine.

Its fixtures reach every test through tests/conftest.py.

`moto_endpoint` (session) starts `moto_server` on a free loopback port and stops it at the end; `s3` (per test)
points boto3 at it through the standard AWS_ENDPOINT_URL variable, sets fake credentials and creates a fresh
bucket, so tests never see each other's objects. `no_secret_in_output` checks that the fake secret reaches no
output or log record (a test module of S3 code uses it on every test: pytestmark); `record_calls` records a boto3
client's API calls.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support.ports import free_port

# Distinctive, so a test can assert that it never shows up in any output or log line.
FAKE_SECRET = "dskit-FAKE-secret-9f3c2a7e5b"
FAKE_KEY_ID = "AKIADSKITTESTKEY0001"
MOTO_SERVER = Path(sys.executable).with_name("moto_server")
_bucket_ids = itertools.count()


class MotoServer:
    """`moto_server -H 127.0.0.1 -p PORT` as a subprocess; start() waits until it answers HTTP."""

    def __init__(self, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)  # noqa: SIM115
        # Only what moto needs: no real AWS variables from the developer's shell reach the server.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(extra_env or {})
        self.proc = subprocess.Popen(
            [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer (even 403 from an auth-enabled server) means it is up
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"moto_server did not answer on {self.url} within {timeout_s:.0f}s: {self.log_tail()}"
        )

    def log_tail(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def start_moto(extra_env: dict[str, str] | None = None) -> MotoServer:
    server = MotoServer(extra_env)
    server.wait_ready()
    return server


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    server = start_moto()
    try:
        yield server.url
    finally:
        server.stop()


@dataclass
class S3Env:
    endpoint: str
    bucket: str
    client: Any  # a boto3 S3 client for the test's own setup and checks

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def point_boto3_at(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, key_id: str = FAKE_KEY_ID, secret: str = FAKE_SECRET
) -> None:
    """The standard variables only: the code under test must find the endpoint the way it would on AWS."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # no ~/.aws of the developer's
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    import boto3

    point_boto3_at(monkeypatch, moto_endpoint)
    client = boto3.session.Session().client("s3")
    bucket = f"dskit-test-{os.getpid()}-{next(_bucket_ids)}"
    client.create_bucket(Bucket=bucket)
    return S3Env(endpoint=moto_endpoint, bucket=bucket, client=client)


@dataclass
class DeniedS3:
    endpoint: str
    bucket: str  # exists, but the credentials in the environment may not touch it
    key_id: str
    secret: str


@pytest.fixture(scope="session")
def denied_server() -> Iterator[DeniedS3]:
    """A second moto server that enforces IAM: a bucket exists, and a user without any policy gets a real 403.

    moto lets the first INITIAL_NO_AUTH_ACTION_COUNT requests through unauthenticated; we spend exactly those
    three on creating the bucket, the user and the user's key.
    """
    import boto3

    server = start_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
        admin = {
            "endpoint_url": server.url,
            "region_name": "us-east-1",
            "aws_access_key_id": FAKE_KEY_ID,
            "aws_secret_access_key": "admin-not-checked",
        }
        session = boto3.session.Session()
        session.client("s3", **admin).create_bucket(Bucket="dskit-locked")
        iam = session.client("iam", **admin)
        iam.create_user(UserName="no-perms")
        key = iam.create_access_key(UserName="no-perms")["AccessKey"]
        yield DeniedS3(server.url, "dskit-locked", key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        server.stop()


@pytest.fixture
def s3_denied(denied_server: DeniedS3, monkeypatch: pytest.MonkeyPatch) -> DeniedS3:
    """Environment set to a valid IAM user that has no permission on `bucket` (S3 answers 403)."""
    point_boto3_at(monkeypatch, denied_server.endpoint, denied_server.key_id, denied_server.secret)
    return denied_server


def record_calls(client: Any, hook: Any = None) -> list[tuple[str, dict[str, Any]]]:
    """Wrap every API call of a boto3 client (all generated methods go through _make_api_call)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    real = client._make_api_call
    lock = threading.Lock()

    def wrapped(operation: str, params: dict[str, Any]) -> Any:
        with lock:
            calls.append((operation, params))
        if hook is not None:
            hook(operation, params)
        return real(operation, params)

    client._make_api_call = wrapped
    return calls


@pytest.fixture
def no_secret_in_output(
    request: pytest.FixtureRequest, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> Any:
    """Every test here also checks that the secret key reaches neither stdout/stderr nor any log record,
    with botocore logging at DEBUG (its most talkative: request headers, retries)."""
    caplog.set_level(logging.DEBUG, logger="botocore")
    caplog.set_level(logging.DEBUG, logger="s3transfer")
    yield
    out, err = capfd.readouterr()
    logged = "\n".join(r.getMessage() for phase in ("setup", "call") for r in caplog.get_records(phase))
    # (monkeypatch has already restored the environment here: take the denied user's secret from its fixture)
    denied = request.node.funcargs.get("s3_denied")
    secrets = {FAKE_SECRET, *([denied.secret] if denied else [])}
    for secret in secrets:
        assert secret not in out + err
        assert secret not in logged
    if "s3" in request.fixturenames:
        assert "Sending http request" in logged  # the DEBUG capture did see botocore's traffic
    print(out, end="")  # show it again for -s and failure reports
