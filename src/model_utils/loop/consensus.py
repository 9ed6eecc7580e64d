"""Every cross-rank decision the loop makes per step, in one small collective.

Per turn the ranks must agree on the spike guard's loss (the step's mean over all ranks, before the update), on
whether to stop or save after it (a rank was signalled, its clock says a save is due, rank 0's walltime plan, an
observer's Stop), on the next step's target count (the divisor of its loss: engines/step_loss.py), and every
--straggler_every turns they share their step time split (loop/stragglers.py). Each rank puts them in one float64
row: its loss, its flags, its targets and its step times. One all-gather gives every rank every row, and each reads
the same from them: the mean loss, each flag raised anywhere, the sum of the targets, every rank's times. Each
collective costs a fixed latency, so the kit makes one, not one per decision; and a gather, not an all-reduce:
on gloo an all-reduce of these 11 numbers took 0.6-0.9 ms of CPU (its ring splits them into many messages)
where a gather took 0.2-0.4 ms (2 CPU ranks, this kit's test machine). With one rank nothing is exchanged.

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
    loss: float | None, flags: Sequence[bool], times: RankTimes | None, targets: int | None = None
) -> list[float]:
    """This rank's row."""
    row = [0.0 if loss is None else loss, *(1.0 if flag else 0.0 for flag in flags)]
    if targets is not None:
        row.append(float(targets))  # exact in float64 up to 2**53 tokens
    if times is not None:
        row += [times.data_s, times.compute_s, times.sync_s]
    return row


def decode(
    rows: Sequence[Sequence[float]],
    has_loss: bool,
    n_flags: int,
    has_times: bool,
    wait_s: float,
    has_targets: bool = False,
) -> Agreement:
    """What every rank reads from all the ranks' rows (in rank order: the same sums everywhere)."""
    flags = tuple(any(row[1 + i] > 0 for row in rows) for i in range(n_flags))
    at = 1 + n_flags
    targets = None
    if has_targets:
        targets, at = round(sum(row[at] for row in rows)), at + 1
    rank_times = tuple(RankTimes(*row[at : at + TIMES_PER_RANK]) for row in rows) if has_times else None
    loss = sum(row[0] for row in rows) / len(rows) if has_loss else None
    return Agreement(loss, flags, rank_times, wait_s, targets)


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
        row = encode(local_loss, flags, times, targets)
        started = time.perf_counter()
        rows = [row]
        if self.world_size > 1:
            mine = torch.tensor(row, dtype=torch.float64, device=self.device)
            gathered = torch.empty(self.world_size * len(row), dtype=torch.float64, device=self.device)
            torch.distributed.all_gather_into_tensor(gathered, mine)
            rows = gathered.view(self.world_size, len(row)).tolist()
        wait = time.perf_counter() - started
        return decode(rows, loss is not None, len(flags), times is not None, wait, targets is not None)
