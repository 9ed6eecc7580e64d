"""S3 for the kit: one client configuration (retries, timeouts, pooled parts), URIs, errors as one line, and
datasets mirrored into the local cache.

The endpoint, region and credentials come from the standard AWS sources (env vars such as AWS_ENDPOINT_URL,
~/.aws, the instance role); this module never prints the client, the environment or raw exception objects,
so no secret can leak into the logs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from model_utils.errors import ConfigError
from model_utils.observe.log import print0
from model_utils.storage import file_manifest

T = TypeVar("T")

# S3's rules for (new) bucket names: 3-63 lowercase letters, digits, dots, hyphens; alphanumeric at both ends.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
MB = 1 << 20
# botocore retries every single request (each multipart part too) on throttling, 5xx and connection errors;
# this counts all attempts, the first one included.
API_ATTEMPTS = 8
# Our own loop around whole-file transfers catches what is left (e.g. a connection dropped for longer than
# botocore's backoff covers); bounded so a dead endpoint costs minutes, not hours.
FILE_ATTEMPTS = 4
BACKOFF_S = 2.0
# Parts of 16 MiB, 8 in flight: saturates a p5 node's NIC on multi-GB shards; s3transfer enlarges the part
# size by itself when a file would need more than S3's 10,000 parts.
TRANSFER = TransferConfig(
    multipart_threshold=16 * MB,
    multipart_chunksize=16 * MB,
    max_concurrency=8,
    preferred_transfer_client="classic",
)
_STATE_SUFFIX = ".dskit-s3-state.json"


class S3TransferError(RuntimeError):
    """A transfer that still failed after all retries (network, permissions); the message is one line."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix/` -> ("bucket", "some/prefix"); ConfigError for anything else."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ConfigError(f"{uri!r} is not an S3 URI: use s3://bucket/prefix")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ConfigError(f"{uri!r} names no bucket: use s3://bucket/prefix")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"{uri!r}: {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, '.', '-')"
        )
    return bucket, prefix.strip("/")


def join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def folder(prefix: str) -> str:
    """The listing prefix of a 'folder': 'a/b' -> 'a/b/' (so 'a/b2' is not matched), '' -> ''."""
    return f"{prefix}/" if prefix else ""


def describe_error(exc: BaseException) -> str:
    """A short, secret-free reason: the S3 error code and message, never the request or the client."""
    if isinstance(exc, S3UploadFailedError) and isinstance(exc.__context__, ClientError):
        exc = exc.__context__
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{err.get('Code', '?')} (HTTP {status}): {err.get('Message', '')}".strip()
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def error_kind(exc: BaseException) -> str:
    """What an S3 failure means, the one decision every caller words in its own terms: "credentials" (none
    found), "no_bucket", "not_found" (no such object), "denied", "unreachable" (network, endpoint) or "other"."""
    if isinstance(exc, NoCredentialsError):
        return "credentials"
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            return "no_bucket"
        if code in ("404", "NoSuchKey") or status == 404:
            return "not_found"
        if status == 403 or code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return "denied"
        return "other"
    if isinstance(exc, BotoCoreError):
        return "unreachable"
    return "other"


def is_permanent(exc: BaseException) -> bool:
    """A 4xx (other than timeout/throttle) or a local file problem will not go away by retrying."""
    if isinstance(exc, S3UploadFailedError) and isinstance(exc.__context__, ClientError):
        exc = exc.__context__
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return 400 <= status < 500 and status not in (408, 429)
    return isinstance(exc, OSError | NoCredentialsError)


def safe_path(root: Path, rel: str) -> Path:
    """root/rel, refusing keys or manifest entries that would escape root ('../', absolute paths)."""
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()) or path == root.resolve():
        raise ConfigError(f"refusing S3 path {rel!r}: it points outside {root}")
    return path


