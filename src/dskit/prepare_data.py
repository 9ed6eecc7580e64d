"""`dskit prepare-data OUT --dataset SOURCE`: tokenize a dataset once, in parallel, into token shards.

The source is planned as units (documents.py) and each unit is tokenized by one worker process into its shards
(token_shards.py); memory per process is one batch of documents, whatever the dataset's size. A re-run into the
same OUT tokenizes only the units not yet finished. Under a SLURM array each task takes every
--num_tasks-th unit (--task_index); whichever task finishes the last unit writes the manifest, after which
the training job (`--dependency=afterok:ARRAY_JOB`) can read OUT with `--dataset OUT`.

Two runs of the same command into one OUT (or of the same array task) do not race: the second waits on a lock
in OUT for the first, saying whose it is, then finds the units done. A re-run into a prepared OUT verifies its
shards and tokenizes again the units whose shards fail their checksums.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import multiprocessing
import os
import queue
import signal
import sys
import time
from pathlib import Path
from typing import Any

from model_utils.config.arguments import DataArgs, ModelArgs, field_help, reject_both_given
from model_utils.data import documents, token_shards
from model_utils.data.token_shards import TokenizerSpec
from model_utils.errors import CommandParser, ConfigError
from model_utils.model import models

# The training flags that say what to prepare; the rest of a training config does not apply here.
DATA_FLAGS = ("dataset", "dataset_config_name", "local_dataset", "text_field", "train_split")
DATA_FLAGS += ("validation_split", "validation_dataset", "validation_fraction")
DATA_FLAGS += ("data_format", "chat_template", "train_on_prompt", "enable_thinking")


def default_num_proc() -> int:
    """The cores this process may use: the SLURM allocation's, else the CPU affinity's."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        return int(slurm)
    return len(os.sched_getaffinity(0))


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="dskit prepare-data",
        description="Tokenize a dataset once, in parallel and in bounded memory, into token shards that "
        "training reads by memory map (--dataset OUT). A re-run finishes an interrupted preparation.",
    )
    p.add_argument(
        "output", metavar="OUT", help="the prepared-dataset directory to write (new, or to finish)"
    )
    for name in DATA_FLAGS:
        p.add_argument(f"--{name}", **field_help(DataArgs, name))
    for name in ("model", "tokenizer"):
        p.add_argument(f"--{name}", **field_help(ModelArgs, name))
    p.add_argument(
        "--num_proc",
        type=int,
        default=default_num_proc(),
        help="worker processes (default: SLURM_CPUS_PER_TASK, else the cores this process may use: %(default)s)",
    )
    p.add_argument("--max_tokens", type=int, help="prepare only a prefix of about this many training tokens")
    p.add_argument(
        "--unit_mb",
        type=float,
        default=documents.DEFAULT_UNIT_BYTES // 2**20,
        help="JSON lines and parquet data is cut into units of about this many MB, one per worker at a time",
    )
    p.add_argument("--task_index", type=int, default=0, help="this task of a SLURM array (0-based)")
    p.add_argument("--num_tasks", type=int, default=1, help="tasks sharing the units (the array's size)")
    p.add_argument(
        "--progress_every",
        type=float,
        default=30.0,
        help="seconds between progress lines when not on a terminal",
    )
    return p


def _check(args: argparse.Namespace) -> None:
    if args.num_proc < 1:
        raise ConfigError(f"--num_proc {args.num_proc}: use 1 or more")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max_tokens {args.max_tokens}: use a positive number of tokens")
    if not args.unit_mb > 0:
        raise ConfigError(f"--unit_mb {args.unit_mb}: use a positive size in MB")
    if not 0 <= args.task_index < args.num_tasks:
        raise ConfigError(f"--task_index {args.task_index} is outside [0, --num_tasks {args.num_tasks})")


# --- workers --------------------------------------------------------------------------------------------

_worker: dict[str, Any] = {}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _init_worker(spec: TokenizerSpec, record: dict[str, Any], progress: Any, parent: int) -> None:
    _end_with(parent)
    _worker["spec"], _worker["record"], _worker["progress"] = spec, record, progress
    progress.put(("pid", os.getpid()))  # so the driver can stop exactly its workers


