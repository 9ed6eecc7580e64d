"""A resume with changed settings, against real DeepSpeed loads (the issue's two tracebacks): a cosine checkpoint
resumed with --lr_schedule wsd (optimizer state kept, the new schedule from the loaded step) and a ZeRO-2
checkpoint resumed under ZeRO-3 (the weights alone, from the consolidated masters). Every other cell of the
matrix is refused or handled before anything loads: tests/unit/checkpoint/test_launch_record.py.

One rank in this process (about 3 s a run): a 3-step cosine run saving steps 2 and 3, then two resumes of its
step-2 tag, each with one line saying what it changed and no traceback; and the schedule switch under FSDP, from
the shared FSDP reference run's step-4 tag (tests/support/reference_runs.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from model_utils.config.arguments import parse_args
from model_utils.loop import trainer as training
from model_utils.resolve import resolver
from support.metrics_file import step_records
from support.reference_runs import Reference, copy_tags

REPO = Path(__file__).resolve().parents[2]
ZERO3 = str(REPO / "deepspeed" / "ds_config_zero3.json")
TAG = "tiny_qwen3-2steps"


def _corpus(path: Path, words: str) -> Path:
    """A small corpus (prepared in well under a second, where the embedded one takes seconds)."""
    path.write_text("".join(json.dumps({"text": f"{words}, line {i} " * 8}) + "\n" for i in range(200)))
    return path


def _train(ckpt: Path, metrics: Path, dist, *flags: str) -> str:
    """A one-rank in-process run to step 3, saving every 2 steps; what rank 0 printed (a traceback included)."""
    return _run(
        dist,
        "--seq_length", "32", "--logging_freq", "1", "--checkpoint_freq", "2", "--max_steps", "3",
        "--validation_batches", "1", "--checkpoint_dir", str(ckpt), "--metrics_file", str(metrics), *flags,
    )  # fmt: skip


def _run(dist, *flags: str) -> str:
    cfg = parse_args(list(flags))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        trainer = training.Trainer(resolver.prepare(cfg, world_size=dist.world_size), dist)
        try:
            trainer.fit()
        finally:
            trainer.close()
    return out.getvalue()


@pytest.fixture(scope="module")
def cosine_run(single_rank, tmp_path_factory) -> tuple[Path, Path]:
    """The checkpoint dir of a ZeRO-2 cosine run (the kit's defaults) on a small corpus, and the corpus's
    prepared dir."""
    work = tmp_path_factory.mktemp("cosine")
    corpus = ["--dataset", str(_corpus(work / "corpus.jsonl", "a small corpus"))]
    out = _train(
        work / "ckpt", work / "straight.jsonl", single_rank, "--data_cache_dir", str(work / "cache"), *corpus
    )
    assert "Step 3/3 | Loss" in out, out[-3000:]
    (prepared,) = (work / "cache" / "prepared").iterdir()
    return work, prepared


@pytest.mark.e2e
def test_another_schedule_on_another_dataset_keeps_the_optimizer_and_starts_the_data_over(
    cosine_run, single_rank, tmp_path: Path
) -> None:
    work, _ = cosine_run
    ckpt = copy_tags(work / "ckpt", tmp_path / "ckpt", TAG)
    other = _corpus(tmp_path / "other.jsonl", "another corpus")
    flags = ["--lr_schedule", "wsd", "--dataset", str(other), "--new_data", "true"]
    out = _train(ckpt, tmp_path / "m.jsonl", single_rank, "--data_cache_dir", str(tmp_path / "c"), *flags)
    assert "Traceback" not in out and "Step 3/3 | Loss" in out, out[-3000:]
    lines = [line.split(" | ", 1)[-1] for line in out.splitlines()]
    assert "loaded the weights only" not in out  # the optimizer state came along
    switch = [line for line in lines if line.startswith("lr schedule: --lr_schedule wsd (was cosine)")]
    assert len(switch) == 1 and "from step 3 (cosine's scheduler state not loaded)" in switch[0], switch
    resumed = step_records(tmp_path / "m.jsonl")
    assert switch[0].endswith(f"lr at step 3 {resumed[3]['lr']:.3g}")  # what trained is what was said
    reset = [
        line
        for line in lines
        if line.startswith(f"--new_data: the data changed from {work / 'corpus.jsonl'}")
    ]
    assert len(reset) == 1 and "its position starts over at epoch 0, block 0" in reset[0], reset
    assert f"Resumed from {ckpt / TAG} at step 2 (epoch 0, block 0," in out


@pytest.mark.e2e
def test_a_zero2_checkpoint_resumes_under_zero3_with_its_weights_and_the_same_data_moved(
    cosine_run, single_rank, tmp_path: Path
) -> None:
    """The weights come across exactly (step 3's loss, taken before its update, is the straight run's), and the
    data prepared elsewhere is the same data: its position continues."""
    work, prepared = cosine_run
    ckpt = copy_tags(work / "ckpt", tmp_path / "ckpt", TAG)
    moved = shutil.copytree(prepared, tmp_path / "node-local" / "data")
    out = _train(
        ckpt, tmp_path / "m.jsonl", single_rank, "--deepspeed_config", ZERO3, "--dataset", str(moved)
    )
    assert "Traceback" not in out and "Step 3/3 | Loss" in out, out[-3000:]
    said = [line for line in out.splitlines() if "ZeRO stage changed" in line]
    assert len(said) == 1 and said[0].endswith(
        "ZeRO stage changed from 2 to 3: loaded the weights only (optimizer state starts fresh; the lr schedule "
        "and data position continue)"
    ), said
    assert "--new_data" not in out and "other data" not in out
    straight = step_records(work / "straight.jsonl")
    assert step_records(tmp_path / "m.jsonl")[3]["loss"] == pytest.approx(straight[3]["loss"], rel=1e-3)


@pytest.mark.e2e
def test_another_schedule_under_fsdp_keeps_the_optimizer(
    fsdp_reference: Reference, single_rank, tmp_path: Path
) -> None:
    """The FSDP engine's scheduler too: DCP reads the optimizer's param groups, which a torch LambdaLR (wsd) marks
    with an `initial_lr` DeepSpeed's cosine class never wrote (a `Missing key in checkpoint state_dict` error
    before)."""
    ckpt = fsdp_reference.copy(tmp_path / "ckpt", "tiny_qwen3-4steps")
    metrics = tmp_path / "m.jsonl"
    flags = [*fsdp_reference.run_flags(ckpt, metrics), "--lr_schedule", "wsd", "--max_steps", "5"]
    out = _run(single_rank, *flags)  # the last --max_steps counts
    assert "Traceback" not in out and "Step 5/5 | Loss" in out, out[-3000:]
    assert "loaded the weights only" not in out
    lines = [line.split(" | ", 1)[-1] for line in out.splitlines()]
    switch = [
        line for line in lines if line.startswith("lr schedule: --lr_schedule wsd (was cosine) from step 5")
    ]
    assert len(switch) == 1 and switch[0].endswith(f"lr at step 5 {step_records(metrics)[5]['lr']:.3g}"), (
        switch
    )
