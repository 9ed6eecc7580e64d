"""The loop's one per-step collective (loop/consensus.py): what each rank puts in, summed as an all-reduce sums
it, gives every rank the mean loss, each flag raised anywhere, and every rank's step times; and the same through
a real 2-rank gloo all-reduce (one collective: counted)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_utils.loop import consensus
from model_utils.loop.stragglers import RankTimes


def summed(vectors: list[list[float]]) -> list[float]:
    return [sum(column) for column in zip(*vectors, strict=True)]


def test_one_vector_carries_the_loss_the_flags_and_every_ranks_times() -> None:
    times = [RankTimes(0.1, 1.0, 0.2), RankTimes(0.3, 1.5, 0.0), RankTimes(0.1, 0.9, 0.4)]
    flags = [[False, True, False], [False, False, False], [False, True, True]]
    vectors = [
        consensus.encode(loss, f, t, r, 3)
        for r, (loss, f, t) in enumerate(zip([2.0, 3.0, 4.0], flags, times, strict=True))
    ]
    agreed = consensus.decode(summed(vectors), True, 3, True, 3, wait_s=0.01)
    assert agreed.loss == pytest.approx(3.0)
    assert agreed.flags == (False, True, True)
    assert agreed.rank_times == tuple(times)
    # Without a loss (the guard is off) or times (no window due): the flags alone.
    bare = [consensus.encode(None, f, None, r, 3) for r, f in enumerate(flags)]
    assert len(bare[0]) == 4
    agreed = consensus.decode(summed(bare), False, 3, False, 3, wait_s=0.0)
    assert (agreed.loss, agreed.flags, agreed.rank_times) == (None, (False, True, True), None)


def test_the_next_steps_targets_ride_in_the_same_vector_as_a_sum() -> None:
    """engines/step_loss.py's divisor for the next step: each rank's count, summed, between the flags and the
    times, which still decode to every rank's."""
    times = [RankTimes(0.1, 1.0, 0.2), RankTimes(0.3, 1.5, 0.0)]
    vectors = [consensus.encode(2.0 + r, [r == 1], times[r], r, 2, targets=[700, 45][r]) for r in range(2)]
    agreed = consensus.decode(summed(vectors), True, 1, True, 2, wait_s=0.0, has_targets=True)
    assert agreed.targets == 745 and agreed.loss == pytest.approx(2.5) and agreed.flags == (True,)
    assert agreed.rank_times == tuple(times)
    assert consensus.decode(summed(vectors[:1]), True, 1, True, 2, 0.0).targets is None  # not given: none


def test_one_rank_exchanges_nothing() -> None:
    one = consensus.StepConsensus(0, 1, torch.device("cpu"))
    agreed = one.agree(torch.tensor(2.5, dtype=torch.float64), [True, False])
    assert (agreed.loss, agreed.flags, agreed.rank_times) == (2.5, (True, False), None)


def _rank(rank: int, store: str, results: dict[int, object]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    calls = []
    real = dist.all_reduce

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        agreed = consensus.StepConsensus(rank, 2, torch.device("cpu")).agree(
            torch.tensor(1.0 + rank, dtype=torch.float64),
            [rank == 1, False],
            RankTimes(rank, 2.0, 0.5),
            targets=10 + rank,
        )
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
        dist.destroy_process_group()
    results[rank] = (agreed.loss, agreed.flags, agreed.rank_times, agreed.targets, len(calls))


def test_two_real_ranks_agree_in_one_collective(tmp_path: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "store"), results), nprocs=2)
        got = dict(results)
    expected = (1.5, (True, False), (RankTimes(0.0, 2.0, 0.5), RankTimes(1.0, 2.0, 0.5)), 21, 1)
    assert got == {0: expected, 1: expected}
