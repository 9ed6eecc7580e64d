"""`dskit bench --data SOURCE`: `dskit prepare-data` at 1, 2 and N processes, and the read path against the
trainer's need.

Preparation: each process count prepares SOURCE into a fresh directory in its own child process, the command a
user runs (`python -m dskit.cli prepare-data`), while a thread samples the resident memory of the child and
every process under it. Tokens come from the manifest; the tokenizing time is from the plan file's write to the
manifest's (what grows with the data), the wall time is the whole command (start-up included). The CPU seconds
are the command's and its workers' (getrusage of the children), less those its processes had used when the plan
file appeared (the start-up, sampled with the memory): tokens per CPU second are tokens/s per core that other work
on a shared machine does not dilute. The shards'
checksums must be the same at every process count: the parallel preparation is only correct if it writes the
stream one process writes.

Read path: the last preparation's train shards, memory-mapped and cut into blocks, read one global batch per
step in the sampler's order with `batches.gather`, the function a rank's batch thread calls, on one thread. The
shards were just written, so this is the page cache's rate, not the storage's. The trainer's need is the tokens/s
per rank of a real run (its metrics file) or a given figure; the headroom is the ratio of the two.

`--make_corpus PATH --corpus_mb N` writes the corpus the measurements use: the Python sources of the standard
library and of the site-packages of the Python running it (the venv's), one file per JSON line, in a fixed order,
cycled to exactly N MB.

`--verify DIR`: what opening the prepared dataset DIR costs for its shard checksums (token_shards.verify_shards):
the first open from storage (the shards' pages dropped from the page cache first, file by file), the first open
from the page cache, and a resume or second launch, which finds every shard in DIR/.verified.json. The record is
deleted before each first open, and left as the resume wrote it. `--make_prepared PATH --prepared_mb N` writes a
prepared dataset of N MB of random token ids in the kit's format (unit records, shards, the manifest written by
token_shards.finish) to measure it at a size without tokenizing a corpus that large first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import xxhash

from dskit import columns, prepare_data
from model_utils.config.arguments import DataArgs, ModelArgs, field_help
from model_utils.data import documents, token_shards
from model_utils.errors import CommandParser, ConfigError

GIB = 2**30
MB = 2**20
DEFAULT_SEQ_LENGTH = 2048
SAMPLE_EVERY_S = 0.1


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="dskit bench --data",
        description="Benchmark data preparation (`dskit prepare-data` at 1, 2 and N processes: tokens/s, "
        "tokens/s per process, peak memory, disk) and the read path (blocks/s from the memory-mapped shards) "
        "against what a training rank consumes.",
    )
    p.add_argument("--data", metavar="SOURCE", help="what to prepare: any --dataset of `dskit prepare-data`")
    for name in prepare_data.DATA_FLAGS:
        if name != "dataset":
            p.add_argument(f"--{name}", **field_help(DataArgs, name))
    for name in ("model", "tokenizer"):
        p.add_argument(f"--{name}", **field_help(ModelArgs, name))
    p.add_argument("--max_tokens", type=int, help="prepare-data's --max_tokens: only a prefix of the data")
    p.add_argument("--unit_mb", type=int, help="prepare-data's --unit_mb (default: prepare-data's)")
    p.add_argument(
        "--procs",
        help=f"process counts to prepare with, e.g. 1,2,4 (default: 1, 2 and the cores available, "
        f"{prepare_data.default_num_proc()})",
    )
    p.add_argument(
        "--work_dir", help="where the preparations are written, then deleted (default: the temp dir)"
    )
    p.add_argument(
        "--seq_length",
        type=int,
        default=DEFAULT_SEQ_LENGTH,
        help="tokens per block on the read path (default: %(default)s, less if the data is smaller)",
    )
    p.add_argument(
        "--micro_batch_size",
        type=int,
        default=8,
        help="read path: blocks per micro-batch (default: %(default)s)",
    )
    p.add_argument(
        "--gradient_accumulation_steps",
        type=int,
        default=1,
        help="read path: micro-batches per step (default: %(default)s)",
    )
    p.add_argument(
        "--read_steps", type=int, default=1000, help="read path: timed steps (default: %(default)s)"
    )
    need = p.add_mutually_exclusive_group()
    need.add_argument(
        "--metrics", metavar="PATH", help="a training run's metrics file: its tokens/s per rank is the need"
    )
    need.add_argument("--need_tokens_per_s", type=float, help="the trainer's need in tokens/s per rank")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT")
    p.add_argument(
        "--make_corpus",
        metavar="PATH",
        help="first write a benchmark corpus to PATH: this Python's sources as JSON lines {'text': ...}",
    )
    p.add_argument(
        "--corpus_mb", type=int, default=50, help="size of --make_corpus in MB (default: %(default)s)"
    )
    p.add_argument(
        "--verify",
        metavar="DIR",
        help="time the shard verification of opening the prepared dataset DIR: first open (from storage, "
        "from the page cache) and a resume",
    )
    p.add_argument(
        "--make_prepared",
        metavar="PATH",
        help="first write a prepared dataset of random token ids to PATH (new), for --verify",
    )
    p.add_argument(
        "--prepared_mb", type=int, default=1024, help="size of --make_prepared in MB (default: %(default)s)"
    )
    return p


# --- the benchmark corpus -------------------------------------------------------------------------------


def _source_roots() -> list[Path]:
    """The standard library and site-packages of the running Python (the venv's, when in one), each once."""
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        root = Path(paths[key]).resolve()
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


# Installed packages inside the standard library's dir: the base installation's own, which differ from machine
# to machine (the venv's are pinned by uv.lock); when they are the running Python's, purelib walks them.
_PRUNED = {"__pycache__", "site-packages", "dist-packages"}


def python_sources() -> Iterator[Path]:
    """Every .py file under the roots, walked in sorted order (lazily: a small corpus reads a few files)."""
    for root in _source_roots():
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _PRUNED)
            yield from (Path(folder, name) for name in sorted(files) if name.endswith(".py"))


