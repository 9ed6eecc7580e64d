"""A 3-step Trainer on the embedded corpus, in this process (one rank): for tests of what the model set-up does
(compile, activation checkpointing) under the real DeepSpeed path."""

from __future__ import annotations

from pathlib import Path

from model_utils import preflight
from model_utils import trainer as training
from model_utils.arguments import parse_args


def make_trainer(tmp_path: Path, dist, *flags: str) -> training.Trainer:
    cfg = parse_args(
        [
            "--max_steps", "3", "--warmup_steps", "1", "--seq_length", "32", "--validation_fraction", "0",
            "--metrics_file", "none",
            "--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ckpt"), *flags,
        ]
    )  # fmt: skip
    return training.Trainer(preflight.prepare(cfg, world_size=dist.world_size), dist)
