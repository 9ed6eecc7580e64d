"""Validation as a run reports it: `--validation_batches all` reads every validation block once, shared out over
the ranks, and its loss (a token-weighted mean over all ranks) equals the same pass on one rank, under ZeRO-3
and FSDP (ranks of the rank pool, nothing trained: the same weights at any world size); and the real
Trainer in this process logs what a validation covered and records it in the metrics file. The sharding and the
line alone: tests/unit/data/test_sampler.py, tests/unit/observe/test_step_line.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_utils.observe import step_line
from support.rank_pool import REPO, train
from support.small_trainer import make_trainer

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "support" / "validation_loss.py"
# 64-token blocks of the embedded corpus with 0.3% held out (14 validation blocks), in micro-batches of 8: one for
# each of 2 ranks. A rank one batch short, which repeats a batch that counts for nothing: tests/unit/data/
# test_sampler.py.
FLAGS = ["--seq_length", "64", "--micro_batch_size", "8", "--validation_fraction", "0.003",
         "--validation_batches", "all", "--metrics_file", "none"]  # fmt: skip
# ZeRO-2 runs the whole model on each rank, as one rank does: ZeRO-3 and FSDP, which gather the weights in every
# forward (each rank must run as many), are the engines whose full pass can go wrong.
ENGINES = {
    "zero3": ["--deepspeed_config", str(REPO / "deepspeed" / "ds_config_zero3.json")],
    "fsdp": ["--backend", "fsdp"],
}


def full_pass(tmp_path: Path, nproc: int, engine: str) -> dict:
    out = tmp_path / f"{engine}-{nproc}.json"
    flags = [*FLAGS, *ENGINES[engine], "--data_cache_dir", str(tmp_path / "cache"),
             "--checkpoint_dir", str(tmp_path / f"ck-{engine}-{nproc}")]  # fmt: skip
    train([str(out), *flags], script=SCRIPT, nproc=nproc)
    return json.loads(out.read_text())


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_full_pass_on_two_ranks_is_the_loss_of_the_whole_set(tmp_path: Path, engine: str) -> None:
    one, two = full_pass(tmp_path, 1, engine), full_pass(tmp_path, 2, engine)
    blocks = one["total_blocks"]
    assert blocks >= 8 and one["blocks"] == blocks == two["blocks"] == two["total_blocks"], (one, two)
    assert one["tokens"] == two["tokens"] == blocks * 64
    assert two["loss"] == one["loss"], (one, two)  # exactly: the same batches, summed without rounding


def test_the_trainer_logs_and_records_what_its_validation_covered(
    tmp_path: Path, single_rank, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    trainer = make_trainer(
        tmp_path, single_rank, "--validation_fraction", "0.003", "--validation_batches", "all",
        "--validation_freq", "3", "--metrics_file", str(metrics),
    )  # fmt: skip
    try:
        trainer.fit()
    finally:
        trainer.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "Validation Loss" in line]
    assert len(lines) == 1, lines
    blocks = len(trainer.run.val_blocks)
    assert lines[0].endswith(f"| {blocks:,} of {blocks:,} blocks ({blocks * 32:,} tokens)"), lines
    [record] = [json.loads(r) for r in metrics.read_text().splitlines() if "val_loss" in r]
    assert (record["val_blocks"], record["val_total_blocks"], record["val_tokens"]) == (
        blocks,
        blocks,
        blocks * 32,
    )
    parsed = step_line.parse(lines[0])
    assert parsed is not None and parsed["val_blocks"] == blocks and parsed["val_tokens"] == blocks * 32
    assert parsed["val_loss"] == pytest.approx(record["val_loss"], abs=5e-5)