def _line(text: str) -> bytes:
    return (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode()


def _fitted_line(text: str, size: int) -> bytes:
    """A line of exactly `size` bytes: the longest prefix of `text` that fits, padded with spaces."""
    low, high = 0, len(text)
    while low < high:  # the longest prefix whose line is at most `size` bytes
        mid = (low + high + 1) // 2
        if len(_line(text[:mid])) <= size:
            low = mid
        else:
            high = mid - 1
    prefix = text[:low]
    return _line(prefix + " " * (size - len(_line(prefix))))


def make_corpus(path: Path, megabytes: int) -> dict[str, Any]:
    """Write `megabytes` MB (exactly) of JSON lines, one source file each, cycling through the files."""
    if megabytes < 1:
        raise ConfigError(f"--corpus_mb {megabytes}: use 1 or more")
    target = megabytes * MB
    shortest = len(_line(""))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    written = documents = passes = 0
    with tmp.open("wb") as out:
        while written < target:
            passes += 1
            found = False
            for source in python_sources():
                try:
                    text = source.read_bytes().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue  # unreadable or not UTF-8: not text a tokenizer would see
                if not text.strip():
                    continue
                found = True
                line = _line(text)
                left = target - written
                if len(line) > left - shortest:  # the last line: cut to end the file at exactly `target`
                    line = _fitted_line(text, left)
                out.write(line)
                written += len(line)
                documents += 1
                if written >= target:
                    break
            if not found:
                raise ConfigError(f"no Python sources under {', '.join(map(str, _source_roots()))}")
    tmp.replace(path)
    return {"path": str(path), "bytes": written, "documents": documents, "passes": passes}


# --- preparation ----------------------------------------------------------------------------------------


class TreeMemory:
    """Samples the RSS of a process and all its descendants: the peak of their sum at one sample, and the
    peak of the largest one. RSS counts shared pages (libraries, the page cache of mapped files) in every
    process that maps them, so the sum is an upper bound of what the tree holds. With `mark`, also the CPU
    seconds the tree had used at the first sample that finds that file (None until then)."""

    def __init__(self, pid: int, every: float = SAMPLE_EVERY_S, mark: Path | None = None) -> None:
        self.pid, self.every, self.mark = pid, every, mark
        self.peak_tree = self.peak_process = self.samples = 0
        self.cpu_at_mark: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dskit-rss", daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every):
                return

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:  # gone: nothing to sample
            return
        # Looked for before the CPU is read: the CPU then includes all the work done before the file was written.
        marked = self.cpu_at_mark is None and self.mark is not None and self.mark.exists()
        sizes, cpu = [], 0.0
        for process in tree:
            try:
                sizes.append(process.memory_info().rss)
                if marked:
                    times = process.cpu_times()
                    cpu += times.user + times.system
            except psutil.Error:  # exited between the listing and the read
                continue
        if marked:
            self.cpu_at_mark = cpu
        if sizes:
            self.samples += 1
            self.peak_tree = max(self.peak_tree, sum(sizes))
            self.peak_process = max(self.peak_process, max(sizes))


@dataclass
class PrepRun:
    procs: int
    units: int
    wall_s: float  # the whole command: start-up (imports, tokenizer, planning), tokenizing, exit
    tokenize_s: float  # the plan written -> the manifest written
    tokens: int  # train + validation, from the manifest
    documents: int
    tokens_per_s: float  # over tokenize_s
    tokens_per_s_wall: float
    tokens_per_s_per_proc: float  # per process that had a unit to work on: min(procs, units)
    peak_rss_tree_gib: float
    peak_rss_process_gib: float
    rss_samples: int
    disk_mb: float
    shards_digest: str  # of the manifest's shard checksums: equal digests, identical shards
    cpu_s: float = 0.0  # the whole command's CPU seconds, its worker processes' included
    startup_cpu_s: float | None = None  # of those, the ones used when the plan file appeared (None: not seen)
    tokens_per_cpu_s: float | None = None  # over cpu_s - startup_cpu_s
    speedup: float | None = None


def parse_procs(text: str | None, cores: int) -> list[int]:
    if text is None:
        return sorted({1, 2, cores})
    try:
        procs = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise ConfigError(f"--procs {text!r}: use process counts separated by commas, e.g. 1,2,4") from None
    if not procs or procs[0] < 1:
        raise ConfigError(f"--procs {text!r}: use process counts of 1 or more, e.g. 1,2,4")
    return procs


def _prepare_command(ns: argparse.Namespace, out: Path, procs: int) -> list[str]:
    command = [sys.executable, "-m", "dskit.cli", "prepare-data", str(out), "--dataset", ns.data]
    command += ["--num_proc", str(procs)]
    passed = [n for n in prepare_data.DATA_FLAGS if n != "dataset"] + ["model", "tokenizer"]
    passed += ["max_tokens", "unit_mb"]
    for name in passed:
        value = getattr(ns, name)
        if value is not None:
            command += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return command


def shards_digest(manifest: dict[str, Any]) -> str:
    shards = [
        [split, s["file"], s["tokens"], s["xxh3"]]
        for split in token_shards.SPLITS
        for s in manifest["shards"][split]
    ]
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16]


