"""The kit's training step against a minimal hand-written DeepSpeed loop's, CPU and wall time per step, on 2 gloo
CPU ranks (issue #28's goal: the kit's CPU per step at most 1.03x the minimal loop's).

    .venv/bin/python tools/loop_overhead.py [--block 10] [--rounds 12] [--warmup 5] [--split] [--threads]
        [--profile N] [-- FLAGS...]

Each rank builds both from one resolved run of the training flags (default: the embedded default, as
`./train-singlenode.sh` trains it, without validation or checkpoints):

- the kit: the real Trainer, a turn of its loop as `fit` runs it (Trainer.advance: the step with its prefetched
  data, the per-step collective, the watchdog and straggler notes, the observers, the logging);
- the minimal loop: `deepspeed.initialize` on the same model config with the DeepSpeed config the kit resolved
  and the same two parameter groups (weight decay on the matrices, none on norms and biases, as Hugging Face's
  Trainer and nanoGPT split them: the training's math, not the kit's cost; --one_group passes
  `model.parameters()` instead), and per micro-batch `engine(input_ids, labels).loss`, `engine.backward`,
  `engine.step`, reading the same blocks through the same sampler, and one `.item()` of the loss per step.

Blocks of --block steps alternate, the minimal loop's first and last (reference, kit, reference, ..., reference:
--rounds kit blocks), so the machine's drift falls on both; each kit block is compared with the mean of the two
reference blocks around it. --with_collective: the minimal loop also makes the kit's per-step collective before its
last backward (loop/consensus.py, with the loss, six flags and a target count), which takes that part out of the
ratio. CPU is the process's
(every thread: the kit's prefetch and watchdog threads count against it). It prints each rank's CPU and wall per
step and the ratios (median over the rounds, and of the means); --profile N adds rank 0's N costliest functions
of each (cProfile with the training thread's CPU clock, and slower, so a profiled run's ratios are not the figures).

This machine's CPU time drifts by 10-30% from step to step, so one step's ratio says little: --block 1 --rounds 400
alternates single steps and compares the means of 400 each. Two views put the difference where it is, each far less
noisy than the whole step: --split parts the training thread's CPU per step (DeepSpeed's forward, backward and step
calls, the kit's collective, the rest of the loop, as means); --threads gives every thread's CPU per step (the
kernel's count: gloo's two threads carry most of a collective's cost).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch.multiprocessing as mp

from model_utils.launch.distributed import free_port

REFERENCE, KIT = "reference", "kit"


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads so far, summed by thread name (the kernel's ns count); also
    tools/collective_placement.py's."""
    spent: dict[str, float] = {}
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = python_names.get(int(task.name)) or (task / "comm").read_text().strip()
            ns_run = int((task / "schedstat").read_text().split()[0])
        except OSError:  # a thread that ended meanwhile
            continue
        name = re.sub(r"[-_:]?\d+$", "", name)  # a pool's threads by their pool's name
        spent[name] = spent.get(name, 0.0) + ns_run / 1e9
    return spent


class _Split:
    """The training thread's CPU per step in named parts: DeepSpeed's forward, backward and step calls, and the
    kit's collective; the rest of the step is the loop's own (--split)."""

    PARTS = ("deepspeed", "collective")

    def __init__(self) -> None:
        self.spent = dict.fromkeys(self.PARTS, 0.0)
        self.steps: dict[str, list[dict[str, float]]] = {REFERENCE: [], KIT: []}

    def wrap(self, owner: object, name: str, part: str) -> None:
        call = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            started = time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                self.spent[part] += time.thread_time() - started

        setattr(owner, name, timed)

    def wrap_engine(self, engine: object) -> None:
        for name in ("forward", "backward", "step"):
            self.wrap(engine, name, "deepspeed")

    def record(self, phase: str, step: object) -> None:
        self.spent = dict.fromkeys(self.PARTS, 0.0)
        started = time.thread_time()
        step()  # type: ignore[operator]
        total = time.thread_time() - started
        self.steps[phase].append({**self.spent, "loop": total - sum(self.spent.values()), "total": total})

    def means(self) -> dict[str, dict[str, float]]:
        """Means, not medians: the steps that log (every --logging_freq) count with their cost."""
        return {
            phase: {part: statistics.fmean(s[part] for s in steps) for part in steps[0]}
            for phase, steps in self.steps.items()
        }


