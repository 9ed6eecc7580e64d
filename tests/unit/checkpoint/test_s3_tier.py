"""S3 tier against a real moto server on loopback: manifest-last uploads, complete-tag detection, verified
downloads, retries, access errors, and no secret in any output. URIs and datasets: tests/unit/storage/test_s3.py."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import EndpointConnectionError

from model_utils.checkpoint.s3_tier import S3Tier
from model_utils.errors import ConfigError
from model_utils.storage import file_manifest
from model_utils.storage.s3 import fetch_dataset
from support.s3_server import S3Env, record_calls

pytestmark = pytest.mark.usefixtures("no_secret_in_output")
MB = 1 << 20


def make_tag(root: Path, step: int, big: bool = False, model: str = "tiny_qwen3") -> Path:
    """A fake DeepSpeed tag dir: the real file names, random bytes, and a manifest written last."""
    tag = f"{model}-{step}steps"
    tag_dir = root / tag
    (tag_dir / "hf_config").mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(os.urandom(300_000))
    for rank in range(2):
        size = 20 * MB + 12345 if big and rank == 0 else 150_000  # > multipart threshold: several parts
        (tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(os.urandom(size))
        (tag_dir / f"rng_state_rank{rank}.pt").write_bytes(os.urandom(1500))
    (tag_dir / "hf_config" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tag_dir / "launch.json").write_text(json.dumps({"step": step}))
    file_manifest.write(tag_dir, file_manifest.build(tag_dir, {"tag": tag, "step": step}))
    return tag_dir


def files_of(tag_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tag_dir)): p.read_bytes() for p in sorted(tag_dir.rglob("*")) if p.is_file()}


def test_client_uses_standard_endpoint_and_retries(s3: S3Env) -> None:
    tier = S3Tier(s3.uri("ckpt"))
    assert tier.client.meta.endpoint_url == s3.endpoint  # from AWS_ENDPOINT_URL, nothing dskit-specific
    assert tier.client.meta.config.retries == {"total_max_attempts": 8, "mode": "standard"}
    tier.check_access()


def test_upload_puts_manifest_last(s3: S3Env, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    tag_dir = make_tag(tmp_path, 40, big=True)
    tier = S3Tier(s3.uri("runs/a"))
    manifest_key = f"runs/a/{tag_dir.name}/{file_manifest.MANIFEST}"

    def manifest_absent_before_data(operation: str, params: dict[str, Any]) -> None:
        if operation in ("PutObject", "CompleteMultipartUpload") and params["Key"] != manifest_key:
            assert manifest_key not in s3.keys("runs/a/"), f"manifest already there before {params['Key']}"

    calls = record_calls(tier.client, manifest_absent_before_data)
    started = time.monotonic()
    assert tier.upload_async(tag_dir) is None
    assert time.monotonic() - started < 1.0  # returns at once; the thread does the work
    assert tier.pending() == [tag_dir.name]
    # the same tag again (a re-save): its old manifest must go first, checked by the hook above
    tier.upload_async(tag_dir)
    assert tier.wait() is True
    assert tier.pending() == []

    done = [p["Key"] for op, p in calls if op in ("PutObject", "CompleteMultipartUpload")]
    local = sorted(f"runs/a/{tag_dir.name}/{rel}" for rel in files_of(tag_dir))
    assert len(done) == 2 * len(local)
    assert done[len(local) - 1] == manifest_key and done[-1] == manifest_key
    assert sorted(done[: len(local)]) == local
    assert s3.keys("runs/a/") == local
    assert any(op == "UploadPart" for op, _ in calls), "the 20 MB file should go up in parts"
    big = f"runs/a/{tag_dir.name}/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert s3.client.head_object(Bucket=s3.bucket, Key=big)["ContentLength"] == 20 * MB + 12345
    out = capfd.readouterr().out
    assert f"S3 upload of {tag_dir.name} finished" in out and "MB/s" in out
    print(out)


def test_newest_complete_tag_skips_partial_uploads(s3: S3Env, tmp_path: Path) -> None:
    tier = S3Tier(s3.uri("ckpt"))
    assert tier.newest_complete_tag() is None
    for step in (10, 20):
        tier.upload_async(make_tag(tmp_path, step))
    assert tier.wait()
    # step 30: files up, manifest never made it (an upload killed mid-way)
    partial = make_tag(tmp_path, 30)
    for rel in files_of(partial):
        if rel != file_manifest.MANIFEST:
            s3.client.upload_file(str(partial / rel), s3.bucket, f"ckpt/{partial.name}/{rel}")
    # step 20: a file its manifest lists is gone from S3
    s3.client.delete_object(Bucket=s3.bucket, Key="ckpt/tiny_qwen3-20steps/rng_state_rank1.pt")
    # noise that is not a tag
    s3.client.put_object(Bucket=s3.bucket, Key="ckpt/notes.txt", Body=b"x")
    s3.client.put_object(Bucket=s3.bucket, Key="ckpt/other/x", Body=b"x")
    assert tier.tags() == ["tiny_qwen3-10steps", "tiny_qwen3-20steps", "tiny_qwen3-30steps"]
    assert tier.incomplete_reason("tiny_qwen3-30steps").startswith("no readable")
    assert tier.incomplete_reason("tiny_qwen3-20steps") == "rng_state_rank1.pt is missing"
    assert tier.newest_complete_tag() == "tiny_qwen3-10steps"
    # a wrong size also makes a tag incomplete; the step number, not the name, orders tags (100 > 99)
    tier.upload_async(make_tag(tmp_path, 100))
    tier.upload_async(make_tag(tmp_path, 99))
    assert tier.wait()
    assert tier.newest_complete_tag() == "tiny_qwen3-100steps"
    s3.client.put_object(Bucket=s3.bucket, Key="ckpt/tiny_qwen3-100steps/launch.json", Body=b"{}")
    assert "launch.json has 2 bytes" in tier.incomplete_reason("tiny_qwen3-100steps")
    assert tier.newest_complete_tag() == "tiny_qwen3-99steps"


def test_download_round_trip_and_corruption(s3: S3Env, tmp_path: Path) -> None:
    tag_dir = make_tag(tmp_path / "node-a", 40, big=True)
    tier = S3Tier(s3.uri("ckpt"))
    tier.upload_async(tag_dir)
    assert tier.wait()

    local = tmp_path / "node-b" / "checkpoints"
    got = tier.download(tag_dir.name, local)
    assert got == local / tag_dir.name
    assert files_of(got) == files_of(tag_dir)  # byte-identical, manifest included
    assert file_manifest.verify(got) is None
    assert sorted(p.name for p in local.iterdir()) == [tag_dir.name]  # no staging dir left

    # an unverifiable local dir of the same name is replaced, once the download has verified
    (got / "launch.json").write_text("torn")
    assert tier.download(tag_dir.name, local) == got and file_manifest.verify(got) is None

    # same size, different bytes: only the checksum can tell
    key = f"ckpt/{tag_dir.name}/mp_rank_00_model_states.pt"
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=os.urandom(300_000))
    assert tier.newest_complete_tag() == tag_dir.name  # sizes still match: S3 listing cannot see it...
    fresh = tmp_path / "node-c"
    with pytest.raises(
        ConfigError, match=r"corrupt .*mp_rank_00_model_states\.pt does not match its checksum"
    ):
        tier.download(tag_dir.name, fresh)  # ...but the download verification does
    assert list(fresh.iterdir()) == []  # neither the tag nor the staging dir

    with pytest.raises(ConfigError, match="no readable"):
        tier.download("tiny_qwen3-7steps", fresh)
    assert list(fresh.iterdir()) == []
    with pytest.raises(ConfigError, match="not a checkpoint tag"):
        tier.download("../escape", fresh)


def test_check_access_missing_bucket(s3: S3Env) -> None:
    with pytest.raises(ConfigError) as exc:
        S3Tier("s3://no-such-bucket-dskit/ckpt").check_access()
    assert str(exc.value) == (
        "S3 bucket no-such-bucket-dskit does not exist: create it or fix --s3_checkpoint_uri"
    )


def test_check_access_denied(s3_denied: Any, tmp_path: Path) -> None:
    """A real 403 from moto with IAM enforcement: the user exists but has no policy on the bucket."""
    tier = S3Tier(f"s3://{s3_denied.bucket}/ckpt")
    with pytest.raises(ConfigError) as exc:
        tier.check_access()
    assert str(exc.value) == f"no access to S3 bucket {s3_denied.bucket}: check the credentials/role"
    # an upload that is denied fails for good at once (a 403 is not retried) and wait() says so
    tier = S3Tier(f"s3://{s3_denied.bucket}/ckpt", backoff_s=30)
    tier.upload_async(make_tag(tmp_path, 5))
    started = time.monotonic()
    assert tier.wait() is False
    assert time.monotonic() - started < 20
    assert tier.failed_tags == ["tiny_qwen3-5steps"]
    with pytest.raises(ConfigError, match="no access"):
        fetch_dataset(f"s3://{s3_denied.bucket}/data", tmp_path / "cache")


def test_transient_errors_are_retried(s3: S3Env, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    tag_dir = make_tag(tmp_path, 8)
    tier = S3Tier(s3.uri("ckpt"), backoff_s=0.01)
    failures = {"left": 2}

    def flaky(operation: str, params: dict[str, Any]) -> None:
        if operation == "PutObject" and params["Key"].endswith("launch.json") and failures["left"]:
            failures["left"] -= 1
            raise EndpointConnectionError(endpoint_url=s3.endpoint)

    calls = record_calls(tier.client, flaky)
    tier.upload_async(tag_dir)
    assert tier.wait() is True
    assert failures["left"] == 0
    assert [p["Key"] for op, p in calls if op == "PutObject"].count(f"ckpt/{tag_dir.name}/launch.json") == 3
    assert tier.newest_complete_tag() == tag_dir.name
    out = capfd.readouterr().out
    assert "uploading tiny_qwen3-8steps/launch.json failed (EndpointConnectionError" in out
    assert "retry 2/3" in out
    print(out)


def test_failed_upload_is_reported_not_raised(
    s3: S3Env, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    tier = S3Tier(s3.uri("ckpt"), file_attempts=2, backoff_s=0.01)

    def down(operation: str, params: dict[str, Any]) -> None:
        if operation == "PutObject" and "-6steps/" in params["Key"]:
            raise EndpointConnectionError(endpoint_url=s3.endpoint)

    record_calls(tier.client, down)
    incomplete = make_tag(tmp_path, 5)
    (incomplete / "rng_state_rank0.pt").unlink()  # a local tag that does not verify is never uploaded
    tier.upload_async(incomplete)
    tier.upload_async(make_tag(tmp_path, 6))  # S3 unreachable for this one
    tier.upload_async(make_tag(tmp_path, 7))  # the worker goes on with the next tag
    assert tier.wait() is False
    assert tier.failed_tags == ["tiny_qwen3-5steps", "tiny_qwen3-6steps"]
    assert tier.newest_complete_tag() == "tiny_qwen3-7steps"
    assert s3.keys("ckpt/tiny_qwen3-5steps/") == []
    assert f"ckpt/tiny_qwen3-6steps/{file_manifest.MANIFEST}" not in s3.keys("ckpt/")
    out = capfd.readouterr().out
    assert "rng_state_rank0.pt is missing" in out
    assert f"checkpoint tiny_qwen3-6steps was NOT uploaded to {s3.uri('ckpt')}/tiny_qwen3-6steps" in out
    assert tier.wait() is True  # failures are reported once
    print(out)


def test_wait_with_timeout(s3: S3Env, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    tier = S3Tier(s3.uri("ckpt"))
    gate = threading.Event()
    record_calls(tier.client, lambda op, params: gate.wait(30) if op == "PutObject" else None)
    tier.upload_async(make_tag(tmp_path, 3))
    assert tier.wait(timeout_s=0.2) is False
    assert "not waiting for: tiny_qwen3-3steps" in capfd.readouterr().out
    gate.set()
    assert tier.wait(timeout_s=60) is True