def run_prepare(ns: argparse.Namespace, procs: int, out: Path, log: Path) -> PrepRun:
    """One preparation in a child process, its process tree's memory sampled while it runs."""
    with log.open("wb") as output:
        used_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        child = subprocess.Popen(
            _prepare_command(ns, out, procs),
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        with TreeMemory(child.pid, mark=out / token_shards.PLAN) as memory:
            code = child.wait()
        wall = time.perf_counter() - started
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = used.ru_utime - used_before.ru_utime + used.ru_stime - used_before.ru_stime
    if code != 0 or token_shards.state(out) != "prepared":
        lines = log.read_text(errors="replace").strip().splitlines()
        said = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
        if said:  # prepare-data's own one line (bad input): passed on as this command's
            raise ConfigError(f"prepare-data: {said[-1]}")
        print("\n".join(lines[-20:]), file=sys.stderr)  # a crash: its traceback
        raise ConfigError(f"prepare-data with --num_proc {procs} failed (exit {code}): see its output above")
    manifest = token_shards.open_prepared(out).manifest
    plan = json.loads((out / token_shards.PLAN).read_text())
    # File times (a few ms coarse), not the child's output: the span that grows with the data, without the
    # start-up.
    span = (
        (out / token_shards.MANIFEST).stat().st_mtime_ns - (out / token_shards.PLAN).stat().st_mtime_ns
    ) / 1e9
    tokenize = span if span > 0 else wall  # a filesystem with coarse times: the wall time is what is left
    tokens = sum(manifest["tokens"].values())
    units = len(plan["units"])
    return PrepRun(
        procs=procs,
        units=units,
        wall_s=wall,
        tokenize_s=tokenize,
        tokens=tokens,
        documents=sum(manifest["documents"].values()),
        tokens_per_s=tokens / tokenize,
        tokens_per_s_wall=tokens / wall,
        tokens_per_s_per_proc=tokens / tokenize / min(procs, units),
        peak_rss_tree_gib=memory.peak_tree / GIB,
        peak_rss_process_gib=memory.peak_process / GIB,
        rss_samples=memory.samples,
        disk_mb=sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / MB,
        shards_digest=shards_digest(manifest),
        cpu_s=cpu,
        startup_cpu_s=memory.cpu_at_mark,
        tokens_per_cpu_s=None
        if memory.cpu_at_mark is None or cpu <= memory.cpu_at_mark
        else tokens / (cpu - memory.cpu_at_mark),
    )


# --- the read path --------------------------------------------------------------------------------------


@dataclass
class ReadPath:
    seq_length: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    steps: int
    blocks: int  # in the split, at this sequence length
    pinned: bool
    seconds: float
    blocks_per_s: float
    tokens_per_s: float


def time_read(path: Path, seq_length: int, micro: int, accumulation: int, steps: int) -> ReadPath:
    """One rank's batch thread, alone: `steps` steps of `micro x accumulation` blocks, in sampler order."""
    import torch  # only the read path needs it

    from model_utils.data import step_batches
    from model_utils.data.sampler import BlockSampler, DataPosition

    dataset = token_shards.open_prepared(path)
    per_step = micro * accumulation
    seq = min(seq_length, dataset.tokens(token_shards.TRAIN) // per_step)
    if seq < 1:
        raise ConfigError(
            f"{path}: {dataset.tokens(token_shards.TRAIN)} train tokens cannot fill one step of {per_step} blocks"
        )
    blocks = dataset.blocks(token_shards.TRAIN, seq)
    sampler = BlockSampler(len(blocks), micro, accumulation, 0, 1, seed=0)
    pin = torch.cuda.is_available()  # as the trainer's batch thread does on CUDA
    position = DataPosition()

    def step() -> None:
        nonlocal position
        for indices in sampler.step_indices(position):
            step_batches.gather(blocks, indices, pin)
        position = sampler.advance(position)

    step()  # untimed: the first mapping of the shards and torch's first tensor
    started = time.perf_counter()
    for _ in range(steps):
        step()
    took = time.perf_counter() - started
    rate = steps * per_step / took
    return ReadPath(seq, micro, accumulation, steps, len(blocks), pin, took, rate, rate * seq)


# --- the trainer's need ---------------------------------------------------------------------------------


@dataclass
class Need:
    tokens_per_s_per_rank: float
    source: str
    world_size: int | None = None
    step_time_s: float | None = None
    intervals: int | None = None  # logged intervals the median is over


def need_from_metrics(path: Path) -> Need:
    """The median tokens/s per rank of a run's logged intervals, leaving out the first after each (re)start,
    which holds the first step's warm-up, unless nothing else was logged."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(
            f"--metrics {path}: cannot read it ({e.strerror}): pass a run's metrics file"
        ) from None
    steps: list[dict[str, Any]] = []
    first: list[dict[str, Any]] = []
    world_size = None
    after_start = True
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed run
        if record.get("event") == "start":
            world_size, after_start = record.get("world_size", world_size), True
        elif record.get("tokens_per_s_per_device") is not None:
            (first if after_start else steps).append(record)
            after_start = False
    steps = steps or first
    if not steps:
        raise ConfigError(
            f"--metrics {path}: no logged training steps (tokens_per_s_per_device): pass a run's metrics file"
        )
    step_times = [r["step_time_s"] for r in steps if r.get("step_time_s") is not None]
    return Need(
        tokens_per_s_per_rank=statistics.median(r["tokens_per_s_per_device"] for r in steps),
        source=str(path),
        world_size=world_size,
        step_time_s=statistics.median(step_times) if step_times else None,
        intervals=len(steps),
    )


def need_line(read: ReadPath, need: Need | None) -> str:
    if need is None:
        return (
            "headroom: not computed (pass --metrics PATH of a training run, or --need_tokens_per_s X, "
            "for the trainer's tokens/s per rank)"
        )
    where = need.source
    if need.intervals is not None:
        details = [f"median of {need.intervals} logged intervals"]
        details += [] if need.world_size is None else [f"world size {need.world_size}"]
        details += [] if need.step_time_s is None else [f"{need.step_time_s:.3g} s/step"]
        where += f": {', '.join(details)}"
    return (
        f"trainer's need: {need.tokens_per_s_per_rank:,.0f} tokens/s per rank ({where}); read path headroom: "
        f"{read.tokens_per_s / need.tokens_per_s_per_rank:,.1f}x"
    )


# --- shard verification ---------------------------------------------------------------------------------

SHARD_MB = 32  # about what a unit of 64 MB of text becomes in uint16 ids


def make_prepared(path: Path, megabytes: int, shard_mb: int = SHARD_MB) -> dict[str, Any]:
    """A prepared dataset of `megabytes` MB of random uint16 token ids in shards of `shard_mb` MB, as
    prepare-data lays it out: plan, a record per unit with its shards' checksums, then the manifest."""
    if path.exists():
        raise ConfigError(f"--make_prepared {path} exists: pass a new path")
    total, per_shard = megabytes * MB, shard_mb * MB
    units = max(1, math.ceil(total / per_shard))
    record = {
        "format_version": token_shards.FORMAT_VERSION,
        "kit_version": token_shards.kit_version(),
        "source": {
            "dataset": f"random token ids (dskit bench --make_prepared, {megabytes} MB)",
            "config_name": None,
            "train_split": "train",
            "fingerprint": "random-seed-0",
            "bytes": None,
        },
        "tokenizer": {"name": "none", "fingerprint": "none", "eos_id": 0, "vocab_size": 2**16},
        "dtype": "uint16",
        "seq_length": None,
        "text_field": "text",
        "validation": {"fraction": 0.0},
        "max_tokens": None,
        "units": [{"random": index} for index in range(units)],
    }
    path.mkdir(parents=True)
    (path / token_shards.PLAN).write_text(json.dumps(record, indent=1))
    rng = np.random.default_rng(0)
    for index in range(units):
        size = min(per_shard, total - index * per_shard) // 2 * 2
        shards = {}
        for split, nbytes in ((token_shards.TRAIN, size), (token_shards.VALIDATION, 0)):
            data = rng.integers(0, 2**16, nbytes // 2, dtype=np.uint16).tobytes()
            file = path / split / f"{index:05d}.bin"
            file.parent.mkdir(exist_ok=True)
            file.write_bytes(data)
            tokens = nbytes // 2
            shards[split] = {
                "file": f"{split}/{file.name}",
                "tokens": tokens,
                "documents": 1 if tokens else 0,
                "bytes": nbytes,
                "xxh3": xxhash.xxh3_64_hexdigest(data),
            }
        unit = path / "units" / f"{index:05d}.json"
        unit.parent.mkdir(exist_ok=True)
        unit.write_text(json.dumps({"unit": record["units"][index], "shards": shards, "empty_documents": 0}))
    manifest = token_shards.finish(path)
    assert manifest is not None, "every unit is written"
    return {"path": str(path), "bytes": sum(p.stat().st_size for p in path.rglob("*.bin")), "shards": units}


@dataclass
class VerifyRun:
    open: str
    shards: int
    hashed: int
    hashed_mb: float
    seconds: float
    mb_per_s: float | None  # None when nothing was hashed


def _drop_from_page_cache(files: list[Path]) -> None:
    """These files' pages only (written back first): the next read comes from storage, other data untouched."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_verify(path: Path) -> list[VerifyRun]:
    dataset = token_shards.open_prepared(path, say=lambda line: None)  # a damaged DIR says so here
    manifest = dataset.manifest
    files = [path / s["file"] for split in token_shards.SPLITS for s in manifest["shards"][split]]

    def measured(label: str) -> VerifyRun:
        found = token_shards.verify_shards(path, manifest, say=lambda line: None)
        assert not found.failed, found.failed
        mb = found.hashed_bytes / MB
        rate = mb / found.seconds if found.hashed else None
        return VerifyRun(label, found.shards, found.hashed, mb, found.seconds, rate)

    runs = []
    (path / token_shards.VERIFIED).unlink(missing_ok=True)
    _drop_from_page_cache(files)
    runs.append(measured("first open, from storage"))
    (path / token_shards.VERIFIED).unlink()
    runs.append(measured("first open, page cache"))
    runs.append(measured("resume (.verified.json)"))
    return runs


def format_verify_table(runs: list[VerifyRun]) -> str:
    header = ("open", "shards", "hashed", "hashed MB", "s", "MB/s")
    lines = [header]
    for r in runs:
        rate = "-" if r.mb_per_s is None else f"{r.mb_per_s:,.0f}"
        lines.append((r.open, str(r.shards), str(r.hashed), f"{r.hashed_mb:,.1f}", f"{r.seconds:.3f}", rate))
    return columns.align(lines)


# --- output ---------------------------------------------------------------------------------------------


def format_prep_table(runs: list[PrepRun]) -> str:
    header = (
        "procs",
        "units",
        "wall s",
        "tokenize s",
        "tokens",
        "tokens/s",
        "tokens/s/proc",
        "CPU s",
        "tokens/CPU s",
        "speed-up",
        "peak RSS tree GiB",
        "peak RSS proc GiB",
        "disk MB",
        "shards",
    )
    lines = [header]
    for r in runs:
        lines.append(
            (
                str(r.procs),
                str(r.units),
                f"{r.wall_s:.1f}",
                f"{r.tokenize_s:.2f}",
                f"{r.tokens:,}",
                f"{r.tokens_per_s:,.0f}",
                f"{r.tokens_per_s_per_proc:,.0f}",
                f"{r.cpu_s:.1f}",
                "-" if r.tokens_per_cpu_s is None else f"{r.tokens_per_cpu_s:,.0f}",
                "-" if r.speedup is None else f"{r.speedup:.2f}x",
                f"{r.peak_rss_tree_gib:.2f}",
                f"{r.peak_rss_process_gib:.2f}",
                f"{r.disk_mb:,.1f}",
                r.shards_digest[:8],
            )
        )
    return columns.align(lines)


def format_read_table(read: ReadPath) -> str:
    header = ("read path", "seq", "blocks/step", "steps", "blocks/s", "tokens/s", "ms/step")
    row = (
        f"gather, one thread, {'pinned' if read.pinned else 'not pinned'}",
        str(read.seq_length),
        str(read.micro_batch_size * read.gradient_accumulation_steps),
        str(read.steps),
        f"{read.blocks_per_s:,.0f}",
        f"{read.tokens_per_s:,.0f}",
        f"{1000 * read.seconds / read.steps:.3f}",
    )
    return columns.align([header, row])


# --- the command ----------------------------------------------------------------------------------------


def _check(ns: argparse.Namespace) -> None:
    for name in ("seq_length", "micro_batch_size", "gradient_accumulation_steps", "read_steps"):
        if getattr(ns, name) < 1:
            raise ConfigError(f"--{name} {getattr(ns, name)}: use 1 or more")
    if ns.need_tokens_per_s is not None and ns.need_tokens_per_s <= 0:
        raise ConfigError(f"--need_tokens_per_s {ns.need_tokens_per_s}: use a positive rate")
    # What prepare-data would refuse, refused before any child starts.
    for name in ("max_tokens", "unit_mb"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            raise ConfigError(f"--{name} {getattr(ns, name)}: use 1 or more")


def _verify_main(ns: argparse.Namespace) -> int:
    if ns.prepared_mb < 1:
        raise ConfigError(f"--prepared_mb {ns.prepared_mb}: use 1 or more")
    if ns.make_prepared:
        made = make_prepared(Path(ns.make_prepared).expanduser(), ns.prepared_mb)
        print(
            f"wrote {made['path']}: {made['bytes'] / MB:,.0f} MB of random token ids in {made['shards']} shards: "
            f"measure its verification with dskit bench --verify {made['path']}",
            flush=True,
        )
        if ns.verify is None:
            return 0
    if ns.verify is None:
        raise ConfigError(
            "pass --verify DIR (a prepared dataset), or --make_prepared PATH (dskit bench --help)"
        )
    path = Path(ns.verify).expanduser()
    runs = time_verify(path)
    size = sum(
        (path / s["file"]).stat().st_size
        for s in token_shards.open_prepared(path).manifest["shards"]["train"]
    )
    print(f"bench --verify: {path}, {runs[0].shards} shards, {size / MB:,.0f} MB of train shards", flush=True)
    print(format_verify_table(runs))
    print(
        "hashed: shards read and checksummed (xxh3); the resume reads none of them, only their size, times and inode"
    )
    if ns.json:
        out = Path(ns.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"dataset": str(path), "runs": [asdict(r) for r in runs]}, indent=2) + "\n")
    return 0


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.verify or ns.make_prepared:
        return _verify_main(ns)
    if ns.make_corpus:
        made = make_corpus(Path(ns.make_corpus).expanduser(), ns.corpus_mb)
        print(
            f"wrote {made['path']}: {made['bytes'] / MB:,.0f} MB of Python sources as JSON lines, "
            f"{made['documents']:,} documents ({made['passes']} pass{'es' if made['passes'] > 1 else ''} over "
            f"the sources): benchmark it with dskit bench --data {made['path']}",
            flush=True,
        )
        if ns.data is None:
            return 0
    if ns.data is None:
        raise ConfigError("pass --data SOURCE (what to prepare), or --make_corpus PATH (dskit bench --help)")
    _check(ns)
    cores = prepare_data.default_num_proc()
    procs = parse_procs(ns.procs, cores)
    need = None
    if ns.metrics:  # read first: a wrong path fails before minutes of preparing
        need = need_from_metrics(Path(ns.metrics).expanduser())
    elif ns.need_tokens_per_s is not None:
        need = Need(ns.need_tokens_per_s, "--need_tokens_per_s")
    if ns.work_dir:
        Path(ns.work_dir).mkdir(parents=True, exist_ok=True)
    runs: list[PrepRun] = []
    with tempfile.TemporaryDirectory(prefix="dskit-bench-data-", dir=ns.work_dir) as scratch:
        # Untimed: without it the first timed run alone would read the libraries and the source's first unit
        # from disk rather than from the page cache.
        print(f"bench --data: warm-up (a prefix of {ns.data}, untimed)", flush=True)
        warm_up = Path(scratch) / "warm-up"
        run_prepare(
            argparse.Namespace(**{**vars(ns), "max_tokens": 1}), 1, warm_up, warm_up.with_suffix(".log")
        )
        shutil.rmtree(warm_up)
        previous: Path | None = None
        for count in procs:
            out = Path(scratch) / f"prepared-{count}"
            print(
                f"bench --data: preparing {ns.data} with {count} process{'es' if count > 1 else ''}",
                flush=True,
            )
            runs.append(run_prepare(ns, count, out, Path(scratch) / f"prepare-{count}.log"))
            if previous is not None:  # one preparation on disk at a time: a large corpus's shards are large
                shutil.rmtree(previous)
            previous = out
        assert previous is not None
        plan = json.loads((previous / token_shards.PLAN).read_text())
        read = time_read(
            previous, ns.seq_length, ns.micro_batch_size, ns.gradient_accumulation_steps, ns.read_steps
        )
    for r in runs:
        r.speedup = r.tokens_per_s / runs[0].tokens_per_s
    identical = len({r.shards_digest for r in runs}) == 1 and len({r.tokens for r in runs}) == 1
    source_bytes = plan["source"]["bytes"]
    size = "" if source_bytes is None else f" ({source_bytes / MB:,.1f} MB)"
    print(
        f"bench --data: {ns.data}{size}, tokenizer {plan['tokenizer']['name']}, {runs[0].units} units, "
        f"{cores} cores available",
        flush=True,
    )
    print(format_prep_table(runs))
    print(
        "tokens/s: over the tokenizing (plan written -> manifest written), without the start-up; per proc: per "
        "process with a unit to work on;\nCPU s: the command's processes together; tokens/CPU s: over "
        "CPU s less those used when the plan was written (the start-up): per core, on a shared machine too;\n"
        "speed-up: vs the fewest processes; RSS: sampled every "
        f"{SAMPLE_EVERY_S:g} s, shared pages counted in each process (tree: the sum at one sample)"
    )
    if any(r.procs > r.units for r in runs):
        print(
            f"note: {runs[0].units} units, so at most {runs[0].units} processes worked: pass a smaller --unit_mb "
            "to measure more"
        )
    counts = ", ".join(str(r.procs) for r in runs)
    print(
        f"shards: identical at {counts} processes (manifest checksums)"
        if identical
        else f"shards: DIFFER between {counts} processes (manifest checksums): prepare-data is not deterministic"
    )
    print(format_read_table(read))
    print(need_line(read, need))
    if ns.json:
        out = Path(ns.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        figures = {
            "source": ns.data,
            "source_bytes": source_bytes,
            "tokenizer": plan["tokenizer"]["name"],
            "max_tokens": ns.max_tokens,
            "unit_mb": ns.unit_mb or documents.DEFAULT_UNIT_BYTES // MB,
            "units": runs[0].units,
            "cores": cores,
            "runs": [asdict(r) for r in runs],
            "shards_identical": identical,
            "read": asdict(read),
            "need": None if need is None else asdict(need),
            "headroom": None if need is None else read.tokens_per_s / need.tokens_per_s_per_rank,
        }
        out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if identical else 1
