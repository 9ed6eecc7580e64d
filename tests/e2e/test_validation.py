"""Validation and samples as a run reports them. `--validation_batches all` reads every validation block once,
shared out over the ranks, and its loss (a token-weighted mean over all ranks) equals the same pass on one rank,
under ZeRO-3 and FSDP (ranks of the rank pool, nothing trained: the same weights at any world size). The same
launches generate from --sample_prompts, whose greedy texts are the same under ZeRO-3 and FSDP on one and two ranks
and under ZeRO-2 (the real Trainer in this process), which also logs and records what a validation covered and its
samples in the metrics file and TensorBoard. The sharding and the lines alone: tests/unit/data/test_sampler.py,
tests/unit/observe/test_step_line.py; the prompts: tests/unit/data/test_prompts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_utils.loop.observers.samples import Samples
from model_utils.observe import step_line
from support.metrics_file import sample_records, tensorboard_scalars, tensorboard_texts
from support.rank_pool import REPO, train
from support.small_trainer import make_trainer

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "support" / "validation_loss.py"
# 64-token blocks of the embedded corpus with 0.3% held out (14 validation blocks), in micro-batches of 8: one for
# each of 2 ranks. A rank one batch short, which repeats a batch that counts for nothing: tests/unit/data/
# test_sampler.py.
# The prompts the docs show (docs/metrics-and-trackers.md#samples); 8 new tokens fit the in-process run's 32-token
# blocks.
PROMPTS_FILE = REPO / "examples" / "sample_prompts.jsonl"
SAMPLE_FLAGS = ["--sample_prompts", str(PROMPTS_FILE), "--sample_max_new_tokens", "8"]
FLAGS = ["--seq_length", "64", "--micro_batch_size", "8", "--validation_fraction", "0.003",
         "--validation_batches", "all", "--metrics_file", "none", *SAMPLE_FLAGS]  # fmt: skip
# ZeRO-2 runs the whole model on each rank, as one rank does: ZeRO-3 and FSDP, which gather the weights in every
# forward (each rank must run as many), are the engines whose full pass can go wrong.
ENGINES = {
    "zero3": ["--deepspeed_config", str(REPO / "deepspeed" / "ds_config_zero3.json")],
    "fsdp": ["--backend", "fsdp"],
}


@pytest.fixture(scope="module")
def full_passes(tmp_path_factory: pytest.TempPathFactory):
    """full_pass(nproc, engine): what validation_loss.py measured, each launch run once for the module's tests."""
    tmp_path = tmp_path_factory.mktemp("full-passes")
    done: dict[tuple[int, str], dict] = {}

    def full_pass(nproc: int, engine: str) -> dict:
        if (nproc, engine) not in done:
            out = tmp_path / f"{engine}-{nproc}.json"
            flags = [*FLAGS, *ENGINES[engine], "--data_cache_dir", str(tmp_path / "cache"),
                     "--checkpoint_dir", str(tmp_path / f"ck-{engine}-{nproc}")]  # fmt: skip
            train([str(out), *flags], script=SCRIPT, nproc=nproc)
            done[nproc, engine] = json.loads(out.read_text())
        return done[nproc, engine]

    return full_pass


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_full_pass_on_two_ranks_is_the_loss_of_the_whole_set(full_passes, engine: str) -> None:
    one, two = full_passes(1, engine), full_passes(2, engine)
    blocks = one["total_blocks"]
    assert blocks >= 8 and one["blocks"] == blocks == two["blocks"] == two["total_blocks"], (one, two)
    assert one["tokens"] == two["tokens"] == blocks * 64
    assert two["loss"] == one["loss"], (one, two)  # exactly: the same batches, summed without rounding


def test_the_trainer_logs_and_records_its_validation_and_samples_the_same_under_every_engine(
    tmp_path: Path, single_rank, full_passes, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    trainer = make_trainer(
        tmp_path, single_rank, "--validation_fraction", "0.003", "--validation_batches", "all",
        "--validation_freq", "3", "--metrics_file", str(metrics), *SAMPLE_FLAGS, "--sample_every", "2",
        "--report_to", "tensorboard", "--report_dir", str(tmp_path / "logs"),
    )  # fmt: skip
    try:
        [sampler] = [o for o in trainer.hooks.observers if isinstance(o, Samples)]
        seed_samples = (
            sampler.generate()
        )  # the seed's weights under ZeRO-2 (the default config), as the pool's
        trainer.fit()
    finally:
        trainer.close()
    assert len(seed_samples) == 2 and all(seed_samples), seed_samples
    for nproc, engine in [(1, "zero3"), (2, "zero3"), (1, "fsdp"), (2, "fsdp")]:
        assert full_passes(nproc, engine)["samples"] == seed_samples, (nproc, engine)

    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "Validation Loss" in line]
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

    # Samples after step 2 (--sample_every) and after the last, step 3: in the log, the metrics file, TensorBoard.
    assert "Samples at step 2: 2 prompts in " in out and "Samples at step 3: 2 prompts in " in out
    samples = sample_records(metrics)
    assert sorted(samples) == [2, 3]
    for record in samples.values():
        assert [s["prompt"] for s in record["samples"]] == [
            "Once upon a time",
            "Tom and his dog went to the park. They",
        ]
        assert all(s["text"] for s in record["samples"]) and record["sample_s"] > 0
    [run_dir] = (tmp_path / "logs" / "tensorboard").iterdir()
    texts = tensorboard_texts(run_dir, "samples")
    assert sorted(texts) == [2, 3]
    for step, text in texts.items():
        for sample in samples[step]["samples"]:
            assert f"| {sample['prompt']} | {sample['text']} |" in text, text
    assert [step for step, _ in tensorboard_scalars(run_dir)["samples/seconds"]] == [2, 3]
