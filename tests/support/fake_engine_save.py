"""Saves through the real crash-safe checkpoint protocol (model_utils.checkpoint.protocol) with a fake engine that
writes small files: the kill -9 matrix's engine-independent part, on real ranks without a model.

    (ranks) tests/support/fake_engine_save.py deepspeed|fsdp CHECKPOINT_DIR STEP [STEP ...]

As the trainer does it: the ranks verify the candidate tags in parallel, every rank resumes from the newest verified tag in CHECKPOINT_DIR (if any; rank 0 prints
"Resumed from <tag dir> at step N"), then saves a tag of each STEP in turn with protocol.save, so a fault
injected through DSKIT_FAULT_INJECT kills a rank at that point of the first save, and with FAIL_RANK_ENV=R the
first save's write fails on rank R as on a full disk (the run then ends as the trainer's does: one error line,
exit status 3). Run it with
support.rank_pool.run_ranks (gloo, torchrun's environment).
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from model_utils import engines
from model_utils.checkpoint import protocol
from model_utils.engines import deepspeed_engine, fsdp_engine
from model_utils.errors import CheckpointSaveFailed
from model_utils.observe.log import print0

MODEL = "tiny_qwen3"  # the tag names the real runs' tests expect: tiny_qwen3-<step>steps
SHARD_FLOATS = 1 << 14  # 64 KiB per rank: a tag's largest file, so the mid_file fault cuts an engine shard
FAIL_RANK_ENV = "FAKE_ENGINE_SAVE_FAILS_ON_RANK"


class FakeEngine:
    """The part of model_utils.engines.base.Engine the checkpoint protocol uses, writing small files in the layout
    of a real engine's tag: `deepspeed` (mp_rank_00_model_states.pt with the client state, one optimizer shard
    per rank) or `fsdp` (dcp/ with one .distcp shard per rank and .metadata, fsdp_client_state.pt)."""

    reshards_on_load = False

    def __init__(self, rank: int, layout: str) -> None:
        self.rank, self.layout = rank, layout
        self.module = torch.nn.Linear(2, 2)
        self.fails = os.environ.get(FAIL_RANK_ENV) == str(rank)

    def _shard(self, tag_dir: Path) -> Path:
        if self.layout == "fsdp":
            return tag_dir / fsdp_engine.DCP_DIR / f"__{self.rank}_0.distcp"
        return tag_dir / f"bf16_zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt"

    def _client_file(self, tag_dir: Path) -> Path:
        return tag_dir / (fsdp_engine.STATE_FILE if self.layout == "fsdp" else deepspeed_engine.MODEL_STATES)

    def save(self, tag_dir: Path, client_state: dict[str, Any]) -> None:
        step = client_state[protocol.CLIENT_KEY]["train_state"]["step"]
        shard = self._shard(tag_dir)
        shard.parent.mkdir(parents=True, exist_ok=True)  # engines make the dir they are handed
        torch.save({"shard": torch.full((SHARD_FLOATS,), float(step * 10 + self.rank))}, shard)
        if self.fails:  # after a partial write, as a filling disk does
            self.fails = False
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(shard))
        if self.rank == 0:
            if self.layout == "fsdp":
                (shard.parent / ".metadata").write_bytes(b"fake DCP metadata")
            torch.save({"client_state": client_state}, self._client_file(tag_dir))

    def after_failed_save(self) -> None:
        pass  # its save runs no collectives

    def writer_rank(self, rel: str) -> int | None:
        return engines.engine_class(self.layout).writer_rank(rel)  # the real engine's layout, the real answer

    def load(self, tag_dir: Path, weights_only: bool, universal: bool = False) -> dict[str, Any] | None:
        saved = torch.load(self._client_file(tag_dir), weights_only=False)["client_state"]
        step = saved[protocol.CLIENT_KEY]["train_state"]["step"]
        shard = torch.load(self._shard(tag_dir))["shard"]
        assert shard[0].item() == step * 10 + self.rank, (tag_dir, shard[0].item())  # this rank's own shard
        return saved


class SavedAsJson:
    """Stands in for the model config and the tokenizer: protocol.save has rank 0 save_pretrained them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / f"{self.name}.json").write_text(json.dumps({"fake": self.name}))


def main() -> None:
    layout, checkpoint_dir, *steps = sys.argv[1:]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    engine = FakeEngine(rank, layout)
    protocol.verify_in_parallel(checkpoint_dir)  # as the trainer's entry point: every rank its share
    target = protocol.select_resume(checkpoint_dir, None)
    if target is not None:
        state = protocol.load(engine, target, rank, weights_only=False)
        print0(f"Resumed from {target.path} at step {state['step']}")
    for step in map(int, steps):
        request = protocol.SaveRequest(
            checkpoint_dir=checkpoint_dir,
            tag=protocol.checkpoint_tag(MODEL, step),
            step=step,
            train_state={"step": step},
            config={},
            launch={"world_size": torch.distributed.get_world_size()},
        )
        try:
            protocol.save(engine, request, rank, SavedAsJson("config"), SavedAsJson("tokenizer"))
        except CheckpointSaveFailed:
            sys.exit(3)  # as the trainer's entry point: the protocol printed the line
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
