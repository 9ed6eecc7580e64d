"""What one small gloo collective costs in CPU, by where it falls between stretches of compute, on 2 CPU ranks.

    .venv/bin/python tools/collective_placement.py [--steps 300] [--compute_ms 8]

Each rank runs steps of the shape of a training step: compute, an all-reduce of 800 KB (standing for DeepSpeed's
gradient reduction), compute, compute, another all-reduce. Blocks of steps without and with one extra all-gather of
11 float64 (the kit's per-step collective, loop/consensus.py) alternate, the extra one placed either

- `between`: in the middle of a stretch of compute (where the kit's falls: after the forward, before the backward);
- `adjacent`: right before the step's second all-reduce, when gloo's threads are awake anyway.

It prints rank 0's extra CPU a step by thread (the kernel's count per thread): on a VM where waking an idle thread
is dear, the `between` collective costs several times the `adjacent` one (docs/hangs.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loop_overhead import thread_cpu  # this folder's, first on the path of a script run from it
from model_utils.launch.distributed import free_port

PLACES = ("between", "adjacent")


def _compute(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _rank(rank: int, port: int, ns: argparse.Namespace, results: dict[str, dict[str, float]]) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    row, rows = torch.zeros(11, dtype=torch.float64), torch.empty(22, dtype=torch.float64)
    gradients = torch.zeros(200_000)

    def step(place: str | None) -> None:
        _compute(ns.compute_ms)
        dist.all_reduce(gradients)
        _compute(ns.compute_ms / 2)
        if place == "between":
            dist.all_gather_into_tensor(rows, row)
        _compute(ns.compute_ms / 2)
        _compute(ns.compute_ms)
        if place == "adjacent":
            dist.all_gather_into_tensor(rows, row)
        dist.all_reduce(gradients)

    for _ in range(10):
        step("between")
    for place in PLACES:
        spent: dict[tuple[bool, str], float] = {}
        for extra in (False, True, False, True):
            before = thread_cpu()
            for _ in range(ns.steps):
                step(place if extra else None)
            for name, seconds in thread_cpu().items():
                ms = 1e3 * (seconds - before.get(name, 0.0))
                spent[extra, name] = spent.get((extra, name), 0.0) + ms / (2 * ns.steps)
        if rank == 0:
            names = {name for _, name in spent}
            results[place] = {n: spent.get((True, n), 0.0) - spent.get((False, n), 0.0) for n in names}
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per block (4 blocks per placement)")
    parser.add_argument("--compute_ms", type=float, default=8.0, help="the step's stretches of compute, ms")
    ns = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), ns, results), nprocs=2)
        got = dict(results)
    print("rank 0's extra CPU a step for one 11-number all-gather, ms, by thread (and in all)")
    for place in PLACES:
        by_thread = {n: ms for n, ms in got[place].items() if abs(ms) >= 0.005}
        shown = ", ".join(f"{n} {ms:+.3f}" for n, ms in sorted(by_thread.items()))
        print(f"  {place:8} {shown}; all {sum(got[place].values()):+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
