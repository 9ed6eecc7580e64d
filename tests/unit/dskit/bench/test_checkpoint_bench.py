"""`dskit bench --checkpoint_mb`: bad sizes refused in one line before any rank starts, and a small real run (2
spawned gloo ranks saving and verifying a 1 MB tag both ways) that prints the table and writes the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit import cli


@pytest.mark.parametrize("sizes", ["0", "ten", ","])
def test_bad_sizes_are_one_line(sizes: str, capsys) -> None:
    assert cli.main(["bench", "--checkpoint_mb", sizes]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and f"--checkpoint_mb {sizes}" in err[0] and "e.g. --checkpoint_mb 100,1000" in err[0]
    )


def test_a_small_run_times_both_methods_and_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ckpt.json"
    argv = [
        "bench",
        "--checkpoint_mb",
        "1",
        "--repeats",
        "1",
        "--work_dir",
        str(tmp_path / "w"),
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert (
        "save before" in table and "verify now" in table and "busiest rank" in table and "(2 ranks;" in table
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mb"] == 1 and row["tag_mb"] > 1  # the shards, rank 0's model states and the protocol's files
    assert all(
        row[f"{k}{cpu}"] > 0
        for k in ("save_before", "save_now", "verify_before", "verify_now")
        for cpu in ("", "_cpu")
    )
    assert list((tmp_path / "w").iterdir()) == []  # the tags are removed
