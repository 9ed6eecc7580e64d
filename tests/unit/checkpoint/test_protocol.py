"""Checkpoints that never lie, on tags built by hand: verified resume falling back past bad tags and a bad
`latest`, a fresh start versus an explicit resume, and rotation (the newest, the protected, universal copies,
every Nth step). The crash tests against real saves are in tests/e2e/test_checkpoints.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.checkpoint import protocol
from model_utils.engines.deepspeed_engine import MODEL_STATES, DeepSpeedEngine
from model_utils.errors import ConfigError
from support.checkpoint_tags import fake_tag


def test_resume_falls_back_past_bad_tags_with_a_warning(tmp_path: Path, capsys) -> None:
    fake_tag(tmp_path, 10)
    good = fake_tag(tmp_path, 20)
    corrupt = fake_tag(tmp_path, 30)
    (corrupt / MODEL_STATES).write_bytes(b"x" * 1000)
    fake_tag(tmp_path, 40, with_manifest=False)  # a save that died before its manifest
    (tmp_path / ".staging-tiny_qwen3-50steps").mkdir()  # and one that died earlier still
    (tmp_path / "latest").write_text("tiny_qwen3-40steps")
    target = protocol.select_resume(str(tmp_path), None)
    assert target is not None and target.path == good
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and "tiny_qwen3-40steps: no readable dskit_manifest.json" in out
    assert "tiny_qwen3-30steps: mp_rank_00_model_states.pt does not match its checksum" in out
    assert "names 'tiny_qwen3-40steps', which is not the newest verified checkpoint" in out


@pytest.mark.parametrize("latest", ["", "tiny_qwen3-2", "garbage\x00\x01"])
def test_empty_or_truncated_latest_falls_back(tmp_path: Path, latest: str, capsys) -> None:
    fake_tag(tmp_path, 1)
    newest = fake_tag(tmp_path, 2)
    (tmp_path / "latest").write_text(latest)
    assert protocol.select_resume(str(tmp_path), None).path == newest
    assert "latest" in capsys.readouterr().out


def test_no_checkpoint_is_a_fresh_start_but_an_explicit_resume_is_an_error(tmp_path: Path) -> None:
    assert protocol.select_resume(str(tmp_path / "nothing-yet"), None) is None
    with pytest.raises(ConfigError, match="holds no verified checkpoint"):
        protocol.select_resume(str(tmp_path), str(tmp_path))
    tag = fake_tag(tmp_path, 5)
    assert protocol.select_resume("unused", str(tag)).path == tag  # a tag dir directly
    (tag / MODEL_STATES).write_bytes(b"")
    with pytest.raises(ConfigError, match="is damaged"):
        protocol.select_resume("unused", str(tag))


def test_rotation_keeps_the_newest_and_the_protected(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        fake_tag(tmp_path, step)
    fake_tag(tmp_path, 60, with_manifest=False)  # unverified: not counted, not deleted by rotation
    deleted = protocol.rotate(tmp_path, keep=2, protect={"tiny_qwen3-10steps"})
    assert sorted(deleted) == ["tiny_qwen3-20steps", "tiny_qwen3-30steps"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["tiny_qwen3-10steps", "tiny_qwen3-40steps", "tiny_qwen3-50steps", "tiny_qwen3-60steps"]


def test_rotation_removes_a_universal_copy_with_its_tag(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        fake_tag(tmp_path, step)
    for step in (10, 20):  # universal copies (a world-size change resumed from them): never resume candidates
        copy = tmp_path / DeepSpeedEngine.converted_tag(f"tiny_qwen3-{step}steps")
        copy.mkdir()
        (copy / MODEL_STATES).write_bytes(b"x")
    assert protocol.select_resume(str(tmp_path), None).tag == "tiny_qwen3-30steps"
    # The run's engine names the copies that go with their tags.
    rotated = protocol.rotate(tmp_path, keep=1, protect={"tiny_qwen3-10steps"}, engine=DeepSpeedEngine)
    assert rotated == ["tiny_qwen3-20steps"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["tiny_qwen3-10steps", "tiny_qwen3-10steps-universal", "tiny_qwen3-30steps"]


def test_rotation_keeps_every_nth_step_permanently(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50, 60):
        fake_tag(tmp_path, step)
    deleted = protocol.rotate(tmp_path, keep=1, protect=set(), keep_every=20)
    assert sorted(deleted) == ["tiny_qwen3-10steps", "tiny_qwen3-30steps", "tiny_qwen3-50steps"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["tiny_qwen3-20steps", "tiny_qwen3-40steps", "tiny_qwen3-60steps"]
    fake_tag(tmp_path, 70)
    assert protocol.rotate(tmp_path, keep=1, protect=set(), keep_every=20) == []  # 60 is a multiple of 20
    assert protocol.rotate(tmp_path, keep=1, protect=set(), keep_every=None) == [
        "tiny_qwen3-60steps", "tiny_qwen3-40steps", "tiny_qwen3-20steps"
    ]  # fmt: skip
