"""`dskit bench --sequence_parallel`: bad sizes and lengths that do not split refused in one line before any rank
starts, and a small real run (1 rank, then a group of 2 spawned gloo ranks sharing each sequence) whose measured
peak per rank falls with the group and whose budget search goes past the given lengths."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dskit import cli
from dskit.bench import sequence_bench


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


def test_a_rank_out_of_gpu_memory_ends_its_groups_lengths_with_a_row_not_a_traceback(tmp_path: Path) -> None:
    """Seen on an H200: qwen3-0.6b at 32,768 tokens on one GPU without checkpointing. A rank cannot run out of GPU
    memory here: the state a rank leaves (what it finished, what it was trying) and spawn's message are written by
    hand."""
    out = tmp_path / "1.json"
    done = {"sequence_parallel": 1, "seq_length": 8192, "peak_mib": 30_000.0, "seconds": 0.9}
    out.write_text(json.dumps({"rows": [done], "trying": 32768}))
    oom = (
        "-- Process 0 terminated with the following error:\n...\ntorch.OutOfMemoryError: CUDA out of memory."
    )
    rows = sequence_bench.rows_after_failure(1, out, oom)
    assert rows == [
        done,
        {
            "sequence_parallel": 1,
            "seq_length": 32768,
            "peak_mib": None,
            "seconds": None,
            "error": "out of memory",
        },
    ]
    assert (
        sequence_bench.rows_after_failure(1, out, "ValueError: something else") is None
    )  # a crash stays one
    text = sequence_bench.table(rows, budget=100_000)
    assert re.search(r"^1 +32,768 +out of memory *$", text, re.M)
    assert "longest within 100,000 MiB per rank with 1 rank(s) per sequence: 8,192 tokens" in text


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
