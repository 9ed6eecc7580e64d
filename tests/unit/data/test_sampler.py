"""The sharded, resumable order in which ranks read blocks: every block once per epoch, no overlap between ranks,
a position that resumes anywhere, and validation indices. (Which blocks: test_block_cache.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_utils.data.sampler import BlockSampler, DataPosition, ValidationPlan, epoch_blocks, validation_plan


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


def blocks_read(plan: ValidationPlan) -> list[int]:
    return [int(i) for b, w in zip(plan.batches, plan.weights, strict=True) for i in b[:w]]


def test_validation_slices_are_disjoint_and_fixed() -> None:
    a = validation_plan(num_blocks=21, batches=3, micro_batch=2, dp_rank=0, dp_world=2)
    b = validation_plan(num_blocks=21, batches=3, micro_batch=2, dp_rank=1, dp_world=2)
    assert [len(x) for x in a.batches] == [len(x) for x in b.batches] == [2, 2, 2]
    assert not set(blocks_read(a)) & set(blocks_read(b))
    assert (a.blocks, a.total_blocks) == (12, 21)
    small = validation_plan(num_blocks=5, batches=8, micro_batch=2, dp_rank=1, dp_world=2)
    assert [len(x) for x in small.batches] == [2] and max(blocks_read(small)) < 5 and small.blocks == 4
    # Fewer blocks than one micro-batch per rank: all of them, once; a rank without one repeats one, uncounted.
    few = [validation_plan(num_blocks=3, batches=8, micro_batch=2, dp_rank=r, dp_world=2) for r in (0, 1)]
    assert [p.blocks for p in few] == [3, 3] and sorted(i for p in few for i in blocks_read(p)) == [0, 1, 2]
    one = [validation_plan(num_blocks=1, batches=8, micro_batch=1, dp_rank=r, dp_world=2) for r in (0, 1)]
    assert [(p.batches[0].tolist(), p.weights) for p in one] == [([0], [1]), ([0], [0])]


@pytest.mark.parametrize(
    ("num_blocks", "micro_batch", "world"), [(21, 2, 2), (7, 3, 4), (1, 2, 2), (8, 2, 2)]
)
def test_a_full_pass_reads_every_block_once_in_the_same_batches_at_any_world_size(
    num_blocks: int, micro_batch: int, world: int
) -> None:
    plans = [validation_plan(num_blocks, None, micro_batch, rank, world) for rank in range(world)]
    assert sorted(i for p in plans for i in blocks_read(p)) == list(range(num_blocks))
    assert all(p.blocks == p.total_blocks == num_blocks for p in plans)
    # Every rank runs as many forwards (ZeRO-3 and FSDP gather parameters in each); a repeat counts for nothing.
    assert len({len(p.batches) for p in plans}) == 1
    alone = validation_plan(num_blocks, None, micro_batch, 0, 1)
    counted = {tuple(b.tolist()) for p in plans for b, w in zip(p.batches, p.weights, strict=True) if w}
    assert counted == {tuple(b.tolist()) for b in alone.batches}  # the same batches as on one rank


class OwnOrder:
    """Blocks that order their own epochs (as a mixture does): 6 of their 100 blocks per epoch."""

    blocks_per_epoch = 6

    def __len__(self) -> int:
        return 100

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.array([90, 10, 50, 20, 70, 30]) + epoch


def test_blocks_with_their_own_epoch_order_are_read_in_it_and_plain_ones_as_before() -> None:
    plain = np.zeros((50, 4))
    assert epoch_blocks(plain) == 50 and epoch_blocks(OwnOrder()) == 6
    of = BlockSampler.of(plain, 2, 1, 0, 1, seed=3)
    assert of.epoch_order is None and np.array_equal(of.order(1), BlockSampler(50, 2, 1, 0, 1, 3).order(1))
    rank1 = BlockSampler.of(OwnOrder(), 1, 2, 1, 2, seed=3)
    assert rank1.steps_per_epoch == 1  # 6 blocks per epoch, 4 per step
    assert rank1.step_indices(DataPosition(0, 0)).tolist() == [[50], [20]]
    assert rank1.step_indices(DataPosition(0, 4)).tolist() == [[51], [21]]  # the tail: the next epoch
