"""--backend fsdp in real 2-rank runs on CPU (gloo, FSDP2 with bf16 mixed precision): exact resume, a corrupt
DCP shard falling back to the previous verified tag, world size 2 -> 1 -> 2 resharded by DCP with the optimizer
state kept, and kill -9 during the crash-safe save.

The session's FSDP reference run (tests/support/reference_runs.py: 8 steps uninterrupted, and its twin resumed
past a corrupt tag) is what every other run is compared with and starts from; the ranks are the rank pool's
(tests/support/rank_pool.py). The kill -9 matrix of the protocol's points runs with a fake engine in
test_checkpoints.py; here one real kill of an FSDP save. Export, LoRA and the spike guard under FSDP are in
test_export.py, test_lora_training.py and test_guarded_runs.py (their parametrisations include fsdp).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from model_utils import engines
from model_utils.checkpoint import protocol
from model_utils.engines.fsdp_engine import STATE_FILE
from model_utils.storage import file_manifest
from support.metrics_file import step_records
from support.rank_pool import ENV, killed_in_first_save, run_ranks, train
from support.reference_runs import Reference, fsdp_flags
from support.small_trainer import make_trainer

pytestmark = pytest.mark.e2e


def client_state(tag_dir: Path) -> dict:
    saved = torch.load(tag_dir / STATE_FILE, weights_only=False)
    return saved["client_state"][protocol.CLIENT_KEY]["train_state"]


@pytest.fixture(scope="module")
def straight(
    fsdp_reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[int, dict]]:
    """The uninterrupted run: a work dir whose ck/ is its checkpoint dir (tags of steps 4 and 8, read only) and
    cache/ its data cache, and its step records."""
    work = tmp_path_factory.mktemp("fsdp")
    (work / "ck").symlink_to(fsdp_reference.straight)
    (work / "cache").symlink_to(fsdp_reference.cache)
    out = fsdp_reference.straight_log
    assert "Weight decay 0.1 on 15 tensors (229,376 parameters), none on 9 (384; norms, biases)" in out
    records = fsdp_reference.straight_records()
    assert sorted(records) == list(range(1, 9))
    return work, records


def start_from(work: Path, name: str, *tags: Path) -> Path:
    ckpt = work / name
    ckpt.mkdir()
    for tag in tags:
        shutil.copytree(tag, ckpt / tag.name)
    return ckpt


def test_dcp_layout_inside_the_crash_safe_protocol(straight) -> None:
    work, _ = straight
    tag = work / "ck" / "tiny_qwen3-8steps"
    assert file_manifest.verify(tag) is None and protocol.is_tag_dir(tag)
    assert engines.engine_of_tag(tag) == "fsdp"
    names = sorted(
        str(p.relative_to(tag)) for p in tag.rglob("*") if p.is_file() and "hf_config" not in p.parts
    )
    assert names == [
        "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "dskit_manifest.json", "fsdp_client_state.pt",
        "launch.json", "rng_state_rank0.pt", "rng_state_rank1.pt",
    ]  # fmt: skip
    assert client_state(tag)["tokens_seen"] == 8 * 2 * 2 * 2 * 64  # steps x ranks x micro batch x accum x seq
    assert (work / "ck" / "latest").read_text() == "tiny_qwen3-8steps"


def test_resume_is_exact_and_a_corrupt_shard_falls_back_to_the_previous_tag(
    straight, fsdp_reference: Reference
) -> None:
    """The reference's twin: tags 4 and 8 of the straight run, one byte of tag 8's rank-1 shard flipped; the start
    skips tag 8 with a warning, resumes tag 4 and trains steps 5-8 with the straight run's losses (within 1e-4)
    and lrs."""
    work, full = straight
    ckpt, out = fsdp_reference.twin, fsdp_reference.twin_log
    assert "tiny_qwen3-8steps: dcp/__1_0.distcp does not match its checksum" in out
    assert "tiny_qwen3-4steps at step 4 (epoch 0, block 32" in out
    again = fsdp_reference.twin_records()
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:
        assert abs(again[step]["loss"] - full[step]["loss"]) < 1e-4, (step, again[step], full[step])
        assert again[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-6)
        assert again[step]["grad_norm"] == pytest.approx(full[step]["grad_norm"], rel=1e-3)
    assert client_state(ckpt / "tiny_qwen3-8steps") == client_state(work / "ck" / "tiny_qwen3-8steps")
    assert file_manifest.verify(ckpt / "tiny_qwen3-8steps") is None  # the damaged tag was replaced whole


def test_world_size_2_to_1_and_back_reshards_with_the_optimizer_state(straight) -> None:
    """Tag 4 on one rank (accumulation 4: the same global batch), then that run's tag 6 on two ranks: DCP
    reshards model and Adam moments, the lr schedule and data position continue. A fresh optimizer would be far
    off (Adam's first steps are ~lr x sign(g) per weight); another world size sums gradients in another order
    (bf16 compute), so the losses agree to a tolerance, not exactly."""
    work, full = straight
    one = start_from(work, "one-rank", work / "ck" / "tiny_qwen3-4steps")
    out = train(fsdp_flags(work / "cache", one, work / "one.jsonl", freq=2, accumulation=4), work, nproc=1)
    assert (
        "world size changed from 2 to 1: resuming optimizer and lr schedule state, resharded on load" in out
    )
    assert "loaded the weights only" not in out and "at step 4 (epoch 0, block 32" in out
    assert not list(one.glob("*-universal"))  # no conversion for DCP
    again = step_records(work / "one.jsonl")
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:
        assert again[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-6)
        assert abs(again[step]["loss"] - full[step]["loss"]) < 5e-4, (step, again[step], full[step])
    back = start_from(work, "two-again", one / "tiny_qwen3-6steps")
    out = train(fsdp_flags(work / "cache", back, work / "back.jsonl"), work)
    assert (
        "world size changed from 1 to 2: resuming optimizer and lr schedule state, resharded on load" in out
    )
    assert "loaded the weights only" not in out and "at step 6 (epoch 0, block 48" in out
    again = step_records(work / "back.jsonl")
    assert sorted(again) == [7, 8]
    for step in again:  # two world-size changes away from the straight run
        assert again[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-6)
        assert abs(again[step]["loss"] - full[step]["loss"]) < 1e-3, (step, again[step], full[step])


def test_a_kill_during_an_fsdp_save_resumes_from_the_last_verified_checkpoint(straight) -> None:
    """The kill -9 matrix's mid_file point (every point: test_checkpoints.py, with a fake engine) on real FSDP
    ranks: a DCP shard cut short in the staging dir, then kill -9 during the save of step 6."""
    work, _ = straight
    ckpt = start_from(work, "fault-mid_file", work / "ck" / "tiny_qwen3-4steps")
    crashed = run_ranks(
        fsdp_flags(work / "cache", ckpt, work / "mid_file.jsonl", freq=2),
        cwd=work,
        env={**ENV, protocol.FAULT_ENV: "mid_file"},
    )
    killed_in_first_save(crashed)
    target = protocol.select_resume(str(ckpt), None)
    assert target is not None and target.tag == "tiny_qwen3-4steps"
    assert file_manifest.verify(ckpt / "tiny_qwen3-4steps") is None  # the older checkpoint untouched
    staged = list((ckpt / ".staging-tiny_qwen3-6steps" / "dcp").glob("*.distcp"))
    assert staged and min(p.stat().st_size for p in staged) < max(p.stat().st_size for p in staged)


def test_fsdp_checkpoints_go_to_s3_and_a_fresh_node_resumes_from_them(straight, s3) -> None:
    """The S3 tier carries DCP tags (their dcp/ subdir included): uploaded as saved, downloaded on a node whose
    local dir is empty, verified and resumed whole."""
    import os

    work, _ = straight
    ckpt = start_from(work, "s3", work / "ck" / "tiny_qwen3-4steps")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}  # AWS_* point at the loopback server
    run = [
        *fsdp_flags(work / "cache", ckpt, work / "s3-1.jsonl", freq=2),
        "--s3_checkpoint_uri",
        s3.uri("fsdp"),
    ]
    first = run_ranks([*run, "--max_steps", "6"], env=env)  # the last --max_steps wins
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert {"fsdp/tiny_qwen3-6steps/dcp/.metadata", "fsdp/tiny_qwen3-6steps/dcp/__1_0.distcp"} <= set(
        s3.keys("fsdp/")
    )
    shutil.rmtree(ckpt)  # a new node, or a lost disk
    run[run.index("--metrics_file") + 1] = str(work / "s3-2.jsonl")
    second = run_ranks(run, env=env)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "downloading tiny_qwen3-6steps from s3://" in second.stdout and "at step 6" in second.stdout
    assert "loaded the weights only" not in second.stdout  # optimizer and schedule came back too
    assert sorted(step_records(work / "s3-2.jsonl")) == [7, 8]
    assert file_manifest.verify(ckpt / "tiny_qwen3-6steps") is None  # the download verifies like any tag


def test_cpu_offload_trains_in_process(tmp_path: Path, single_rank) -> None:
    """--fsdp_cpu_offload: FSDP2's CPUOffloadPolicy (unpinned on CPU ranks) trains and its shards stay on the CPU."""
    trainer = make_trainer(tmp_path, single_rank, "--backend", "fsdp", "--fsdp_cpu_offload", "true")
    try:
        trainer.engine.train()
        losses = [trainer.step().loss for _ in range(3)]
        assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses
        assert {p.device.type for p in trainer.engine.module.parameters()} == {"cpu"}
        assert trainer.engine.optimizer_steps() == 3
    finally:
        trainer.close()
