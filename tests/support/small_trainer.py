"""A 4-step Trainer on the embedded corpus, in this process (one rank): for tests of what the model set-up does
(compile, activation checkpointing) under the real DeepSpeed path, which step it 3 times (none is the last: no
save)."""

from __future__ import annotations

from pathlib import Path

from model_utils.config.arguments import parse_args
from model_utils.loop import trainer as training
from model_utils.resolve import resolver


def make_trainer(tmp_path: Path, dist, *flags: str) -> training.Trainer:
    cfg = parse_args(
        [
            "--max_steps", "4", "--warmup_steps", "1", "--seq_length", "32", "--validation_fraction", "0",
            "--metrics_file", "none",
            "--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ckpt"), *flags,
        ]
    )  # fmt: skip
    return training.Trainer(resolver.prepare(cfg, world_size=dist.world_size), dist)
