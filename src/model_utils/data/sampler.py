"""The sharded, resumable order in which ranks read the token blocks.

Each epoch is a permutation of the blocks, seeded by (seed, epoch), or the order of blocks that order their own
epochs (a mixture of sources, data/mixture.py: its blocks per epoch and each epoch's order, seeded the same way).
An optimizer step consumes one global batch (micro batch x accumulation x data-parallel ranks) of consecutive
blocks of that order; rank r reads its own contiguous slice of it, so ranks never overlap. The position (epoch,
blocks consumed) is all resume needs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class DataPosition:
    """Where training is in the data: the epoch and how many of its permuted blocks were consumed."""

    epoch: int = 0
    consumed: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> DataPosition:
        return cls(epoch=int(d["epoch"]), consumed=int(d["consumed"]))


@runtime_checkable
class EpochOrder(Protocol):
    """Blocks that order their own epochs (a mixture): how many blocks an epoch reads, and in which order."""

    blocks_per_epoch: int

    def epoch_order(self, epoch: int) -> np.ndarray: ...


def epoch_blocks(blocks: Any) -> int:
    """Blocks one epoch reads: an EpochOrder's own count, else every block once."""
    return blocks.blocks_per_epoch if isinstance(blocks, EpochOrder) else len(blocks)


class BlockSampler:
    """Which blocks each data-parallel rank reads for each optimizer step."""

    @classmethod
    def of(
        cls, blocks: Any, micro_batch: int, grad_accum: int, dp_rank: int, dp_world: int, seed: int
    ) -> BlockSampler:
        """The sampler of a split's blocks: their own epoch order where they have one."""
        own = blocks if isinstance(blocks, EpochOrder) else None
        return cls(epoch_blocks(blocks), micro_batch, grad_accum, dp_rank, dp_world, seed, own)

    def __init__(
        self,
        num_blocks: int,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        epoch_order: EpochOrder | None = None,
    ) -> None:
        assert 0 <= dp_rank < dp_world
        self.num_blocks = num_blocks
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.per_rank = micro_batch * grad_accum
        self.global_batch = self.per_rank * dp_world
        self._order: tuple[int, np.ndarray] | None = None
        self.epoch_order = epoch_order
        assert epoch_order is None or epoch_order.blocks_per_epoch == num_blocks

    @property
    def steps_per_epoch(self) -> int:
        return self.num_blocks // self.global_batch

    def order(self, epoch: int) -> np.ndarray:
        if self.epoch_order is not None:
            return self.epoch_order.epoch_order(epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks))
        return self._order[1]

    def _normalise(self, pos: DataPosition) -> DataPosition:
        # A global batch that would run past the end starts the next epoch (the tail is seen next epoch).
        if pos.consumed + self.global_batch > self.num_blocks:
            return DataPosition(pos.epoch + 1, 0)
        return pos

    def step_indices(self, pos: DataPosition) -> np.ndarray:
        """This rank's block indices for the step at `pos`, shaped [grad_accum, micro_batch]."""
        pos = self._normalise(pos)
        start = pos.consumed + self.dp_rank * self.per_rank
        mine = self.order(pos.epoch)[start : start + self.per_rank]
        return mine.reshape(self.grad_accum, self.micro_batch)

    def advance(self, pos: DataPosition) -> DataPosition:
        pos = self._normalise(pos)
        return DataPosition(pos.epoch, pos.consumed + self.global_batch)


@dataclass(frozen=True)
class ValidationPlan:
    """This rank's share of a validation: the validation blocks cut into micro-batches in order (the last one may
    be short) and dealt to the ranks in turn, so each block is read once and the batches are the same whatever the
    world size. Every rank runs the same number of forwards (ZeRO-3 and FSDP gather parameters in each): a rank
    one batch short repeats one with weight 0."""

    batches: list[np.ndarray]  # block indices per forward
    weights: list[int]  # blocks of each batch that count: its length, 0 for a repeat
    blocks: int  # blocks covered over all ranks
    total_blocks: int  # blocks in the validation set


def validation_plan(
    num_blocks: int, batches: int | None, micro_batch: int, dp_rank: int, dp_world: int
) -> ValidationPlan:
    """`batches` micro-batches per rank (the first full ones of the deal), or None: every block (a full pass).
    The same blocks at every evaluation. Fewer blocks than one micro-batch per rank: all of them, once (a rank
    without one repeats one, uncounted)."""
    rounds = None if batches is None else min(batches, num_blocks // (micro_batch * dp_world))
    starts = list(range(0, num_blocks if not rounds else rounds * dp_world * micro_batch, micro_batch))
    dealt = [np.arange(s, min(s + micro_batch, num_blocks)) for s in starts]
    mine = dealt[dp_rank::dp_world]
    per_rank = -(-len(dealt) // dp_world)
    weights = [len(b) for b in mine] + [0] * (per_rank - len(mine))
    padding = mine[-1:] if mine else dealt[:1]
    return ValidationPlan(
        batches=mine + padding * (per_rank - len(mine)),
        weights=weights,
        blocks=sum(len(b) for b in dealt),
        total_blocks=num_blocks,
    )