def new_client() -> Any:
    config = Config(
        retries={"total_max_attempts": API_ATTEMPTS, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        # one pooled connection per concurrent part, plus headroom for the listing/head calls
        max_pool_connections=TRANSFER.max_request_concurrency + 4,
    )
    # A fresh session: boto3's default session is not thread-safe, the client itself is.
    return boto3.session.Session().client("s3", config=config)


def fetch_dataset(uri: str, cache_dir: Path) -> Path:
    """Mirror every object under s3://bucket/prefix into cache_dir/s3/<bucket>/<prefix> and return that path.

    Objects whose ETag and size match the last fetch (recorded in `<that path>.dskit-s3-state.json`) are not
    downloaded again; objects gone from S3 are removed locally. A URI naming a single object returns the local
    file instead. Safe to call from several processes on one node (a file lock serialises them).
    """
    bucket, prefix = parse_s3_uri(uri)
    client = new_client()
    dest = Path(cache_dir) / "s3" / bucket / prefix if prefix else Path(cache_dir) / "s3" / bucket
    dest.parent.mkdir(parents=True, exist_ok=True)
    state_path = dest.with_name(dest.name + _STATE_SUFFIX)
    lock_path = dest.with_name(dest.name + ".lock")
    with lock_path.open("w") as lock, _dataset_errors(uri, bucket):
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _mirror(client, uri, bucket, prefix, dest, state_path)


@contextlib.contextmanager
def _dataset_errors(uri: str, bucket: str) -> Iterator[None]:
    """S3 failures reading a dataset, as one line each (botocore has already retried each request)."""
    try:
        yield
    except (BotoCoreError, ClientError) as exc:
        kind = error_kind(exc)
        if kind == "credentials":
            raise ConfigError(
                f"no AWS credentials found to read {uri}: set AWS_* env vars or attach a role"
            ) from None
        if kind == "no_bucket":
            raise ConfigError(f"S3 bucket {bucket} does not exist: fix the dataset URI {uri}") from None
        if kind == "denied":
            raise ConfigError(f"no access to {uri}: check the credentials/role") from None
        raise S3TransferError(f"reading {uri} failed: {describe_error(exc)}") from None


def _list(client: Any, uri: str, bucket: str, prefix: str) -> tuple[dict[str, dict[str, Any]], bool]:
    """relpath -> {"etag", "size", "key"} of the objects under the prefix, and whether the URI names one object."""
    listing_prefix = folder(prefix)
    objects: dict[str, dict[str, Any]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=listing_prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(listing_prefix) :]
            if rel and not rel.endswith("/"):  # skip "folder" marker objects
                objects[rel] = {"etag": obj["ETag"], "size": obj["Size"], "key": obj["Key"]}
    single = False
    if not objects and prefix:
        try:  # s3://bucket/data/train.jsonl: a single object rather than a folder
            head = client.head_object(Bucket=bucket, Key=prefix)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey"):
                raise
        else:
            single = True
            objects[""] = {"etag": head["ETag"], "size": head["ContentLength"], "key": prefix}
    if not objects:
        raise ConfigError(
            f"no objects under {uri}: check the dataset URI (s3://bucket/prefix of the data files)"
        )
    return objects, single


def list_objects(uri: str) -> tuple[str, list[tuple[str, int, str]]]:
    """(bucket, [(key, size, etag), ...] sorted by key) of the objects a dataset URI names."""
    bucket, prefix = parse_s3_uri(uri)
    with _dataset_errors(uri, bucket):
        objects, _ = _list(new_client(), uri, bucket, prefix)
    return bucket, sorted((o["key"], o["size"], o["etag"]) for o in objects.values())


def download_object(bucket: str, key: str, path: Path) -> None:
    uri = f"s3://{bucket}/{key}"
    with _dataset_errors(uri, bucket):
        new_client().download_file(bucket, key, str(path), Config=TRANSFER)


def _mirror(client: Any, uri: str, bucket: str, prefix: str, dest: Path, state_path: Path) -> Path:
    objects, single = _list(client, uri, bucket, prefix)
    try:
        old: dict[str, dict[str, Any]] = json.loads(state_path.read_text())
    except (OSError, json.JSONDecodeError):
        old = {}
    if not single:
        dest.mkdir(parents=True, exist_ok=True)
    fetched = 0
    start = time.monotonic()
    for rel, meta in sorted(objects.items()):
        path = dest if single else safe_path(dest, rel)
        prev = old.get(rel)
        if (
            prev
            and prev["etag"] == meta["etag"]
            and prev["size"] == meta["size"]
            and path.is_file()
            and path.stat().st_size == meta["size"]
        ):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        # download_file writes a temp file and renames it: a killed fetch leaves no truncated data file
        client.download_file(bucket, meta["key"], str(path), Config=TRANSFER)
        fetched += meta["size"]
    for rel in set(old) - set(objects):  # deleted in S3: drop our copy so a save_to_disk dir stays consistent
        with contextlib.suppress(OSError, ConfigError):
            (dest if rel == "" else safe_path(dest, rel)).unlink()
    file_manifest.atomic_write_text(state_path, json.dumps(objects, indent=1, sort_keys=True))
    if fetched:
        took = max(time.monotonic() - start, 1e-9)
        print0(f"fetched {fetched / MB:.1f} MB of {uri} into {dest} ({fetched / MB / took:.1f} MB/s)")
    else:
        print0(f"{uri}: local copy {dest} is up to date")
    return dest
