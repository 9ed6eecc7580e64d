"""Checkpoint tag directories made by hand (random shard bytes, optionally verified by a manifest): for tests of
what the checkpoint protocol reads without a real save."""

from __future__ import annotations

import os
from pathlib import Path

from model_utils.engines.deepspeed_engine import MODEL_STATES
from model_utils.storage import file_manifest


def fake_tag(root: Path, step: int, size: int = 1000, with_manifest: bool = True) -> Path:
    tag_dir = root / f"tiny_qwen3-{step}steps"
    tag_dir.mkdir(parents=True)
    (tag_dir / MODEL_STATES).write_bytes(os.urandom(size))
    (tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(os.urandom(size))
    if with_manifest:
        file_manifest.write(tag_dir, file_manifest.build(tag_dir, {"tag": tag_dir.name, "step": step}))
    return tag_dir