def _rank(
    rank: int, port: int, ns: argparse.Namespace, scratch: str, results: dict[int | str, object]
) -> None:
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(port)
    log = os.open(f"{scratch}/rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)  # the kit's lines are written as in a run (their cost counts), not shown
    os.dup2(log, 2)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from model_utils.config.arguments import parse_args
    from model_utils.data.sampler import BlockSampler, DataPosition
    from model_utils.launch import distributed, startup
    from model_utils.loop import consensus
    from model_utils.loop.hooks import REQUESTS
    from model_utils.loop.trainer import Trainer
    from model_utils.observe import watchdog
    from model_utils.optim import param_groups
    from model_utils.resolve import resolver

    steps = ns.warmup + ns.block * (2 * ns.rounds + 1) + 10  # never the last step: no final save
    flags = [
        "--max_steps", str(steps), "--checkpoint_freq", str(10 * steps), "--validation_fraction", "0",
        "--checkpoint_dir", f"{scratch}/ckpt", "--data_cache_dir", f"{scratch}/data",
        "--metrics_file", f"{scratch}/metrics.jsonl", *ns.flags,
    ]  # fmt: skip
    cfg = parse_args(flags)
    hang_timeout = cfg.loop.hang_timeout  # the collectives' timeout as train_deepspeed.py sets it
    info = distributed.init_distributed(watchdog.collective_timeout_s(hang_timeout) if hang_timeout else None)
    run = resolver.prepare_on_ranks(cfg, info)

    # The minimal loop, by hand.
    from transformers import AutoModelForCausalLM

    deepspeed = startup.import_deepspeed()
    torch.manual_seed(cfg.loop.seed)
    model = AutoModelForCausalLM.from_config(run.model_config, attn_implementation="sdpa")
    groups = param_groups.split_for_weight_decay(model, cfg.optim.no_decay_embeddings)
    parameters = model.parameters() if ns.one_group else groups.optimizer_groups()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters, config=run.deepspeed_config())
    engine.train()
    blocks = run.train_blocks
    sampler = BlockSampler.of(
        blocks, run.micro_batch_size, run.gradient_accumulation_steps, rank, 2, cfg.loop.seed
    )
    position = DataPosition()
    agreeing = consensus.StepConsensus(rank, 2, info.device)

    def reference_step() -> None:
        nonlocal position
        micro_batches = sampler.step_indices(position)
        for i, indices in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            batch = torch.as_tensor(blocks.rows(indices).tokens)
            loss = engine(input_ids=batch, labels=batch).loss
            if ns.with_collective and last:
                agreeing.agree(loss.detach(), [False] * len(REQUESTS), targets=1)
            engine.backward(loss)
            engine.step()
        position = sampler.advance(position)
        loss.item()

    trainer = Trainer(run, info)
    split = _Split() if ns.split else None
    if split is not None:
        split.wrap_engine(engine)
        split.wrap_engine(trainer.engine._engine)  # type: ignore[attr-defined]
        split.wrap(consensus.StepConsensus, "agree", "collective")
    try:
        trainer.start()
        for _ in range(ns.warmup):
            reference_step()
            trainer.step()
        spent: dict[str, list[tuple[float, float]]] = {REFERENCE: [], KIT: []}
        by_thread: dict[str, dict[str, float]] = {REFERENCE: {}, KIT: {}}
        profiles = {p: cProfile.Profile(time.thread_time) for p in (REFERENCE, KIT)}
        for phase in [REFERENCE, KIT] * ns.rounds + [REFERENCE]:
            step = reference_step if phase == REFERENCE else trainer.step
            dist.barrier()  # each block starts with the ranks together
            if ns.profile and rank == 0:
                profiles[phase].enable()
            threads_before = thread_cpu() if ns.threads else {}
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(ns.block):
                if split is not None:
                    split.record(phase, step)
                else:
                    step()
            spent[phase].append(
                ((time.process_time() - cpu) / ns.block, (time.perf_counter() - wall) / ns.block)
            )
            for name, seconds in (thread_cpu() if ns.threads else {}).items():
                counted = by_thread[phase]
                counted[name] = counted.get(name, 0.0) + seconds - threads_before.get(name, 0.0)
            profiles[phase].disable()
    finally:
        trainer.close()
    results[rank] = spent
    if split is not None:
        results[f"split {rank}"] = split.means()
    if ns.threads:
        results[f"threads {rank}"] = {
            phase: {name: s / len(spent[phase]) / ns.block for name, s in counted.items()}
            for phase, counted in by_thread.items()
        }
    if ns.profile and rank == 0:
        for phase, profile in profiles.items():
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(ns.profile_sort).print_stats(
                *ns.profile_filter, ns.profile
            )
            results[f"profile {phase}"] = text.getvalue()
    dist.destroy_process_group()


