"""The checksum manifest of a checkpoint tag: what it catches (a missing, short or bit-flipped file, no manifest)."""

from __future__ import annotations

import os
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


def test_build_takes_the_writers_checksums_and_hashes_only_the_rest(tmp_path: Path, monkeypatch) -> None:
    tag = fake_tag(tmp_path, 10, with_manifest=False)
    optim = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    written = {optim: file_manifest.digest_written(tag / optim)}
    read: list[str] = []
    real = file_manifest.digest_written
    monkeypatch.setattr(file_manifest, "digest_written", lambda p: read.append(p.name) or real(p))
    manifest = file_manifest.build(tag, {}, written)
    assert read == ["mp_rank_00_model_states.pt"]  # the file no writer hashed, and only it
    assert manifest["files"][optim] == written[optim]
    file_manifest.write(tag, manifest)
    assert file_manifest.verify(tag) is None
    # A writer's checksum whose size no longer matches the file is not trusted: the file is hashed again.
    stale = {optim: {"size": 1, "xxh3": "0"}}
    assert file_manifest.build(tag, {}, stale)["files"][optim] == written[optim]


def test_files_another_rank_verified_are_not_read_again_while_unchanged(tmp_path: Path, monkeypatch) -> None:
    tag = fake_tag(tmp_path, 10)
    manifest = file_manifest.read(tag)
    problem, keys = file_manifest.check_files(tag, manifest, sorted(manifest["files"]))
    assert problem is None and len(keys) == 2
    file_manifest.remember_verified(keys)
    hashed: list[Path] = []
    real = file_manifest.file_digest
    monkeypatch.setattr(file_manifest, "file_digest", lambda p: hashed.append(p) or real(p))
    assert file_manifest.verify(tag) is None and hashed == []
    shard = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = shard.read_bytes()
    shard.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # rewritten since: its mtime moved, it is read again
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000))
    assert file_manifest.verify(tag) == f"{shard.name} does not match its checksum"
    assert hashed == [shard]


def test_check_files_reports_the_first_bad_file_of_its_share(tmp_path: Path) -> None:
    tag = fake_tag(tmp_path, 10)
    manifest = file_manifest.read(tag)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"short")
    problem, keys = file_manifest.check_files(
        tag, manifest, ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    )
    assert problem is None and len(keys) == 1  # another rank's share: not this one's to read
    problem, _ = file_manifest.check_files(tag, manifest, ["mp_rank_00_model_states.pt"])
    assert problem == "mp_rank_00_model_states.pt has 5 bytes, the manifest says 1000"


def test_checksums_left_to_the_ranks_checks_sizes_only_while_active(tmp_path: Path) -> None:
    tag = fake_tag(tmp_path, 10)
    shard = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = shard.read_bytes()
    shard.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with file_manifest.checksums_left_to_the_ranks():
        assert file_manifest.verify(tag) is None  # the ranks' parallel check is the one that reads it
        shard.write_bytes(data[:10])
        assert file_manifest.verify(tag) == f"{shard.name} has 10 bytes, the manifest says 1000"
    shard.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    assert file_manifest.verify(tag) == f"{shard.name} does not match its checksum"
