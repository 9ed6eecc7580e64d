"""The loop's one per-step collective (loop/consensus.py): the row each rank puts in, and what every rank reads
from all the rows: the mean loss, each flag raised anywhere, the sum of the targets, every rank's step times; and
the same through a real 2-rank gloo all-gather (one collective: counted)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_utils.loop import consensus
from model_utils.loop.stragglers import RankTimes


def test_one_row_a_rank_carries_the_loss_the_flags_and_its_times() -> None:
    times = [RankTimes(0.1, 1.0, 0.2), RankTimes(0.3, 1.5, 0.0), RankTimes(0.1, 0.9, 0.4)]
    flags = [[False, True, False], [False, False, False], [False, True, True]]
    rows = [consensus.encode(loss, f, t) for loss, f, t in zip([2.0, 3.0, 4.0], flags, times, strict=True)]
    agreed = consensus.decode(rows, True, 3, True, wait_s=0.01)
    assert agreed.loss == pytest.approx(3.0)
    assert agreed.flags == (False, True, True)
    assert agreed.rank_times == tuple(times)
    assert agreed.wait_s == 0.01
    # Without a loss (the guard is off) or times (no window due): the flags alone.
    bare = [consensus.encode(None, f, None) for f in flags]
    assert len(bare[0]) == 4
    agreed = consensus.decode(bare, False, 3, False, wait_s=0.0)
    assert (agreed.loss, agreed.flags, agreed.rank_times) == (None, (False, True, True), None)


def test_the_next_steps_targets_ride_in_the_same_row_as_a_sum() -> None:
    """engines/step_loss.py's divisor for the next step: each rank's count, summed, between the flags and the
    times, which still decode to every rank's."""
    times = [RankTimes(0.1, 1.0, 0.2), RankTimes(0.3, 1.5, 0.0)]
    rows = [consensus.encode(2.0 + r, [r == 1], times[r], targets=[700, 45][r]) for r in range(2)]
    agreed = consensus.decode(rows, True, 1, True, wait_s=0.0, has_targets=True)
    assert agreed.targets == 745 and agreed.loss == pytest.approx(2.5) and agreed.flags == (True,)
    assert agreed.rank_times == tuple(times)
    untargeted = [consensus.encode(2.0 + r, [r == 1], times[r]) for r in range(2)]
    assert consensus.decode(untargeted, True, 1, True, 0.0).targets is None  # not given: none


def test_one_rank_exchanges_nothing() -> None:
    one = consensus.StepConsensus(0, 1, torch.device("cpu"))
    agreed = one.agree(torch.tensor(2.5, dtype=torch.float64), [True, False])
    assert (agreed.loss, agreed.flags, agreed.rank_times) == (2.5, (True, False), None)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")


def _rank(rank: int, store: str, results: dict[int, object]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    calls: list[str] = []
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name: str):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(name)
            return real[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        agreed = consensus.StepConsensus(rank, 2, torch.device("cpu")).agree(
            torch.tensor(1.0 + rank, dtype=torch.float64),
            [rank == 1, False],
            RankTimes(rank, 2.0, 0.5),
            targets=10 + rank,
        )
    finally:
        for name, function in real.items():
            setattr(dist, name, function)
        dist.destroy_process_group()
    results[rank] = (agreed.loss, agreed.flags, agreed.rank_times, agreed.targets, calls)


def test_two_real_ranks_agree_in_one_collective(tmp_path: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "store"), results), nprocs=2)
        got = dict(results)
    times = (RankTimes(0.0, 2.0, 0.5), RankTimes(1.0, 2.0, 0.5))
    expected = (1.5, (True, False), times, 21, ["all_gather_into_tensor"])
    assert got == {0: expected, 1: expected}
