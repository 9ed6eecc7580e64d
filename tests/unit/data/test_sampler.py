"""The token blocks a run reads and the order it reads them in: a small dataset prepared once into the cache
(read again at any block length, not tokenized again), a large unprepared one refused with the command that
prepares it, and the sharded, resumable order in which ranks read blocks. (The shard format: test_token_shards.py.)"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from dskit import prepare_data
from model_utils.config.arguments import DataArgs
from model_utils.data import token_shards
from model_utils.data.sampler import BlockSampler, DataPosition, validation_indices
from model_utils.errors import ConfigError
from support.prepared_data import DOCS, ids_of, run_data, write_jsonl


def consumed_by_rank(
    sampler_args: dict, world: int, steps: int, start=None
) -> tuple[list[list[int]], DataPosition]:
    samplers = [BlockSampler(dp_rank=r, dp_world=world, **sampler_args) for r in range(world)]
    pos = start or DataPosition()
    seen: list[list[int]] = [[] for _ in range(world)]
    for _ in range(steps):
        for r, s in enumerate(samplers):
            seen[r] += s.step_indices(pos).reshape(-1).tolist()
        pos = samplers[0].advance(pos)
    return seen, pos


def test_shards_are_disjoint_and_cover_an_epoch() -> None:
    args = {"num_blocks": 103, "micro_batch": 2, "grad_accum": 3, "seed": 7}
    world = 4  # global batch 24, 4 steps per epoch, 7 blocks left for the next epoch's permutation
    seen, pos = consumed_by_rank(args, world, steps=4)
    flat = [i for rank in seen for i in rank]
    assert len(flat) == len(set(flat)) == 96  # disjoint across ranks (and nodes: ranks are global)
    assert pos == DataPosition(epoch=0, consumed=96)
    seen_next, pos_next = consumed_by_rank(args, world, steps=1, start=pos)
    assert pos_next == DataPosition(epoch=1, consumed=24)  # the partial global batch rolls to the next epoch
    # Each epoch is a full permutation: over epoch 1's first step the order differs from epoch 0's.
    assert seen_next[0] != seen[0][:6]


def test_order_is_deterministic_per_seed_and_epoch() -> None:
    s = BlockSampler(50, 2, 1, 0, 1, seed=1)
    assert np.array_equal(s.order(3), BlockSampler(50, 2, 1, 0, 1, seed=1).order(3))
    assert not np.array_equal(s.order(3), s.order(4))
    assert not np.array_equal(s.order(3), BlockSampler(50, 2, 1, 0, 1, seed=2).order(3))


def test_resume_position_continues_exactly() -> None:
    args = {"num_blocks": 200, "micro_batch": 2, "grad_accum": 2, "seed": 5}
    straight, _ = consumed_by_rank(args, 2, steps=30)
    first, pos = consumed_by_rank(args, 2, steps=13)
    restored = DataPosition.from_dict(json.loads(json.dumps(pos.to_dict())))  # as stored in a checkpoint
    second, _ = consumed_by_rank(args, 2, steps=17, start=restored)
    assert [a + b for a, b in zip(first, second, strict=True)] == straight


def test_validation_slices_are_disjoint_and_fixed() -> None:
    a = validation_indices(num_blocks=21, batches=3, micro_batch=2, dp_rank=0, dp_world=2)
    b = validation_indices(num_blocks=21, batches=3, micro_batch=2, dp_rank=1, dp_world=2)
    assert a.shape == b.shape == (3, 2)
    assert not set(a.reshape(-1)) & set(b.reshape(-1))
    small = validation_indices(num_blocks=5, batches=8, micro_batch=2, dp_rank=1, dp_world=2)
    assert small.shape == (1, 2) and small.max() < 5


def test_second_run_reads_the_cache_at_any_block_length(tmp_path: Path, tokenizer, monkeypatch) -> None:
    data = DataArgs(
        dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)),
        validation_fraction=0,
        data_cache_dir=str(tmp_path / "c"),
    )
    first = run_data(data, tokenizer).blocks("train", 8)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(token_shards, "write_unit", no_tokenizing)
    again = run_data(data, tokenizer)
    assert np.array_equal(again.blocks("train", 8)[np.arange(len(first))], first[np.arange(len(first))])
    assert len(again.blocks("train", 9)) == len(ids_of(tokenizer, DOCS)) // 9  # blocks are cut at read time
    write_jsonl(tmp_path / "d.jsonl", [*DOCS, "one more"])  # changed content: a new preparation
    with pytest.raises(AssertionError, match="tokenized again"):
        run_data(data, tokenizer)


def test_a_large_unprepared_dataset_is_refused_with_the_command(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "big.jsonl", ["x" * 1000] * 1200)  # 1.2 MB
    data = DataArgs(
        dataset=str(path), unprepared_limit_mb=1, text_field="text", data_cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(ConfigError) as refused:
        run_data(data, tokenizer)
    line = str(refused.value)
    assert "is 1 MB, over --unprepared_limit_mb 1" in line and "\n" not in line
    assert not (tmp_path / "c").exists()  # nothing tokenized, nothing written
    # The command it gives runs as it is, and the run then trains on what it prepared.
    command = shlex.split(re.search(r"`(dskit prepare-data [^`]+)`", line).group(1))
    assert command[:4] == ["dskit", "prepare-data", "PREPARED_DIR", "--dataset"]
    assert prepare_data.main([str(tmp_path / "prepared"), *command[3:]]) == 0
    dataset = run_data(DataArgs(dataset=str(tmp_path / "prepared")), tokenizer)
    assert dataset.tokens("train") + dataset.tokens("validation") == 1200 * len(
        ids_of(tokenizer, ["x" * 1000])
    )
