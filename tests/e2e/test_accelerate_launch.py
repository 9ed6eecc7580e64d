"""`accelerate launch` as the kit's second launcher, on one machine: 2 CPU ranks over gloo, a few steps.

The two ways the rendered launchers call it: with the shipped accelerate config (DeepSpeed with the kit's ZeRO-2
file; there, on a CPU-only machine, an `Accelerator()` would report one process) and without a config (plain
--multi_gpu). Either way the trainer must form one world of 2 from torch.distributed, each rank on its own
share of the data. The multi-node launch is tests/slurm/'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.torchrun import ENV, REPO

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

ACCELERATE = Path(sys.executable).parent / "accelerate"
LAUNCH = {
    "deepspeed-config": ["--config_file", "configs/accelerate/deepspeed-zero2.yaml"],
    "fsdp-config": ["--config_file", "configs/accelerate/fsdp2.yaml"],
    "multi-gpu": ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"],
}
BACKEND = {"deepspeed-config": "deepspeed", "fsdp-config": "fsdp", "multi-gpu": "deepspeed"}
ENGINE = {
    "deepspeed": ("DeepSpeed", "stepped by the DeepSpeed engine"),
    "fsdp": ("FSDP2", "stepped by the FSDP engine"),
}


@pytest.mark.parametrize("how", list(LAUNCH))
def test_accelerate_launch_trains_one_world_of_two(tmp_path: Path, how: str) -> None:
    metrics = tmp_path / "metrics.jsonl"
    cmd = [
        str(ACCELERATE), "launch", *LAUNCH[how], "--num_machines", "1", "--num_processes", "2",
        "--main_process_port", "0", "src/train_deepspeed.py",
        "--max_steps", "3", "--seq_length", "32", "--validation_fraction", "0", "--checkpoint_freq", "3",
        "--checkpoint_dir", str(tmp_path / "ck"), "--data_cache_dir", str(tmp_path / "cache"),
        "--metrics_file", str(metrics),
    ]  # fmt: skip
    # HF_HOME: no default accelerate config from the developer's cache
    env = {**ENV, "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # One world of 2 (not two worlds of 1): 2 ranks' sequences in each step's batch.
    title, steps_schedule = ENGINE[BACKEND[how]]
    assert (
        f"Training tiny-qwen3 with {title} for 3 steps: 2 ranks x micro batch 1 x accumulation 1 x 32 tokens = "
        "64 tokens/step" in out
    )
    # The engine the accelerate config chose runs the schedule, and the log says so.
    assert (
        "lr schedule cosine: warm-up 3 steps, cosine decay to 0.1 x peak by step 3 (DeepSpeed's WarmupCosineLR"
        in out
    )
    assert steps_schedule in out
    assert "Done: step 3/3, 192 tokens seen" in out, out[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["world_size"] for r in records if r.get("event") == "start"] == [2]
    assert [r["step"] for r in records if "loss" in r] == [3]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "tiny_qwen3-3steps"
    # the lines come from rank 0 only: a second world would print its own
    assert out.count(f"Training tiny-qwen3 with {title} for 3 steps") == 1
    # The accelerate config reached the ranks and chose the engine.
    assert "accelerate config: distributed_type" in out
    launch = json.loads((tmp_path / "ck" / "tiny_qwen3-3steps" / "launch.json").read_text())
    assert launch["config"]["optim"]["backend"] == BACKEND[how]


def test_an_accelerate_config_the_run_contradicts_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    cmd = [
        str(ACCELERATE), "launch", "--multi_gpu", "--mixed_precision", "fp16", "--dynamo_backend", "no",
        "--num_machines", "1", "--num_processes", "2", "--main_process_port", "0", "src/train_deepspeed.py",
        "--max_steps", "3", "--checkpoint_dir", str(tmp_path / "ck"), "--data_cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**ENV, "HF_HOME": str(tmp_path / "hf")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: the accelerate config asks for mixed_precision fp16, but deepspeed/ds_config.json trains in bf16: "
        "make them agree (the kit's precision is the DeepSpeed config's bf16/fp16 section)"
    ]
    assert not (tmp_path / "ck").exists()  # refused before anything was written
