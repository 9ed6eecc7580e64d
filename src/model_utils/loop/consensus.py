"""Every cross-rank decision the loop makes per step, in one small all-reduce.

Per turn the ranks must agree on the spike guard's loss (the step's mean over all ranks, before the update), on
whether to stop or save after it (a rank was signalled, its clock says a save is due, rank 0's walltime plan, an
observer's Stop), on the next step's target count (the divisor of its loss: engines/step_loss.py), and every
--straggler_every turns they share their step time split (loop/stragglers.py). One float64 vector carries them
all, summed across the ranks: the loss as a sum, each flag as a count of the ranks that raised it, the targets as
a sum, and the step times in a slot per rank (zero elsewhere), so a SUM gives every rank the whole. Each
collective costs a fixed latency (gloo's ~0.1 ms or more on a tiny CPU step), so the kit makes one, not one per
decision. With one rank nothing is exchanged.

Why the next step's targets, not this one's: the divisor must be known before a step's first backward, and with
gradient accumulation the earlier micro-batches' backwards run before this collective (it waits for the step's
last forward, since the guard judges the whole step's loss). The data is gathered one step ahead
(data/step_batches.py), so the next step's rows are read, and their targets counted, by then. The reverse, this
step's decisions riding on the next step's target count, cannot work: the guard must judge the loss before the
update. So a step whose count was agreed in the turn before makes no collective of its own; the first step, and
one after a rollback or a jump, count theirs in a collective of their own (step_loss.step_targets).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_utils.loop.stragglers import RankTimes

TIMES_PER_RANK = 3  # data, compute, sync


@dataclass(frozen=True)
class Agreement:
    loss: float | None  # the mean over the ranks of the loss each gave, when they gave one
    flags: tuple[bool, ...]  # each flag: raised on any rank
    rank_times: tuple[RankTimes, ...] | None  # every rank's, when they were carried
    wait_s: float  # this rank's time in the collective: waiting for the others (and the exchange itself)
    targets: int | None = (
        None  # the sum over the ranks of the targets each gave (the next step's), when given
    )


def encode(
    loss: float | None,
    flags: Sequence[bool],
    times: RankTimes | None,
    rank: int,
    world_size: int,
    targets: int | None = None,
) -> list[float]:
    vector = [0.0 if loss is None else loss, *(1.0 if flag else 0.0 for flag in flags)]
    if targets is not None:
        vector.append(float(targets))  # exact in float64 up to 2**53 tokens
    if times is not None:
        slots = [0.0] * (TIMES_PER_RANK * world_size)
        slots[TIMES_PER_RANK * rank : TIMES_PER_RANK * (rank + 1)] = [
            times.data_s,
            times.compute_s,
            times.sync_s,
        ]
        vector += slots
    return vector


def decode(
    summed: list[float],
    has_loss: bool,
    n_flags: int,
    has_times: bool,
    world_size: int,
    wait_s: float,
    has_targets: bool = False,
) -> Agreement:
    flags = tuple(count > 0 for count in summed[1 : 1 + n_flags])
    at = 1 + n_flags
    targets = None
    if has_targets:
        targets, at = round(summed[at]), at + 1
    rank_times = None
    if has_times:
        slots = summed[at:]
        rank_times = tuple(
            RankTimes(*slots[TIMES_PER_RANK * r : TIMES_PER_RANK * (r + 1)]) for r in range(world_size)
        )
    return Agreement(summed[0] / world_size if has_loss else None, flags, rank_times, wait_s, targets)


class StepConsensus:
    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device

    def agree(
        self,
        loss: torch.Tensor | None,
        flags: Sequence[bool],
        times: RankTimes | None = None,
        targets: int | None = None,
    ) -> Agreement:
        """One collective (none with one rank). Every rank must pass a loss or not, the same number of flags,
        times or not, and targets or not, alike."""
        local_loss = None if loss is None else float(loss.item())
        vector = encode(local_loss, flags, times, self.rank, self.world_size, targets)
        started = time.perf_counter()
        if self.world_size > 1:
            summed = torch.tensor(vector, dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(summed)
            vector = summed.tolist()
        wait = time.perf_counter() - started
        return decode(
            vector,
            loss is not None,
            len(flags),
            times is not None,
            self.world_size,
            wait,
            targets is not None,
        )