def _end_with(parent: int) -> None:
    """The worker ends with its parent, also one killed outright (kill -9, the OOM killer), which stops no worker
    itself: the kernel kills it then (PR_SET_PDEATHSIG; it follows the thread that started the worker, the
    driver's). What it leaves unfinished, a re-run redoes."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the kernel was asked
        os._exit(1)


def _worker_unit(out: str, index: int) -> None:
    progress = _worker["progress"]
    token_shards.write_unit(
        Path(out),
        index,
        _worker["record"],
        _worker["spec"],
        lambda nbytes, tokens: progress.put((nbytes, tokens)),
    )


# --- progress -------------------------------------------------------------------------------------------


class Progress:
    """A bar on a terminal, else a line every `every` seconds: units, bytes read, tokens, tokens/s, ETA."""

    def __init__(self, total_bytes: int | None, units: int, every: float) -> None:
        self.total, self.units, self.every = total_bytes, units, every
        self.start = self.last = time.monotonic()
        self.nbytes = self.tokens = self.units_done = 0
        self.bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes, unit="B", unit_scale=True, desc="prepare-data", file=sys.stderr
            )

    def add(self, nbytes: int, tokens: int) -> None:
        self.nbytes += nbytes
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.tokens / 1e6:,.1f}M tokens", refresh=False)
        elif time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            print(self.line(), flush=True)

    def unit_done(self) -> None:
        self.units_done += 1

    def line(self) -> str:
        took = max(time.monotonic() - self.start, 1e-9)
        read = f"{self.nbytes / 2**20:,.0f} MB" + (f" of {self.total / 2**20:,.0f} MB" if self.total else "")
        eta = ""
        if self.total and self.nbytes:
            eta = f", eta {max(0.0, took * (self.total / self.nbytes - 1)) / 60:.1f} min"
        return (
            f"prepare-data: {self.units_done}/{self.units} units, {read} read, {self.tokens / 1e6:,.1f}M tokens, "
            f"{self.tokens / took / 1e6:.2f}M tokens/s{eta}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --- the driver -----------------------------------------------------------------------------------------


def _run_units(
    out: Path, record: dict[str, Any], spec: TokenizerSpec, todo: list[int], num_proc: int, progress: Progress
) -> None:
    """Tokenize units `todo` with `num_proc` processes, in order; with --max_tokens, stop once the prefix is
    done. One process: in this one, so what is measured is the tokenizing alone."""
    if num_proc == 1:
        token_shards.write_units(out, record, spec, todo, progress.add, progress.unit_done)
        return
    cap = record["max_tokens"]

    def prefix_done() -> bool:
        return cap is not None and token_shards.finish(out) is not None

    context = multiprocessing.get_context("spawn")  # no fork of a process holding a tokenizer's threads
    updates = context.Queue()
    pool = cf.ProcessPoolExecutor(
        num_proc, mp_context=context, initializer=_init_worker, initargs=(spec, record, updates, os.getpid())
    )
    pending = list(todo)
    running: set[cf.Future[int]] = set()
    workers: set[int] = set()
    try:
        while pending or running:
            while pending and len(running) < num_proc:  # in order, so a prefix needs no unit beyond it
                if token_shards.state(out) == "prepared":  # another array task finished the prefix
                    pending.clear()
                    break
                index = pending.pop(0)
                running.add(pool.submit(_worker_unit, str(out), index))
            done, running = cf.wait(running, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            _drain(updates, progress, workers)
            for future in done:
                future.result()  # a worker's error ends the preparation here
                progress.unit_done()
            if done and prefix_done():
                break
    finally:
        if running:  # an error, or a prefix done while units past it still run: they are not needed
            _drain(updates, progress, workers)
            # Every process of the pool, also one whose pid has not come through `updates` yet: a worker left
            # alive would wait forever on the task queue's lock, which a stopped one may have held.
            _stop(workers | {child.pid for child in multiprocessing.active_children() if child.pid})
        pool.shutdown(wait=True, cancel_futures=True)
        _drain(updates, progress, workers)


def _drain(updates: Any, progress: Progress, workers: set[int]) -> None:
    while True:
        try:
            first, second = updates.get_nowait()
        except queue.Empty:
            return
        if first == "pid":
            workers.add(second)
        else:
            progress.add(first, second)


def _stop(workers: set[int]) -> None:
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def lock_name(task_index: int, num_tasks: int) -> str:
    """The lock's name in OUT: the tasks of an array share OUT (each its own units); only the same task run twice
    must wait."""
    lock = token_shards.LOCK
    return lock if num_tasks == 1 else f"{lock}.task-{task_index}-of-{num_tasks}"


def prepare(args: argparse.Namespace) -> int:
    _check(args)
    given = {name: getattr(args, name) for name in DATA_FLAGS if getattr(args, name) is not None}
    reject_both_given(set(given))
    data = DataArgs(**given)
    model = args.model or ModelArgs().model
    tokenizer = models.load_tokenizer(models.resolve_model_source(model), args.tokenizer)
    spec = TokenizerSpec.of(tokenizer, args.tokenizer or model)
    out = Path(args.output).expanduser()
    start = time.monotonic()
    plan = documents.plan(data, max(1, int(args.unit_mb * 2**20)))
    unit_mb = None if args.unit_mb == documents.DEFAULT_UNIT_BYTES / 2**20 else args.unit_mb
    rows = token_shards.rows_record(data, plan, tokenizer, lambda line: print(line, flush=True))
    record = token_shards.plan_record(data, plan, spec, args.max_tokens, unit_mb, rows)
    token_shards.begin(out, record)  # refuses a directory holding another preparation
    lock = lock_name(args.task_index, args.num_tasks)
    with token_shards.preparing(out, lock, lambda line: print(f"prepare-data: {line}", flush=True)):
        return _prepare_locked(args, out, data, plan, record, spec, start)


def _prepare_locked(
    args: argparse.Namespace,
    out: Path,
    data: DataArgs,
    plan: documents.Plan,
    record: dict[str, Any],
    spec: TokenizerSpec,
    start: float,
) -> int:
    if token_shards.state(out) == "prepared":
        manifest = json.loads((out / token_shards.MANIFEST).read_text())
        damaged = token_shards.damaged_units(out, manifest)
        if not damaged:
            print(f"{out} is prepared already: train with --dataset {out}")
            return 0
        shown = "; ".join(list(damaged.values())[:3]) + ("; ..." if len(damaged) > 3 else "")
        print(
            f"prepare-data: {len(damaged)} units' shards fail verification ({shown}): tokenizing them again"
        )
        token_shards.discard_units(out, sorted(damaged))
    todo = [i for i in token_shards.missing_units(out) if i % args.num_tasks == args.task_index]
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process is one core: parallelism comes from num_proc
    num_proc = max(1, min(args.num_proc, len(todo)))
    task = f"task {args.task_index}/{args.num_tasks}: " if args.num_tasks > 1 else ""
    print(
        f"prepare-data: {task}{len(todo)} of {len(plan.units)} units of {data.dataset} to tokenize with "
        f"{num_proc} process{'es' if num_proc > 1 else ''} into {out}",
        flush=True,
    )
    progress = Progress(
        None if plan.total_bytes is None else sum(plan.units[i].size for i in todo),
        len(todo),
        args.progress_every,
    )
    try:
        _run_units(out, record, spec, todo, num_proc, progress)
    finally:
        progress.close()
    manifest = token_shards.finish(out)
    took = time.monotonic() - start
    if manifest is None:
        print(
            f"prepare-data: {task}done in {took:.0f} s; the task that finishes the last unit writes the manifest"
        )
        return 0
    tokens, docs = manifest["tokens"], manifest["documents"]
    disk = sum(p.stat().st_size for p in out.rglob("*.bin"))
    print(
        f"prepared {out}: {tokens['train']:,} train and {tokens['validation']:,} validation tokens from "
        f"{docs['train'] + docs['validation']:,} documents, {disk / 2**20:,.1f} MB on disk, in {took:.1f} s "
        f"({progress.tokens / max(took, 1e-9) / 1e6:.2f}M tokens/s): train with --dataset {out}",
        flush=True,
    )
    return 0


def main(argv: list[str]) -> int:
    return prepare(build_parser().parse_args(argv))
