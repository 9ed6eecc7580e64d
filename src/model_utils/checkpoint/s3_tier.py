"""Checkpoints and datasets in S3: background upload of verified tags, resume from the newest complete one.

A tag in S3 is complete only when `<prefix>/<tag>/dskit_manifest.json` exists and every file it lists is there
with the listed size. The manifest is uploaded LAST (and any old one deleted FIRST), so an interrupted upload
is never taken for a complete checkpoint. Downloads land in a staging dir, are checked with `file_manifest.verify`
(sizes and xxh3) and only then renamed into place.

The endpoint, region and credentials come from the standard AWS sources (env vars such as AWS_ENDPOINT_URL,
~/.aws, the instance role); this module never prints the client, the environment or raw exception objects,
so no secret can leak into the logs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import queue
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from model_utils.errors import ConfigError
from model_utils.observe.log import print0, warn0
from model_utils.storage import file_manifest

T = TypeVar("T")

# S3's rules for (new) bucket names: 3-63 lowercase letters, digits, dots, hyphens; alphanumeric at both ends.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_TAG_STEP_RE = re.compile(r"-(\d+)steps$")
_MB = 1 << 20
# botocore retries every single request (each multipart part too) on throttling, 5xx and connection errors;
# this counts all attempts, the first one included.
_API_ATTEMPTS = 8
# Our own loop around whole-file transfers catches what is left (e.g. a connection dropped for longer than
# botocore's backoff covers); bounded so a dead endpoint costs minutes, not hours.
_FILE_ATTEMPTS = 4
_BACKOFF_S = 2.0
# Parts of 16 MiB, 8 in flight: saturates a p5 node's NIC on multi-GB shards; s3transfer enlarges the part
# size by itself when a file would need more than S3's 10,000 parts.
_TRANSFER = TransferConfig(
    multipart_threshold=16 * _MB,
    multipart_chunksize=16 * _MB,
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


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def _folder(prefix: str) -> str:
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


def _is_permanent(exc: BaseException) -> bool:
    """A 4xx (other than timeout/throttle) or a local file problem will not go away by retrying."""
    if isinstance(exc, S3UploadFailedError) and isinstance(exc.__context__, ClientError):
        exc = exc.__context__
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return 400 <= status < 500 and status not in (408, 429)
    return isinstance(exc, OSError | NoCredentialsError)


def _safe_path(root: Path, rel: str) -> Path:
    """root/rel, refusing keys or manifest entries that would escape root ('../', absolute paths)."""
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()) or path == root.resolve():
        raise ConfigError(f"refusing S3 path {rel!r}: it points outside {root}")
    return path


def _client() -> Any:
    config = Config(
        retries={"total_max_attempts": _API_ATTEMPTS, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        # one pooled connection per concurrent part, plus headroom for the listing/head calls
        max_pool_connections=_TRANSFER.max_request_concurrency + 4,
    )
    # A fresh session: boto3's default session is not thread-safe, the client itself is.
    return boto3.session.Session().client("s3", config=config)


class S3Tier:
    """Checkpoints under s3://bucket/prefix/<tag>/...; one background uploader thread, FIFO.

    Only one process (global rank 0) should upload; only one process per filesystem should download.
    """

    def __init__(
        self, uri: str, *, file_attempts: int = _FILE_ATTEMPTS, backoff_s: float = _BACKOFF_S
    ) -> None:
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.client = _client()
        self.file_attempts = file_attempts
        self.backoff_s = backoff_s
        self.failed_tags: list[str] = []  # every tag whose upload failed for good, in order
        self._queue: queue.Queue[Path] = queue.Queue()
        self._cond = threading.Condition()
        self._pending: list[str] = []  # queued or uploading, FIFO
        self._reported = 0  # failed_tags already summarised by wait()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- access
    def check_access(self) -> None:
        """Fail fast at start-up (before step 1) when the bucket is missing or not ours."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise self._access_error(exc) from None

    def _access_error(self, exc: BaseException) -> ConfigError:
        kind = error_kind(exc)
        if kind == "credentials":
            return ConfigError(
                "no AWS credentials found for --s3_checkpoint_uri: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE or attach an instance role"
            )
        if kind == "unreachable":
            return ConfigError(
                f"cannot reach S3 for bucket {self.bucket} ({describe_error(exc)}): check the network and AWS_ENDPOINT_URL"
            )
        if kind in ("no_bucket", "not_found"):  # head_bucket answers a missing bucket with a bare 404
            return ConfigError(
                f"S3 bucket {self.bucket} does not exist: create it or fix --s3_checkpoint_uri"
            )
        if kind == "denied":
            return ConfigError(f"no access to S3 bucket {self.bucket}: check the credentials/role")
        return ConfigError(
            f"S3 bucket {self.bucket} is not usable ({describe_error(exc)}): fix --s3_checkpoint_uri"
        )

    # ---------------------------------------------------------------- retries
    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.file_attempts + 1):
            try:
                return fn()
            except (BotoCoreError, ClientError, S3UploadFailedError, OSError) as exc:
                if attempt == self.file_attempts or _is_permanent(exc):
                    raise S3TransferError(f"{what} failed: {describe_error(exc)}") from None
                # exponential backoff with jitter, so N nodes retrying do not hit S3 in lockstep
                delay = self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.0)
                warn0(
                    f"{what} failed ({describe_error(exc)}); retry {attempt}/{self.file_attempts - 1} in {delay:.1f}s"
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- upload
    def upload_async(self, tag_dir: Path) -> None:
        """Queue a verified local tag dir for upload and return at once; the manifest goes up last."""
        tag_dir = Path(tag_dir)
        with self._cond:
            self._pending.append(tag_dir.name)
            if self._thread is None:
                # daemon: a job killed before wait() must not hang on exit; the manifest-last order makes the
                # half-uploaded tag harmless (it is never complete)
                self._thread = threading.Thread(target=self._worker, name="dskit-s3-upload", daemon=True)
                self._thread.start()
        self._queue.put(tag_dir)

    def pending(self) -> list[str]:
        """Tags queued or being uploaded: checkpoint rotation must not delete these local dirs yet."""
        with self._cond:
            return list(self._pending)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every queued upload is done; True when all succeeded.

        Never raises for a failed upload (the training is finished and its local checkpoints are intact): it
        prints one warning line per failed tag and returns False. With timeout_s (e.g. inside a preemption
        grace period) it gives up waiting after that long, names the unfinished tags and returns False.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    warn0(
                        f"S3 upload still running after {timeout_s:.0f}s, not waiting for: {', '.join(self._pending)}"
                    )
                    return False
                self._cond.wait(left)
            new_failures = self.failed_tags[self._reported :]
            self._reported = len(self.failed_tags)
        for tag in new_failures:
            warn0(
                f"checkpoint {tag} was NOT uploaded to {self.uri}/{tag} (see the error above); the local copy is kept"
            )
        return not new_failures

    def _worker(self) -> None:
        while True:
            tag_dir = self._queue.get()
            try:
                self._upload_tag(tag_dir)
            except Exception as exc:  # the thread must survive to upload the next tag
                with self._cond:
                    self.failed_tags.append(tag_dir.name)
                warn0(f"S3 upload of checkpoint {tag_dir.name} failed: {describe_error(exc)}")
            finally:
                with self._cond:
                    self._pending.remove(tag_dir.name)
                    self._cond.notify_all()

    def _upload_tag(self, tag_dir: Path) -> None:
        tag = tag_dir.name
        # sizes only: the checkpoint code has just checksummed it, and reading GBs again would slow the upload
        reason = file_manifest.verify(tag_dir, checksums=False)
        if reason is not None:
            raise S3TransferError(f"{tag_dir} is not a complete checkpoint ({reason})")
        listed = file_manifest.read(tag_dir)
        assert listed is not None  # verify() just read it
        base = _join(self.prefix, tag)
        manifest_key = _join(base, file_manifest.MANIFEST)
        # Re-uploading a tag: drop the old manifest first, or the tag would look complete while its files are
        # being overwritten.
        self._retry(
            f"deleting s3://{self.bucket}/{manifest_key}",
            lambda: self.client.delete_object(Bucket=self.bucket, Key=manifest_key),
        )
        total = sum(meta["size"] for meta in listed["files"].values())
        print0(
            f"S3 upload of {tag} started: {len(listed['files']) + 1} files, {total / _MB:.1f} MB -> {self.uri}/{tag}"
        )
        start = time.monotonic()
        for rel in [*sorted(listed["files"]), file_manifest.MANIFEST]:  # manifest LAST
            path, key = tag_dir / rel, _join(base, rel)
            self._retry(
                f"uploading {tag}/{rel}",
                lambda p=path, k=key: self.client.upload_file(str(p), self.bucket, k, Config=_TRANSFER),
            )
        took = max(time.monotonic() - start, 1e-9)
        print0(
            f"S3 upload of {tag} finished: {total / _MB:.1f} MB in {took:.1f}s ({total / _MB / took:.1f} MB/s)"
        )

    # ---------------------------------------------------------------- resume
    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            yield from page.get("Contents", [])

    def tags(self) -> list[str]:
        """Tag names (`<model>-<N>steps`) directly under the prefix, complete or not, oldest step first."""
        names = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=_folder(self.prefix), Delimiter="/"
        )
        for page in pages:
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"].rstrip("/").rsplit("/", 1)[-1]
                if _TAG_STEP_RE.search(name):
                    names.append(name)
        return sorted(names, key=lambda n: int(_TAG_STEP_RE.search(n).group(1)))  # type: ignore[union-attr]

    def _remote_manifest(self, tag: str) -> tuple[bytes, dict[str, Any]] | None:
        try:
            body = self.client.get_object(
                Bucket=self.bucket, Key=_join(self.prefix, tag, file_manifest.MANIFEST)
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        raw = body["Body"].read()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return (raw, data) if isinstance(data, dict) and isinstance(data.get("files"), dict) else None

    def incomplete_reason(self, tag: str) -> str | None:
        """None when the tag is complete in S3 (manifest + every listed file with its size), else why not."""
        found = self._remote_manifest(tag)
        if found is None:
            return f"no readable {file_manifest.MANIFEST} (an unfinished upload?)"
        base = _join(self.prefix, tag)
        sizes = {obj["Key"]: obj["Size"] for obj in self._objects(base + "/")}  # one listing, not N heads
        for rel, meta in found[1]["files"].items():
            size = sizes.get(_join(base, rel))
            if size is None:
                return f"{rel} is missing"
            if size != meta["size"]:
                return f"{rel} has {size} bytes, the manifest says {meta['size']}"
        return None

    def newest_complete_tag(self) -> str | None:
        """The highest-step complete tag under the prefix, or None; incomplete newer ones are named in the log."""
        for tag in reversed(self.tags()):
            reason = self.incomplete_reason(tag)
            if reason is None:
                return tag
            print0(f"S3 checkpoint {self.uri}/{tag} is incomplete, skipped: {reason}")
        return None

    def download(self, tag: str, local_checkpoint_dir: Path) -> Path:
        """Fetch a tag into local_checkpoint_dir/<tag> via a staging dir; verified (xxh3) before it appears.

        ConfigError when the tag has no manifest or does not verify (nothing is left behind);
        S3TransferError when the transfer itself fails after retries. An existing local dir of the same
        name (an unverifiable local copy) is replaced only once the download has verified.
        """
        if not tag or "/" in tag or tag.startswith("."):
            raise ConfigError(f"{tag!r} is not a checkpoint tag: use a name such as tiny_qwen3-40steps")
        local_checkpoint_dir = Path(local_checkpoint_dir)
        local_checkpoint_dir.mkdir(parents=True, exist_ok=True)
        staging = local_checkpoint_dir / f".s3-download-{tag}"
        final = local_checkpoint_dir / tag
        shutil.rmtree(staging, ignore_errors=True)  # leftovers of a killed download
        staging.mkdir()
        try:
            found = self._retry(f"reading the manifest of {tag}", lambda: self._remote_manifest(tag))
            if found is None:
                raise ConfigError(
                    f"{self.uri}/{tag} has no readable {file_manifest.MANIFEST}: pick a complete tag"
                )
            raw, listed = found
            total = sum(meta["size"] for meta in listed["files"].values())
            print0(f"S3 download of {tag} started: {total / _MB:.1f} MB from {self.uri}/{tag}")
            start = time.monotonic()
            for rel in sorted(listed["files"]):
                dest = _safe_path(staging, rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                key = _join(self.prefix, tag, rel)
                self._retry(
                    f"downloading {tag}/{rel}",
                    lambda k=key, d=dest: self.client.download_file(self.bucket, k, str(d), Config=_TRANSFER),
                )
            (staging / file_manifest.MANIFEST).write_bytes(raw)
            reason = file_manifest.verify(staging)
            if reason is not None:
                raise ConfigError(
                    f"S3 checkpoint {self.uri}/{tag} is corrupt ({reason}): delete it from S3 or resume from "
                    "another tag"
                )
            took = max(time.monotonic() - start, 1e-9)
            print0(
                f"S3 download of {tag} finished: {total / _MB:.1f} MB in {took:.1f}s ({total / _MB / took:.1f} MB/s)"
            )
            if final.exists():
                old = local_checkpoint_dir / f".s3-replaced-{tag}"
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                staging.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(final)
            file_manifest.fsync_dir(local_checkpoint_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final


# -------------------------------------------------------------------- datasets
def fetch_dataset(uri: str, cache_dir: Path) -> Path:
    """Mirror every object under s3://bucket/prefix into cache_dir/s3/<bucket>/<prefix> and return that path.

    Objects whose ETag and size match the last fetch (recorded in `<that path>.dskit-s3-state.json`) are not
    downloaded again; objects gone from S3 are removed locally. A URI naming a single object returns the local
    file instead. Safe to call from several processes on one node (a file lock serialises them).
    """
    bucket, prefix = parse_s3_uri(uri)
    client = _client()
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
    listing_prefix = _folder(prefix)
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
        objects, _ = _list(_client(), uri, bucket, prefix)
    return bucket, sorted((o["key"], o["size"], o["etag"]) for o in objects.values())


def download_object(bucket: str, key: str, path: Path) -> None:
    uri = f"s3://{bucket}/{key}"
    with _dataset_errors(uri, bucket):
        _client().download_file(bucket, key, str(path), Config=_TRANSFER)


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
        path = dest if single else _safe_path(dest, rel)
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
        client.download_file(bucket, meta["key"], str(path), Config=_TRANSFER)
        fetched += meta["size"]
    for rel in set(old) - set(objects):  # deleted in S3: drop our copy so a save_to_disk dir stays consistent
        with contextlib.suppress(OSError, ConfigError):
            (dest if rel == "" else _safe_path(dest, rel)).unlink()
    file_manifest.atomic_write_text(state_path, json.dumps(objects, indent=1, sort_keys=True))
    if fetched:
        took = max(time.monotonic() - start, 1e-9)
        print0(f"fetched {fetched / _MB:.1f} MB of {uri} into {dest} ({fetched / _MB / took:.1f} MB/s)")
    else:
        print0(f"{uri}: local copy {dest} is up to date")
    return dest
