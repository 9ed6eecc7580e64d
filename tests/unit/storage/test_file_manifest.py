"""The checksum manifest of a checkpoint tag: what it catches (a missing, short or bit-flipped file, no manifest)."""

from __future__ import annotations

from pathlib import Path

from model_utils.storage import file_manifest
from support.checkpoint_tags import fake_tag


def test_manifest_detects_missing_short_and_corrupt_files(tmp_path: Path) -> None:
    tag = fake_tag(tmp_path, 10)
    assert file_manifest.verify(tag) is None
    shard = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    assert "does not match its checksum" in file_manifest.verify(tag)
    shard.write_bytes(data[:500])
    assert "has 500 bytes, the manifest says 1000" in file_manifest.verify(tag)
    shard.unlink()
    assert "is missing" in file_manifest.verify(tag)
    (tag / file_manifest.MANIFEST).unlink()
    assert "no readable dskit_manifest.json" in file_manifest.verify(tag)