def _ratios(spent: dict[str, list[tuple[float, float]]], which: int) -> list[float]:
    """Each kit block's time over the mean of the reference blocks before and after it."""
    reference = [times[which] for times in spent[REFERENCE]]
    return [kit[which] / statistics.fmean(reference[i : i + 2]) for i, kit in enumerate(spent[KIT])]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--rounds", type=int, default=12, help="kit blocks (a reference block around each)")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each before the first block")
    parser.add_argument(
        "--with_collective",
        action="store_true",
        help="the minimal loop also makes the kit's per-step collective before its last backward: the ratio is then "
        "what the rest of the kit costs",
    )
    parser.add_argument(
        "--one_group",
        action="store_true",
        help="the minimal loop trains one parameter group (model.parameters()), not the kit's two (decayed or not)",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="also the training thread's CPU per step in parts (means): DeepSpeed's forward, backward and step "
        "calls, the kit's collective, the loop's own rest",
    )
    parser.add_argument(
        "--threads",
        action="store_true",
        help="also each thread's CPU per step (by thread name), kit and minimal",
    )
    parser.add_argument("--profile", type=int, default=0, help="print rank 0's N costliest functions of each")
    parser.add_argument("--profile_sort", default="tottime", help="pstats' order: tottime, cumulative, ...")
    parser.add_argument(
        "--profile_filter", action="append", default=[], help="only functions matching (regex)"
    )
    parser.add_argument("flags", nargs="*", help="training flags (after --), e.g. -- --micro_batch_size 2")
    ns = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The launchers' split of the cores between the ranks (templates/_common.sh.j2)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as scratch, mp.Manager() as manager:
        results = manager.dict()
        try:
            mp.spawn(_rank, args=(free_port(), ns, scratch, results), nprocs=2)
        except Exception:
            for log in sorted(Path(scratch).glob("rank*.log")):
                sys.stderr.write(f"--- {log.name}\n{log.read_text()[-4000:]}")
            raise
        got = dict(results)
    print(
        f"kit step vs a minimal hand-written DeepSpeed loop{' with one collective' if ns.with_collective else ''}"
        f"{' and one parameter group' if ns.one_group else ''}, "
        f"2 CPU ranks, {ns.rounds} kit blocks of {ns.block} "
        f"steps between {ns.rounds + 1} reference blocks (ratios: medians over the kit blocks)"
    )
    for name in (f"profile {REFERENCE}", f"profile {KIT}"):
        if name in got:
            print(f"--- {name} (rank 0)\n{got.pop(name)}")
    for rank in (0, 1):
        if (parts := got.pop(f"split {rank}", None)) is None:
            continue
        print(f"rank {rank}: the training thread's CPU per step, ms (means over the steps)")
        for phase, medians in parts.items():
            print(f"  {phase:10} " + ", ".join(f"{part} {1e3 * t:.3f}" for part, t in medians.items()))
    for rank in (0, 1):
        if (threads := got.pop(f"threads {rank}", None)) is None:
            continue
        print(f"rank {rank}: CPU per step by thread, ms (minimal loop, kit, difference)")
        names = sorted(set(threads[REFERENCE]) | set(threads[KIT]), key=lambda n: -threads[KIT].get(n, 0.0))
        for name in names:
            ref, kit = threads[REFERENCE].get(name, 0.0), threads[KIT].get(name, 0.0)
            if max(ref, kit) >= 5e-6:
                print(f"  {name:24} {1e3 * ref:8.3f} {1e3 * kit:8.3f} {1e3 * (kit - ref):+8.3f}")
    for rank, spent in sorted(got.items()):
        cpu, wall = _ratios(spent, 0), _ratios(spent, 1)
        kit_cpu = statistics.fmean(t[0] for t in spent[KIT])
        ref_cpu = statistics.fmean(t[0] for t in spent[REFERENCE])
        kit_wall = statistics.fmean(t[1] for t in spent[KIT])
        ref_wall = statistics.fmean(t[1] for t in spent[REFERENCE])
        print(
            f"rank {rank}: CPU {1e3 * kit_cpu:.1f} ms/step kit, {1e3 * ref_cpu:.1f} reference: "
            f"{kit_cpu / ref_cpu:.3f}x of the means, {statistics.median(cpu):.3f}x median (blocks {', '.join(f'{r:.3f}' for r in cpu)}); wall "
            f"{1e3 * kit_wall:.1f} ms/step kit, {1e3 * ref_wall:.1f} reference: {statistics.median(wall):.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
