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


# --- checksums by the writing ranks, verification by every rank ------------------------------------------


@pytest.mark.parametrize(
    ("rel", "rank"),
    [
        ("rng_state_rank3.pt", 3),
        ("launch.json", 0),
        ("hf_config/config.json", 0),
        (MODEL_STATES, 0),
        ("bf16_zero_pp_rank_5_mp_rank_00_optim_states.pt", 5),
        ("zero_pp_rank_2_mp_rank_00_model_states.pt", 2),
        ("zero_to_fp32.py", None),  # an engine's file it does not name: rank 0 hashes it after the barrier
    ],
)
def test_each_file_of_a_deepspeed_tag_has_its_writer(rel: str, rank: int | None) -> None:
    assert protocol.writer_rank(DeepSpeedEngine, rel) == rank


@pytest.mark.parametrize(
    ("rel", "rank"),
    [("dcp/__7_0.distcp", 7), ("dcp/.metadata", 0), ("fsdp_client_state.pt", 0), ("rng_state_rank1.pt", 1)],
)
def test_each_file_of_an_fsdp_tag_has_its_writer(rel: str, rank: int | None) -> None:
    from model_utils.engines.fsdp_engine import FsdpEngine

    assert protocol.writer_rank(FsdpEngine, rel) == rank


@pytest.mark.parametrize("layout", ["deepspeed", "fsdp"])
def test_a_save_hashes_each_file_once_where_it_was_written(
    layout: str, gloo_rank, tmp_path: Path, monkeypatch
) -> None:
    """No second pass: every file is hashed once, by its writer right after the write (digest_written), except a
    file no writer claims, which rank 0 hashes after the barrier; the manifest then verifies."""
    from model_utils.storage import file_manifest
    from support.fake_engine_save import FakeEngine, SavedAsJson

    class WithAStrayFile(FakeEngine):
        def save(self, tag_dir: Path, client_state: dict) -> None:
            super().save(tag_dir, client_state)
            (tag_dir / "stray.txt").write_text("a file the engine does not name")

    hashed: list[str] = []
    real = file_manifest.digest_written

    def counted(path: Path) -> dict:
        hashed.append(str(path.relative_to(tmp_path / ".staging-tiny_qwen3-2steps")))
        return real(path)

    monkeypatch.setattr(file_manifest, "digest_written", counted)
    monkeypatch.setattr(file_manifest, "file_digest", lambda p: pytest.fail(f"{p} read a second time"))
    request = protocol.SaveRequest(str(tmp_path), "tiny_qwen3-2steps", 2, {"step": 2}, {}, {"world_size": 1})
    final = protocol.save(WithAStrayFile(0, layout), request, 0, SavedAsJson("config"), SavedAsJson("tok"))
    assert final is not None
    files = sorted(file_manifest.read(final)["files"])
    assert sorted(hashed) == files  # each once
    assert hashed[-1] == "stray.txt"  # the unclaimed one last: by rank 0, after every rank's own files
    monkeypatch.undo()
    assert file_manifest.verify(final) is None


def test_resume_candidates_verified_in_parallel_are_not_read_again(
    gloo_rank, tmp_path: Path, monkeypatch, capsys
):
    from model_utils.storage import file_manifest

    older = fake_tag(tmp_path, 10)
    newest = fake_tag(tmp_path, 20)
    protocol.verify_in_parallel(str(tmp_path))
    monkeypatch.setattr(file_manifest, "file_digest", lambda p: pytest.fail(f"{p} read again by rank 0"))
    assert protocol.select_resume(str(tmp_path), None).path == newest
    monkeypatch.undo()
    # A bad newest tag: the ranks go on to the older one; rank 0's own check names the bad file, and skips it.
    shard = newest / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"y" * 1000)
    protocol.verify_in_parallel(str(tmp_path))
    assert protocol.select_resume(str(tmp_path), None).path == older
    assert f"{shard.name} does not match its checksum" in capsys.readouterr().out


def test_a_save_carries_the_chat_template_the_run_trains_with(gloo_rank, tmp_path: Path) -> None:
    """The run's tokenizer (the resolver sets its template: --chat_template, else the tokenizer's own) is saved in
    hf_config/, where every export loads it from, and launch.json records the template for a resume to compare."""
    import json

    from transformers import AutoTokenizer

    from model_utils.assets import CHAT_TEMPLATE_PATH, TOKENIZER_DIR
    from model_utils.checkpoint import launch_record
    from support.fake_engine_save import FakeEngine, SavedAsJson

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.chat_template = CHAT_TEMPLATE_PATH.read_text()
    request = protocol.SaveRequest(str(tmp_path), "tiny_qwen3-2steps", 2, {"step": 2}, {}, {"world_size": 1})
    final = protocol.save(FakeEngine(0, "deepspeed"), request, 0, SavedAsJson("config"), tokenizer)
    saved = AutoTokenizer.from_pretrained(final / protocol.HF_CONFIG_DIR)
    assert saved.chat_template == CHAT_TEMPLATE_PATH.read_text()
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert saved.apply_chat_template(chat, tokenize=False) == "User: Hi\nAssistant: Hello.<|endoftext|>\n"
    launch = json.loads((final / protocol.LAUNCH_FILE).read_text())
    assert launch == {"world_size": 1, launch_record.CHAT_TEMPLATE: CHAT_TEMPLATE_PATH.read_text()}
