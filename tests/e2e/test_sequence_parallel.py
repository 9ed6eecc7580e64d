"""--sequence_parallel on real DeepSpeed ranks (gloo, ZeRO-2, bf16): 2 ranks that share each sequence train, save,
resume and validate as the 2 data-parallel ranks of the session's reference run (support/reference_runs.py) do.
The step's exact equality (loss and gradients in fp32) is tests/e2e/test_step_loss.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.metrics_file import step_records
from support.rank_pool import train
from support.reference_runs import HALF, STEPS, Reference, copy_tags

pytestmark = pytest.mark.e2e

# The reference's step (micro batch 2 x accumulation 2 x 2 ranks) as one group of 2 ranks: accumulation 4.
SHARED = ["--sequence_parallel", "2", "--gradient_accumulation_steps", "4"]


def validation_losses(path: Path) -> dict[int, float]:
    records = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def test_a_run_changes_sequence_parallelism_on_resume_and_trains_as_the_uninterrupted_run(
    deepspeed_reference: Reference, tmp_path: Path
) -> None:
    """1 -> 2 -> 1: the reference's step-4 checkpoint (data parallel) resumed with 2 ranks sharing each sequence to
    step 8; its step-6 checkpoint resumed data parallel again to step 8, and by 4 ranks in 2 groups of 2. Every step's loss, lr, gradient norm (the clipping's) and data position are
    the uninterrupted run's (within 1e-4, as the reference's own resumed twin)."""
    ref = deepspeed_reference
    shared = ref.copy(tmp_path / "shared", HALF, latest=True)
    log = train([*ref.run_flags(shared, tmp_path / "shared.jsonl"), *SHARED], tmp_path)
    assert "1 group of 2 ranks sharing each sequence x micro batch 2 x accumulation 4 x 64 tokens" in log
    assert "tiny_qwen3-4steps at step 4 (epoch 0, block 32" in log
    back = copy_tags(shared, tmp_path / "back", "tiny_qwen3-6steps", latest=True)
    log = train(ref.run_flags(back, tmp_path / "back.jsonl"), tmp_path)
    assert "tiny_qwen3-6steps at step 6 (epoch 0, block 48" in log
    # ... and on 4 ranks, 2 groups of 2: another world size, through DeepSpeed's universal checkpoint.
    wider = copy_tags(shared, tmp_path / "wider", "tiny_qwen3-6steps", latest=True)
    flags = [*ref.run_flags(wider, tmp_path / "wider.jsonl"), "--sequence_parallel", "2"]
    log = train(flags, tmp_path, nproc=4)
    assert (
        "world size changed from 2 to 4: resuming optimizer and lr schedule state through DeepSpeed's" in log
    )
    assert "2 groups of 2 ranks sharing each sequence x micro batch 2 x accumulation 2" in log
    full = ref.straight_records()
    for name, steps in (("shared", [5, 6, 7, 8]), ("back", [7, 8]), ("wider", [7, 8])):
        again = step_records(tmp_path / f"{name}.jsonl")
        assert sorted(again) == steps, name
        for step, record in again.items():
            assert record["loss"] == pytest.approx(full[step]["loss"], abs=1e-4), (name, step)
            assert record["lr"] == pytest.approx(full[step]["lr"], rel=1e-6)
            assert record["grad_norm"] == pytest.approx(full[step]["grad_norm"], rel=1e-3), (name, step)
            assert record["tokens_seen"] == full[step]["tokens_seen"]
            assert (record["epoch"], record["consumed"]) == (full[step]["epoch"], full[step]["consumed"])


def test_validation_under_sequence_parallelism_measures_what_the_data_parallel_run_did(
    deepspeed_reference: Reference, tmp_path: Path
) -> None:
    """The reference's last checkpoint validated by 2 ranks sharing each sequence: the blocks the data-parallel run
    read at step 8 (8 micro-batches on each of its 2 ranks: 16 on the one group), the same loss."""
    ref = deepspeed_reference
    ckpt = ref.copy(tmp_path / "ck", f"tiny_qwen3-{STEPS}steps", latest=True)
    metrics = tmp_path / "m.jsonl"
    flags = [
        *ref.run_flags(ckpt, metrics),
        *SHARED,
        "--validation_only",
        "true",
        "--validation_batches",
        "16",
    ]
    train(flags, tmp_path)
    (measured,) = validation_losses(metrics).values()
    assert measured == pytest.approx(validation_losses(ref.work / "straight.jsonl")[STEPS], abs=1e-5)


def test_fsdp_ranks_share_sequences_and_resume_as_the_uninterrupted_run(
    fsdp_reference: Reference, tmp_path: Path
) -> None:
    """FSDP2: the FSDP reference's step-4 checkpoint (DCP shards, data parallel) resumed by 2 ranks sharing each
    sequence trains steps 5-8 as the uninterrupted run did (bf16: within 1e-4)."""
    ref = fsdp_reference
    ckpt = ref.copy(tmp_path / "ck", HALF, latest=True)
    log = train([*ref.run_flags(ckpt, tmp_path / "m.jsonl"), *SHARED], tmp_path)
    assert (
        "with FSDP2 for 8 steps: 1 group of 2 ranks sharing each sequence x micro batch 2 x accumulation 4"
        in log
    )
    full, again = ref.straight_records(), step_records(tmp_path / "m.jsonl")
    assert sorted(again) == [5, 6, 7, 8]
    for step, record in again.items():
        assert record["loss"] == pytest.approx(full[step]["loss"], abs=1e-4), step
        assert record["grad_norm"] == pytest.approx(full[step]["grad_norm"], rel=1e-3), step
        assert (record["epoch"], record["consumed"]) == (full[step]["epoch"], full[step]["consumed"])
