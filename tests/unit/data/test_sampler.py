"""The sharded, resumable order in which ranks read blocks: every block once per epoch, no overlap between ranks,
a position that resumes anywhere, and validation indices. (Which blocks: test_block_cache.py.)"""

from __future__ import annotations

import json

import numpy as np

from model_utils.data.sampler import BlockSampler, DataPosition, validation_indices


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
