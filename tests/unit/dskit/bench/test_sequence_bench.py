"""`dskit bench --sequence_parallel`: bad sizes and lengths that do not split refused in one line before any rank
starts, and a small real run (1 rank, then a group of 2 spawned gloo ranks sharing each sequence) whose measured
peak per rank falls with the group and whose budget search goes past the given lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sequence_parallel", "two"], "--sequence_parallel 'two': give whole numbers, comma-separated (e.g. 1,2)"),
        (["--sequence_parallel", "2", "--seq_lengths", "1025"], "sequence length 1025 does not split into 2 equal "
         "slices (--sequence_parallel 2): set --seq_lengths to a multiple of 2, e.g. 1024"),
        (["--sequence_parallel", "3", "--seq_lengths", "3072"], "--sequence_parallel 3: the model's 4 attention heads do not split 3 ways"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_one_line(argv: list[str], message: str, capsys) -> None:
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_group_of_two_holds_less_per_rank_and_the_budget_search_doubles(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sp.json"
    argv = [
        "bench",
        "--sequence_parallel",
        "1,2",
        "--seq_lengths",
        "2048",
        "--budget_mib",
        "50",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "peak per rank" in table and "longest within 50 MiB per rank with 2 rank(s) per sequence" in table
    rows = {(r["sequence_parallel"], r["seq_length"]): r for r in json.loads(out.read_text())}
    alone, shared = rows[1, 2048], rows[2, 2048]
    assert shared["peak_mib"] == pytest.approx(alone["peak_mib"] / 2, rel=0.1) and shared["seconds"] > 0
    # Past the given length while the step fits the budget: 2 ranks fit 2,048 tokens in 50 MiB, 1 rank does not.
    assert (2, 4096) in rows and (1, 4096) not in rows


@pytest.mark.gpu
def test_on_two_gpus_a_group_of_two_holds_about_half_of_qwen3_at_8k(tmp_path: Path, capsys) -> None:
    """gpu-check's sequence-parallel case: qwen3-0.6b at 8,192 tokens, one rank on one GPU against a group of 2
    ranks on 2 GPUs (NCCL, bf16): the allocator's peak per rank about halves. One GPU cannot hold a group of 2
    (NCCL takes one GPU per rank)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: a group of 2 ranks takes one GPU each")
    out = tmp_path / "sp.json"
    argv = ["bench", "--sequence_parallel", "1,2", "--seq_lengths", "8192", "--model", "qwen3-0.6b"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    print(capsys.readouterr().out)  # the table, in gpu-check's pytest log
    alone, shared = (r["peak_mib"] for r in json.loads(out.read_text()))
    assert shared < 0.65 * alone
