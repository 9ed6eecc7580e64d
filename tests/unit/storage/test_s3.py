"""S3 for the kit (storage/s3.py) against a real moto server on loopback: URIs parsed or refused in one line, and
datasets mirrored into the local cache (only what changed downloaded again); no secret in any output. The
checkpoint tier on top of it: tests/unit/checkpoint/test_s3_tier.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from model_utils.errors import ConfigError
from model_utils.storage import s3 as storage_s3
from model_utils.storage.s3 import fetch_dataset, parse_s3_uri
from support.s3_server import S3Env, record_calls

pytestmark = pytest.mark.usefixtures("no_secret_in_output")


GOOD_URIS = [
    ("s3://bucket", ("bucket", "")),
    ("s3://bucket/", ("bucket", "")),
    ("s3://my.bucket-1/a/b/", ("my.bucket-1", "a/b")),
    ("s3://abc/ckpt/run-7", ("abc", "ckpt/run-7")),
]


BAD_URIS = [
    "s3://",
    "s3:///x",
    "http://bucket/x",
    "bucket/x",
    "s3:/bucket",
    "s3://Bucket/x",
    "s3://ab/x",
    "s3://my_bucket/x",
    "s3://-bucket/x",
    "s3://bucket-/x",
    "s3://a..b/x",
    "S3://bucket/x",
    "",
]


@pytest.mark.parametrize(("uri", "expected"), GOOD_URIS)
def test_parse_s3_uri(uri: str, expected: tuple[str, str]) -> None:
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize("uri", BAD_URIS)
def test_parse_s3_uri_rejects(uri: str) -> None:
    with pytest.raises(ConfigError, match=r"S3|bucket") as exc:
        parse_s3_uri(uri)
    assert "\n" not in str(exc.value)


def test_fetch_dataset_caches(s3: S3Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = {
        "train/part-0.jsonl": b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(100)),
        "train/part-1.jsonl": b'{"text": "last"}\n',
        "README.md": b"# data",
    }
    for rel, body in rows.items():
        s3.client.put_object(Bucket=s3.bucket, Key=f"datasets/web/{rel}", Body=body)
    s3.client.put_object(Bucket=s3.bucket, Key="datasets/web2/other.jsonl", Body=b"{}\n")  # not under web/

    # fetch_dataset makes its own client: count the GETs of every client it makes
    records: list[list[tuple[str, dict[str, Any]]]] = []
    real_client = storage_s3.new_client

    def counting_client() -> Any:
        client = real_client()
        records.append(record_calls(client))
        return client

    monkeypatch.setattr(storage_s3, "new_client", counting_client)

    def gets() -> int:
        n = sum(op == "GetObject" for record in records for op, _ in record)
        records.clear()
        return n

    cache = tmp_path / "cache"
    path = fetch_dataset(s3.uri("datasets/web/"), cache)
    assert path == cache / "s3" / s3.bucket / "datasets" / "web"
    assert {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()} == rows
    assert gets() == 3

    assert fetch_dataset(s3.uri("datasets/web"), cache) == path
    assert gets() == 0  # unchanged: nothing downloaded

    s3.client.put_object(Bucket=s3.bucket, Key="datasets/web/train/part-1.jsonl", Body=b'{"text": "new"}\n')
    s3.client.delete_object(Bucket=s3.bucket, Key="datasets/web/README.md")
    fetch_dataset(s3.uri("datasets/web"), cache)
    assert gets() == 1
    assert (path / "train/part-1.jsonl").read_bytes() == b'{"text": "new"}\n'
    assert not (path / "README.md").exists()

    single = fetch_dataset(s3.uri("datasets/web/train/part-0.jsonl"), cache)
    assert single.is_file() and single.read_bytes() == rows["train/part-0.jsonl"]

    with pytest.raises(ConfigError, match="no objects under"):
        fetch_dataset(s3.uri("datasets/nothing-here"), cache)
    with pytest.raises(ConfigError, match="does not exist"):
        fetch_dataset("s3://no-such-bucket-dskit/data", cache)
