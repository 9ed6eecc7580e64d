"""Checkpoints in S3: background upload of verified tags, resume from the newest complete one.

A tag in S3 is complete only when `<prefix>/<tag>/dskit_manifest.json` exists and every file it lists is there
with the listed size. The manifest is uploaded LAST (and any old one deleted FIRST), so an interrupted upload
is never taken for a complete checkpoint. Downloads land in a staging dir, are checked with `file_manifest.verify`
(sizes and xxh3) and only then renamed into place. The client, URIs and error kinds are storage/s3.py's.
"""

from __future__ import annotations

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

from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import BotoCoreError, ClientError

from model_utils.errors import ConfigError
from model_utils.observe.log import print0, warn0
from model_utils.storage import file_manifest, s3
from model_utils.storage.s3 import S3TransferError, describe_error, error_kind, parse_s3_uri

T = TypeVar("T")
_TAG_STEP_RE = re.compile(r"-(\d+)steps$")


class S3Tier:
    """Checkpoints under s3://bucket/prefix/<tag>/...; one background uploader thread, FIFO.

    Only one process (global rank 0) should upload; only one process per filesystem should download.
    """

    def __init__(
        self, uri: str, *, file_attempts: int = s3.FILE_ATTEMPTS, backoff_s: float = s3.BACKOFF_S
    ) -> None:
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.client = s3.new_client()
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
                if attempt == self.file_attempts or s3.is_permanent(exc):
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
        base = s3.join(self.prefix, tag)
        manifest_key = s3.join(base, file_manifest.MANIFEST)
        # Re-uploading a tag: drop the old manifest first, or the tag would look complete while its files are
        # being overwritten.
        self._retry(
            f"deleting s3://{self.bucket}/{manifest_key}",
            lambda: self.client.delete_object(Bucket=self.bucket, Key=manifest_key),
        )
        total = sum(meta["size"] for meta in listed["files"].values())
        print0(
            f"S3 upload of {tag} started: {len(listed['files']) + 1} files, {total / s3.MB:.1f} MB -> {self.uri}/{tag}"
        )
        start = time.monotonic()
        for rel in [*sorted(listed["files"]), file_manifest.MANIFEST]:  # manifest LAST
            path, key = tag_dir / rel, s3.join(base, rel)
            self._retry(
                f"uploading {tag}/{rel}",
                lambda p=path, k=key: self.client.upload_file(str(p), self.bucket, k, Config=s3.TRANSFER),
            )
        took = max(time.monotonic() - start, 1e-9)
        print0(
            f"S3 upload of {tag} finished: {total / s3.MB:.1f} MB in {took:.1f}s ({total / s3.MB / took:.1f} MB/s)"
        )

    # ---------------------------------------------------------------- resume
    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            yield from page.get("Contents", [])

    def tags(self) -> list[str]:
        """Tag names (`<model>-<N>steps`) directly under the prefix, complete or not, oldest step first."""
        names = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=s3.folder(self.prefix), Delimiter="/"
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
                Bucket=self.bucket, Key=s3.join(self.prefix, tag, file_manifest.MANIFEST)
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
        base = s3.join(self.prefix, tag)
        sizes = {obj["Key"]: obj["Size"] for obj in self._objects(base + "/")}  # one listing, not N heads
        for rel, meta in found[1]["files"].items():
            size = sizes.get(s3.join(base, rel))
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
            print0(f"S3 download of {tag} started: {total / s3.MB:.1f} MB from {self.uri}/{tag}")
            start = time.monotonic()
            for rel in sorted(listed["files"]):
                dest = s3.safe_path(staging, rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                key = s3.join(self.prefix, tag, rel)
                self._retry(
                    f"downloading {tag}/{rel}",
                    lambda k=key, d=dest: self.client.download_file(
                        self.bucket, k, str(d), Config=s3.TRANSFER
                    ),
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
                f"S3 download of {tag} finished: {total / s3.MB:.1f} MB in {took:.1f}s ({total / s3.MB / took:.1f} MB/s)"
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
