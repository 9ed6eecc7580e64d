"""What the kit's cross-rank decisions and its hang and straggler watch cost per step, on 2 gloo CPU ranks.

    .venv/bin/python tools/step_overhead.py [--steps 2000] [--step_s 0.05]

Each rank times, over the same steps, interleaved so both see the same machine:

- before: the step's target count (engines/step_loss.step_targets, the loss divisor's all-reduce) and then one
  StepConsensus.agree with the guard's loss and the stop/save flags: the two collectives a step made before the
  consensus carried the next step's count;
- after: one StepConsensus.agree with the same loss and flags and the next step's target count, the step handed
  that count (step_targets(agreed=...): no collective); both carry the straggler times every 20 steps;
- watch: what the watchdog and the straggler report add to a step on the training thread (four progress notes,
  with the watchdog's thread beating beside it, and the straggler window's bookkeeping).

It prints the mean microseconds per step of each, the after/before ratio, and each as a share of --step_s (a
step's time: e.g. the tiny model's on 2 CPU ranks, from a run's metrics file).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FLAGS = 5  # what a rank may ask of the step's collective (loop/hooks.py REQUESTS)
STRAGGLER_EVERY = 20


def _rank(rank: int, store: str, steps: int, beats: str, results: dict[int, dict[str, float]]) -> None:
    from model_utils.data.step_batches import Batch
    from model_utils.engines import step_loss
    from model_utils.loop import consensus, stragglers
    from model_utils.observe import watchdog

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    agreeing = consensus.StepConsensus(rank, 2, torch.device("cpu"))
    monitor = watchdog.Monitor(rank, 60, directory=Path(beats))
    monitor.start()
    window = stragglers.StepTimes()
    loss = torch.tensor(2.0 + rank, dtype=torch.float64)
    flags = [False] * FLAGS
    tokens = torch.ones(2, 64, dtype=torch.long)
    micro_batches = [Batch(tokens, tokens, None, 128)]  # a micro-batch's labels, as step_targets counts them
    spent: dict[str, list[float]] = {"before": [], "after": [], "watch": []}
    for step in range(1, steps + 1):
        dist.barrier()  # each measurement starts with the ranks together, as a step's collective finds them
        due = step % STRAGGLER_EVERY == 0
        started = time.perf_counter()
        step_loss.step_targets(micro_batches)
        agreeing.agree(loss, flags, window.take() if due else None)
        spent["before"].append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        step_loss.step_targets(micro_batches, agreed=256)
        agreeing.agree(loss, flags, window.take() if due else None, targets=128)
        spent["after"].append(time.perf_counter() - started)
        started = time.perf_counter()
        for phase in (watchdog.DATA, watchdog.COMPUTE, watchdog.DECISION, watchdog.COMPUTE):
            monitor.progress(step, phase)
        window.add(0.001, 0.0001, 0.05)
        monitor.step_took(0.05)
        spent["watch"].append(time.perf_counter() - started)
    monitor.stop()
    dist.destroy_process_group()
    results[rank] = {name: statistics.fmean(times[steps // 10 :]) for name, times in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--step_s", type=float, default=0.05, help="a training step's seconds, for the shares"
    )
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(f"{tmp}/store", args.steps, f"{tmp}/beats", results), nprocs=2)
        got = dict(results)
    for rank, spent in sorted(got.items()):
        before, after, watch = spent["before"], spent["after"], spent["watch"]
        print(
            f"rank {rank}: target count + decisions before {1e6 * before:.0f} us/step (2 all-reduces), after "
            f"{1e6 * after:.0f} us/step (1): ratio {after / before:.2f}, {100 * (before - after) / args.step_s:.2f}% of a "
            f"{args.step_s:g} s step saved; watchdog + straggler bookkeeping {1e6 * watch:.1f} us/step = "
            f"{100 * watch / args.step_s:.3f}% of the step"
        )


if __name__ == "__main__":
    main()
