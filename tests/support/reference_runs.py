"""One short 2-rank run and its resumed twin per engine, trained once per session and shared by the tests that
need trained checkpoints (resume, kill, world size, S3, export) instead of each test training its own.

- DeepSpeed (ZeRO-2, the kit's default config and schedule): `straight` trains 8 steps and keeps the tags of
  steps 2, 4, 6 and 8; `twin` starts from a copy of straight's step-4 tag alone and trains steps 5-8 again.
- FSDP (--backend fsdp): `straight` trains 8 steps with tags at 4 and 8; `twin` starts from copies of both with
  one byte of tag 8's rank-1 DCP shard flipped, so it falls back to tag 4 and trains steps 5-8 again.

The fixtures (tests/e2e/conftest.py) hand out these directories to read; a test that changes a checkpoint dir
works on a copy (`Reference.copy`), so the tests stay independent of their order.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from support.metrics_file import step_records
from support.rank_pool import train

STEPS = 8
HALF = "tiny_qwen3-4steps"


def deepspeed_flags(cache: Path, ckpt: Path, metrics: Path) -> list[str]:
    return [
        "--max_steps", str(STEPS), "--logging_freq", "1", "--checkpoint_freq", "2", "--keep_checkpoints", "4",
        "--validation_freq", "100", "--micro_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--seq_length", "64", "--data_cache_dir", str(cache), "--checkpoint_dir", str(ckpt),
        "--metrics_file", str(metrics),
    ]  # fmt: skip


def fsdp_flags(cache: Path, ckpt: Path, metrics: Path, freq: int = 4, accumulation: int = 2) -> list[str]:
    return [
        "--backend", "fsdp", "--max_steps", str(STEPS), "--logging_freq", "1", "--checkpoint_freq", str(freq),
        "--validation_fraction", "0", "--warmup_steps", "2", "--micro_batch_size", "2",
        "--gradient_accumulation_steps", str(accumulation), "--seq_length", "64",
        "--data_cache_dir", str(cache), "--checkpoint_dir", str(ckpt), "--metrics_file", str(metrics),
    ]  # fmt: skip


@dataclass(frozen=True)
class Reference:
    work: Path  # the data cache, both checkpoint dirs and both metrics files
    flags: Callable[..., list[str]]  # (data cache, checkpoint dir, metrics file) -> this engine's run flags
    straight_log: str  # stdout and stderr of the uninterrupted run
    twin_log: str  # ... and of the resumed one

    @property
    def cache(self) -> Path:
        return self.work / "cache"

    @property
    def straight(self) -> Path:
        return self.work / "straight"

    @property
    def twin(self) -> Path:
        return self.work / "twin"

    def straight_records(self) -> dict[int, dict]:
        return step_records(self.work / "straight.jsonl")

    def twin_records(self) -> dict[int, dict]:
        return step_records(self.work / "twin.jsonl")

    def run_flags(self, ckpt: Path, metrics: Path, **kwargs: int) -> list[str]:
        return self.flags(self.cache, ckpt, metrics, **kwargs)

    def copy(self, dest: Path, *tags: str, latest: bool = False) -> Path:
        """A checkpoint dir at `dest` holding copies of these tags of the straight run, and a `latest` naming the
        last of them if asked: to change or train on without touching the shared run."""
        return copy_tags(self.straight, dest, *tags, latest=latest)


def copy_tags(source: Path, dest: Path, *tags: str, latest: bool = False) -> Path:
    dest.mkdir(parents=True)
    for tag in tags:
        shutil.copytree(source / tag, dest / tag)
    if latest:
        (dest / "latest").write_text(tags[-1])
    return dest


def train_deepspeed_reference(work: Path) -> Reference:
    cache = work / "cache"
    straight_log = train(deepspeed_flags(cache, work / "straight", work / "straight.jsonl"), work)
    copy_tags(work / "straight", work / "twin", HALF, latest=True)
    twin_log = train(deepspeed_flags(cache, work / "twin", work / "twin.jsonl"), work)
    return Reference(work, deepspeed_flags, straight_log, twin_log)


def train_fsdp_reference(work: Path) -> Reference:
    cache = work / "cache"
    straight_log = train(fsdp_flags(cache, work / "straight", work / "straight.jsonl"), work)
    twin = copy_tags(work / "straight", work / "twin", HALF, "tiny_qwen3-8steps")
    shard = twin / "tiny_qwen3-8steps" / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    twin_log = train(fsdp_flags(cache, twin, work / "twin.jsonl"), work)
    return Reference(work, fsdp_flags, straight_log, twin_log)
