"""`dskit bench`: the kit's real training path against a plain PyTorch loop, same model, batch and device.

The kit rows build a TrainConfig from training flags, run preflight and the real Trainer (DeepSpeed, the
configured ZeRO stage and offload, --liger/--compile; `--vary backend=fsdp` adds an FSDP2 row) with a throwaway checkpoint dir, and time
`Trainer.step()`. The reference is what a hand-written loop gets on the same device: the same model
config and blocks, bf16 autocast over fp32 weights, torch.optim.AdamW (fused on CUDA), gradient clipping at 1.0
like the kit's configs, and torch.compile on CUDA (eager on CPU, where compiling costs more than the few steps
it would time; `--reference compiled,eager` runs both, the ratios are to the first). It runs first: Liger
patches transformers' modeling code for the whole process.

One process, one device. Numbers are from this machine and these steps only; on CPU the table shows that the
path works, not how fast a GPU is.

`--preference_overhead` times a DPO step against the next-token loss on the same pairs, and the reference pass.
`--data SOURCE` (or `--make_corpus PATH`), and `--verify DIR` (or `--make_prepared PATH`), run the data
benchmarks of data_bench.py instead, `--checkpoint_mb SIZES` the checkpoint save and verification benchmark of
checkpoint_bench.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dskit import columns
from model_utils.assets import TOKENIZER_DIR
from model_utils.config.arguments import AUTO, LIGER_CHOICES, GuardArgs, OptimArgs, TrainConfig, parse_args
from model_utils.config.deepspeed_file import load_deepspeed_json
from model_utils.data.sampler import BlockSampler, DataPosition
from model_utils.errors import CommandParser, ConfigError
from model_utils.launch import startup
from model_utils.observe.log import print0
from model_utils.resolve import train_settings

# torch (and what imports it) is imported where a benchmark runs, never at module level: `dskit bench --help`
# and `dskit gpu-check --help` (this package's submodule) stay instant.
if TYPE_CHECKING:
    import torch

    from model_utils.launch import distributed
    from model_utils.resolve import resolver

GPU_MODEL = "qwen3-0.6b"
CPU_MODEL = "tiny-qwen3"
GPU_SEQ_LENGTH = 2048
DEFAULT_CONFIG = "deepspeed/ds_config.json"
# (timed steps, warm-up steps) by device: enough on a GPU to average out the noise, few on CPU so CI stays fast.
STEPS = {"cuda": (20, 5), "cpu": (3, 1)}
GUARD_WINDOW = GuardArgs().spike_window  # --guard_overhead: the steps before the guard judges, by default


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="dskit bench",
        description="Time the kit's training path (DeepSpeed, Trainer.step) against a plain PyTorch loop "
        "on this device, with random weights and the embedded corpus.",
    )
    p.add_argument("--model", help=f"preset or model dir (default: {GPU_MODEL} on CUDA, {CPU_MODEL} on CPU)")
    p.add_argument(
        "--seq_length", type=int, help=f"tokens per block (default: {GPU_SEQ_LENGTH}, at most the model's)"
    )
    p.add_argument(
        "--micro_batch_size", default="1", help="sequences per micro-batch, or 'auto' (default: 1)"
    )
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per step")
    p.add_argument("--steps", type=int, help="timed optimizer steps (default: 20 on CUDA, 3 on CPU)")
    p.add_argument("--warmup_steps", type=int, help="untimed steps first (default: 5 on CUDA, 1 on CPU)")
    p.add_argument(
        "--deepspeed_config",
        nargs="+",
        default=[DEFAULT_CONFIG],
        help=f"one kit row per DeepSpeed config (default: {DEFAULT_CONFIG})",
    )
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="one more kit row per value: of a dotted DeepSpeed config key set in the first --deepspeed_config "
        "(e.g. zero_optimization.overlap_comm=true,false; values are JSON, else text), or of the training flag "
        f"{', '.join(FLAG_KEYS)} (e.g. micro_batch_size=8,16); repeatable",
    )
    p.add_argument("--liger", choices=LIGER_CHOICES, default=AUTO, help="the kit's --liger (default: auto)")
    p.add_argument("--compile", choices=("true", "false"), default="false", help="the kit's --compile")
    p.add_argument(
        "--reference",
        help="the plain PyTorch reference rows, a comma list of eager and compiled; every ratio is to the first "
        "(default: compiled on CUDA, eager on CPU, where compiling costs more than the few steps it times)",
    )
    p.add_argument(
        "--peak_tflops", type=float, help="the device's dense bf16 peak for MFU (default: known GPUs)"
    )
    p.add_argument("--json", metavar="OUT", help="also write the table as JSON to OUT")
    p.add_argument(
        "--guard_overhead",
        action="store_true",
        help="instead of the rows: the spike guard's cost per step in one kit run of the first config, the guard "
        "switched off and on step by step (so drift and noise hit both alike) once its window is full",
    )
    p.add_argument(
        "--spike_window",
        type=int,
        help="with --guard_overhead: the guard's window (training's --spike_window), the steps trained before it "
        f"judges and the timing starts (default {GUARD_WINDOW})",
    )
    p.add_argument(
        "--packing_overhead",
        action="store_true",
        help="instead of the rows: the step time of --packing documents against stream in one kit run of the first "
        "config, the two batch sources alternating step by step (so drift and noise hit both alike)",
    )
    p.add_argument(
        "--preference_overhead",
        action="store_true",
        help="instead of the rows: the step time of DPO (--objective dpo) against the next-token loss on the same "
        "micro-batches of preference pairs in one kit run of the first config, the two alternating step by step, and "
        "the reference pass's time (synthetic pairs of the embedded corpus' text)",
    )
    data = p.add_argument_group("data benchmark, instead of training (dskit bench --data SOURCE --help)")
    data.add_argument(
        "--data",
        metavar="SOURCE",
        help="time `dskit prepare-data SOURCE` at 1, 2 and N processes and the read path from its shards",
    )
    data.add_argument(
        "--make_corpus", metavar="PATH", help="write a benchmark corpus of Python sources as JSON lines"
    )
    data.add_argument(
        "--verify",
        metavar="DIR",
        help="time the shard verification of opening the prepared dataset DIR (first open, resume)",
    )
    data.add_argument(
        "--make_prepared", metavar="PATH", help="write a prepared dataset of random token ids, for --verify"
    )
    ckpt = p.add_argument_group(
        "checkpoint benchmark, instead of training (dskit bench --checkpoint_mb 100 --help)"
    )
    ckpt.add_argument(
        "--checkpoint_mb",
        metavar="SIZES",
        help="time a checkpoint's save and resume verification at these total MB (e.g. 100,1000), per-rank "
        "checksums against rank 0 checksumming every file",
    )
    sp = p.add_argument_group(
        "sequence-parallel benchmark, instead of training (dskit bench --sequence_parallel 1,2 --help)"
    )
    sp.add_argument(
        SEQUENCE_BENCH_FLAG,
        metavar="SIZES",
        help="peak memory per rank and step time at each --seq_lengths with groups of N ranks sharing each "
        "sequence, for each N (e.g. 1,2), and the longest length within --budget_mib",
    )
    return p


# The flags that make `dskit bench` the data benchmark: it has its own parser and never imports DeepSpeed.
DATA_BENCH_FLAGS = ("--data", "--make_corpus", "--verify", "--make_prepared")
# The flag of the checkpoint benchmark (checkpoint_bench.py): its own parser too.
CHECKPOINT_BENCH_FLAG = "--checkpoint_mb"
# ... and of the sequence-parallel benchmark (sequence_bench.py: memory and speed with ranks sharing sequences).
SEQUENCE_BENCH_FLAG = "--sequence_parallel"


@dataclass
class Row:
    name: str
    kind: str  # "reference" or "dskit"
    micro_batch_size: int
    settings: dict[str, Any] = field(default_factory=dict)
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    first_step_s: float | None = None  # from the start of this row's set-up to the end of its first step
    setup_s: float | None = None
    losses: list[float] = field(default_factory=list)
    error: str | None = None  # e.g. "out of memory": the row could not train at this micro batch
    vs_reference: float | None = None
    layout: str = ""  # micro batch x accumulation x ranks x seq = tokens per optimizer step


@dataclass
class Measured:
    """Timings of one row's steps: the first (after set-up) and the timed ones after the warm-up."""

    first_step_end: float
    timed_s: float
    losses: list[float]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _run_steps(step: Callable[[], float], device: torch.device, warmup: int, steps: int) -> Measured:
    losses = [step()]
    _sync(device)
    first_end = time.perf_counter()
    for _ in range(max(warmup - 1, 0)):
        losses.append(step())
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    _sync(device)
    return Measured(first_end, time.perf_counter() - started, losses)


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory since the last reset; on CPU this process's resident memory now."""
    from model_utils.observe import metrics

    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / metrics.GIB
    return metrics.memory_gib(device)[2]


@dataclass(frozen=True)
class Workload:
    """What every row trains: the same blocks, batch shape and FLOPs accounting."""

    run: resolver.ResolvedRun
    seq_length: int
    accumulation: int
    steps: int
    warmup: int
    flops_per_token: float
    peak_tflops: float | None

    def record(self, row: Row, start: float, setup_s: float, m: Measured, peak_gib: float) -> None:
        from model_utils.observe import metrics

        tokens = row.micro_batch_size * self.accumulation * self.seq_length * self.steps
        # every token is a target in the benchmark's own loop (labels = inputs)
        rate = metrics.throughput(tokens, tokens, m.timed_s, 1, self.flops_per_token, self.peak_tflops)
        row.tokens_per_s, row.mfu, row.peak_mem_gib = rate.tokens_per_s, rate.mfu, peak_gib
        row.first_step_s, row.setup_s, row.losses = m.first_step_end - start, setup_s, m.losses


def _guarded(row: Row, device: torch.device, train: Callable[[Row], None]) -> Row:
    """Run one row; running out of GPU memory marks the row instead of ending the benchmark."""
    import torch

    _reset_memory(device)
    try:
        train(row)
    except torch.OutOfMemoryError:
        row.error = "out of memory"
        print0(f"{row.name}: out of memory at micro batch {row.micro_batch_size}")
    finally:
        torch.compiler.reset()  # drop this row's compiled graphs (and the model they hold)
        _reset_memory(device)
    return row


def _layout(run: resolver.ResolvedRun) -> str:
    layout = run.layout
    assert layout is not None, "bench resolves on its one rank"
    return layout.product()


REFERENCE_MODES = ("eager", "compiled")


def reference_modes(given: str | None, device_type: str) -> list[str]:
    """The reference rows to run, in order (the first is what every ratio is to)."""
    if given is None:
        return ["compiled" if device_type == "cuda" else "eager"]
    modes = given.split(",")
    if not modes or any(m not in REFERENCE_MODES for m in modes) or len(set(modes)) != len(modes):
        raise ConfigError(
            f"--reference {given!r}: use a comma list of {' and '.join(REFERENCE_MODES)}, each once "
            "(e.g. --reference compiled,eager)"
        )
    return modes


def run_reference(work: Workload, run: resolver.ResolvedRun, device: torch.device, compiled: bool) -> Row:
    cfg = run.config
    fused = device.type == "cuda"
    row = Row(
        name=f"reference: PyTorch, AdamW{' fused' if fused else ''}, bf16 autocast, "
        + ("compiled" if compiled else "eager"),
        kind="reference",
        micro_batch_size=int(run.micro_batch_size),
        layout=_layout(run),  # the first kit row's batch: same micro batch, accumulation and blocks
        settings={"compile": compiled, "optimizer": "torch.optim.AdamW" + (" (fused)" if fused else "")},
    )

    def train(row: Row) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        torch.manual_seed(cfg.loop.seed)
        model = AutoModelForCausalLM.from_config(work.run.model_config, attn_implementation="sdpa").to(device)
        model.train()
        if compiled:
            model.compile()
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=run.settings.train.optim.lr,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            fused=fused,
        )
        setup_s = time.perf_counter() - start
        blocks = work.run.train_blocks
        sampler = BlockSampler.of(blocks, row.micro_batch_size, work.accumulation, 0, 1, cfg.loop.seed)
        position = DataPosition()

        def step() -> float:
            nonlocal position
            total = torch.zeros((), device=device)
            for indices in sampler.step_indices(position):
                batch = torch.as_tensor(blocks.rows(indices).tokens, device=device)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(input_ids=batch, labels=batch).loss
                (loss / work.accumulation).backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            position = sampler.advance(position)
            return total.item() / work.accumulation

        measured = _run_steps(step, device, work.warmup, work.steps)
        work.record(row, start, setup_s, measured, _peak_memory_gib(device))

    return _guarded(row, device, train)


@dataclass(frozen=True)
class Variant:
    """What one kit row trains: a config file as given, or the first one with one DeepSpeed key or one
    training flag changed (--vary)."""

    path: str  # what trains
    source: str  # the config file it came from
    label: str
    changed: dict[str, Any] = field(default_factory=dict)
    flags: tuple[str, ...] = ()  # training flags after the bench's own (the last occurrence wins)


# --vary keys that are the kit's training flags rather than DeepSpeed config keys.
FLAG_KEYS = ("liger", "compile", "micro_batch_size", "spike_guard", "backend", "packing")


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # e.g. cpu, nvme


def _default_config(backend: str) -> str:
    """The DeepSpeed-format config --backend `backend` trains with when none is given."""
    return train_settings.given(TrainConfig(optim=OptimArgs(backend=backend)))[0]


def vary_variants(base: str, specs: list[str], out_dir: Path) -> list[Variant]:
    """A row per value of each `KEY=V1,V2` spec: `base` with that one DeepSpeed key set (a config written to
    `out_dir`), or with that one training flag (FLAG_KEYS) given; the flag's parser checks the value."""
    variants = []
    for spec in specs:
        key, _, values = spec.partition("=")
        path = key.split(".")
        if not key or not values or not all(path):
            raise ConfigError(
                f"--vary {spec!r}: use KEY=V1,V2 with a dotted DeepSpeed config key or one of "
                f"{', '.join(FLAG_KEYS)}, e.g. --vary zero_optimization.overlap_comm=true,false"
            )
        for raw in values.split(","):
            if key in FLAG_KEYS:
                # backend=X of the kit's default ZeRO config: X's own default (fsdp refuses the ZeRO section), as
                # training picks it without --deepspeed_config.
                path = _default_config(raw) if key == "backend" and base == DEFAULT_CONFIG else base
                variants.append(
                    Variant(path, path, f"{Path(path).name} {key}={raw}", {key: raw}, (f"--{key}", raw))
                )
                continue
            ds = load_deepspeed_json(base)
            section = ds
            for part in path[:-1]:
                section = section.setdefault(part, {})
                if not isinstance(section, dict):
                    raise ConfigError(f"--vary {spec!r}: {part!r} in {base} is not a section (a JSON object)")
            value = section[path[-1]] = _json_or_text(raw)
            out = out_dir / f"vary-{len(variants)}-{Path(base).name}"
            out.write_text(json.dumps(ds, indent=2) + "\n")
            variants.append(Variant(str(out), base, f"{Path(base).name} {key}={raw}", {key: value}))
    return variants


def run_kit(work: Workload, run: resolver.ResolvedRun, dist: distributed.DistInfo, variant: Variant) -> Row:
    cfg = run.config
    row = Row(
        name=f"dskit: {variant.label}, liger {cfg.model.liger}, compile {str(cfg.model.compile).lower()}",
        kind="dskit",
        micro_batch_size=int(run.micro_batch_size),
        layout=_layout(run),
        settings={
            "deepspeed_config": variant.source,
            "changed": variant.changed,
            "liger": cfg.model.liger,
            "compile": cfg.model.compile,
        },
    )

    def train(row: Row) -> None:
        from model_utils.loop.trainer import Trainer

        start = time.perf_counter()
        trainer = Trainer(run, dist)
        setup_s = time.perf_counter() - start
        row.settings["zero_optimization"] = run.deepspeed_config().get(
            "zero_optimization"
        )  # what DeepSpeed got
        try:
            trainer.start()
            measured = _run_steps(lambda: trainer.step().loss, dist.device, work.warmup, work.steps)
            work.record(row, start, setup_s, measured, _peak_memory_gib(dist.device))
        finally:
            trainer.close()  # releases the engine's hooks and buffers before the next row

    return _guarded(row, dist.device, train)


@contextmanager
def single_process_group() -> Iterator[distributed.DistInfo]:
    """A one-rank process group, as torchrun would set one up; reuses one that already exists."""
    import torch

    from model_utils.launch import distributed

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError("dskit bench runs as one process: start it directly, not under torchrun")
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    added = [name for name in (*defaults, "MASTER_PORT") if name not in os.environ]
    for name in added:
        os.environ[name] = defaults.get(name) or str(distributed.free_port())
    created = not torch.distributed.is_initialized()
    try:
        yield distributed.init_distributed()
    finally:
        if created and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for name in added:
            os.environ.pop(name, None)


def guard_overhead(work: Workload, run: resolver.ResolvedRun, dist: distributed.DistInfo) -> str:
    """Median step time with the spike guard off and on, alternating step by step in one run."""
    from model_utils.loop.observers.guard import Guard
    from model_utils.loop.trainer import Trainer

    trainer = Trainer(run, dist)
    try:
        trainer.start()
        for _ in range(run.config.guard.spike_window + work.warmup):
            trainer.step()  # fills the guard's windows: from here on it judges every step
        hooks, judged = trainer.hooks, trainer.hooks.observers
        unjudged = [o for o in judged if not isinstance(o, Guard)]
        assert len(unjudged) < len(judged), "the spike guard is on in this run"
        modes = {"off": partial(hooks.attach, unjudged), "skip": partial(hooks.attach, judged)}
        medians = _interleaved_step_times(trainer, dist.device, work.steps, modes)
    finally:
        trainer.close()
    off, on = medians["off"], medians["skip"]
    return (
        f"spike guard: {1e3 * on:.3f} ms/step judging, {1e3 * off:.3f} ms/step off (medians of {work.steps} "
        f"interleaved steps each): {100 * (on / off - 1):+.2f}%"
    )


def _interleaved_step_times(
    trainer: Any, device: Any, steps: int, settings: dict[str, Callable[[], None]]
) -> dict[str, float]:
    """The median time of `steps` optimizer steps under each setting, the settings alternating step by step in one
    run (each applied before its step), so the machine's drift and noise fall on all of them alike."""
    names = list(settings)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(len(names) * steps):
        name = names[i % len(names)]
        settings[name]()
        _sync(device)
        started = time.perf_counter()
        trainer.step()
        _sync(device)
        times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def packing_overhead(
    work: Workload, stream: resolver.ResolvedRun, documents: resolver.ResolvedRun, dist: distributed.DistInfo
) -> str:
    """Median step time of the documents run's blocks and of the same blocks as the plain stream, alternating step
    by step in one run (the documents run's model: its attention is the one documents train with)."""
    from model_utils.data.step_batches import StepBatches
    from model_utils.loop.trainer import Trainer

    trainer = Trainer(documents, dist)
    assert trainer.batches is not None
    sources = {
        "documents": trainer.batches,
        "stream": StepBatches(stream.train_blocks, trainer.sampler, dist.device, trainer.flatten),
    }
    try:
        trainer.start()
        for _ in range(work.warmup):
            trainer.step()
        packings = {
            mode: partial(setattr, trainer, "batches", sources[mode]) for mode in ("stream", "documents")
        }
        medians = _interleaved_step_times(trainer, dist.device, work.steps, packings)
    finally:
        trainer.batches = sources["documents"]
        sources["stream"].close()
        trainer.close()
    plain, apart = medians["stream"], medians["documents"]
    return (
        f"packing: {1e3 * apart:.3f} ms/step documents, {1e3 * plain:.3f} ms/step stream (medians of {work.steps} "
        f"interleaved steps each): {100 * (apart / plain - 1):+.2f}%"
    )


def synthetic_pairs(out: Path, count: int, seq_length: int) -> Path:
    """`count` preference pairs in TRL's standard form from the embedded corpus' text (a prompt, a chosen answer
    that continues it, a rejected one of the same words in reverse), as JSON lines: timing data, nothing to learn.
    Each part at most an eighth of `seq_length` in words (a few tokens a word): no prompt fills a block."""
    from model_utils.assets import CORPUS_PATH

    texts = [json.loads(line)["text"] for line in CORPUS_PATH.read_text().splitlines() if line.strip()]
    with out.open("w") as f:
        for i in range(count):
            words = texts[i % len(texts)].split()
            part = max(1, min(len(words) // 3, seq_length // 8))
            prompt, answer = " ".join(words[:part]), words[part : 2 * part] or ["yes"]
            rejected = list(reversed(answer)) if len(set(answer)) > 1 else [*answer, "no"]
            pair = {"prompt": prompt, "chosen": " " + " ".join(answer), "rejected": " " + " ".join(rejected)}
            f.write(json.dumps(pair) + "\n")
    return out


def preference_overhead(work: Workload, run: resolver.ResolvedRun, dist: distributed.DistInfo) -> str:
    """Median step time of DPO and of the next-token loss on the same batches of pairs, alternating step by step in
    one run (the engine's objective swapped), and the reference pass before the first step against a step."""
    from model_utils.engines.step_loss import TokenMean
    from model_utils.loop.trainer import Trainer

    trainer = Trainer(run, dist)
    try:
        started = time.perf_counter()
        trainer.start()  # the reference pass: every pair's log-probabilities, once
        reference_s = time.perf_counter() - started
        dpo, lm = trainer.engine.objective, TokenMean()
        for _ in range(work.warmup):
            trainer.step()
        objectives = {
            "lm": partial(setattr, trainer.engine, "objective", lm),
            "dpo": partial(setattr, trainer.engine, "objective", dpo),
        }
        medians = _interleaved_step_times(trainer, dist.device, work.steps, objectives)
    finally:
        trainer.close()
    pairs = len(run.train_blocks)
    per_step = run.global_batch
    return (
        f"preference: {1e3 * medians['dpo']:.3f} ms/step DPO, {1e3 * medians['lm']:.3f} ms/step the next-token loss on "
        f"the same {per_step} pairs a step (2 x {run.seq_length} tokens each; medians of {work.steps} interleaved steps "
        f"each): {100 * (medians['dpo'] / medians['lm'] - 1):+.2f}%; the reference pass {reference_s:.2f} s for "
        f"{pairs} pairs ({reference_s / medians['dpo']:.1f} DPO steps' time, {pairs / per_step:.1f} steps of data)"
    )


def _training_flags(ns: argparse.Namespace, model: str, config: str, checkpoint_dir: str) -> list[str]:
    steps = ns.steps + ns.warmup_steps
    window = ns.spike_window or GUARD_WINDOW
    if ns.guard_overhead:  # the window fills, then off and on alternate
        steps = window + ns.warmup_steps + 2 * ns.steps
    if ns.packing_overhead or ns.preference_overhead:  # the two alternate
        steps = ns.warmup_steps + 2 * ns.steps
    flags = [
        "--model", model, "--deepspeed_config", config,
        "--micro_batch_size", ns.micro_batch_size,
        "--gradient_accumulation_steps", str(ns.gradient_accumulation_steps),
        # One step more than the bench runs: the run's last step would save a checkpoint (8.3 GB of qwen3-0.6b, 15 s
        # a row on an H200) that nothing reads.
        "--max_steps", str(steps + 1), "--warmup_steps", "1",
        "--validation_fraction", "0", "--checkpoint_dir", checkpoint_dir, "--metrics_file", "none",
        "--liger", ns.liger, "--compile", ns.compile,
        # Any model trains on the embedded corpus with its small tokenizer: no hub access, same data everywhere.
        "--tokenizer", str(TOKENIZER_DIR),
    ]  # fmt: skip
    if ns.seq_length is not None:
        flags += ["--seq_length", str(ns.seq_length)]
    if ns.peak_tflops is not None:
        flags += ["--peak_tflops", str(ns.peak_tflops)]
    if ns.guard_overhead:  # judging from the window's filling, not after the guard's longer warm-up
        flags += ["--spike_warmup_steps", "0", "--spike_window", str(window)]
    return flags


def format_table(rows: list[Row]) -> str:
    header = (
        "variant",
        "mb x accum x ranks x seq = tokens/step",
        "tokens/s",
        "MFU",
        "peak mem GiB",
        "launch->1st step s",
        "vs reference",
    )
    lines = [header]
    for r in rows:
        if r.tokens_per_s is None or r.peak_mem_gib is None or r.first_step_s is None:
            lines.append((r.name, r.layout or str(r.micro_batch_size), r.error or "failed", "", "", "", "-"))
            continue
        lines.append(
            (
                r.name,
                r.layout or str(r.micro_batch_size),
                f"{r.tokens_per_s:,.0f}",
                "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%",
                f"{r.peak_mem_gib:.2f}",
                f"{r.first_step_s:.1f}",
                "-" if r.vs_reference is None else f"{r.vs_reference:.2f}x",
            )
        )
    return columns.align(lines)


def main(argv: list[str]) -> int:
    if any(arg.split("=", 1)[0] in DATA_BENCH_FLAGS for arg in argv):
        from dskit.bench import data_bench

        return data_bench.main(argv)
    if any(arg.split("=", 1)[0] == CHECKPOINT_BENCH_FLAG for arg in argv):
        from dskit.bench import checkpoint_bench

        return checkpoint_bench.main(argv)
    if any(arg.split("=", 1)[0] == SEQUENCE_BENCH_FLAG for arg in argv):
        from dskit.bench import sequence_bench

        return sequence_bench.main(argv)
    ns = build_parser().parse_args(argv)
    startup.import_deepspeed()
    import torch
    from deepspeed.accelerator import get_accelerator

    from model_utils.model import kernels, models
    from model_utils.observe import metrics
    from model_utils.resolve import resolver

    device_type = "cuda" if get_accelerator().device_name() == "cuda" else "cpu"  # what the kit trains on
    default_steps, default_warmup = STEPS[device_type]
    ns.steps = default_steps if ns.steps is None else ns.steps
    ns.warmup_steps = default_warmup if ns.warmup_steps is None else ns.warmup_steps
    references = reference_modes(ns.reference, device_type)
    if ns.spike_window is not None and not ns.guard_overhead:
        raise ConfigError("--spike_window sets the guard's window for --guard_overhead: add that, or drop it")
    if ns.steps < 1 or ns.warmup_steps < 1:
        raise ConfigError(
            "--steps and --warmup_steps must be at least 1 (the first step compiles and warms up)"
        )
    model = ns.model or (GPU_MODEL if device_type == "cuda" else CPU_MODEL)
    if ns.seq_length is None and device_type == "cuda":
        ns.seq_length = GPU_SEQ_LENGTH
    with tempfile.TemporaryDirectory(prefix="dskit-bench-") as scratch:
        checkpoint_dir = str(Path(scratch) / "checkpoints")
        variants = [Variant(c, c, Path(c).name) for c in ns.deepspeed_config]
        variants += vary_variants(ns.deepspeed_config[0], ns.vary, Path(scratch))
        configs = [
            parse_args(_training_flags(ns, model, v.path, checkpoint_dir) + list(v.flags)) for v in variants
        ]
        # Every variant checked by DeepSpeed before any row trains: a value it rejects is one error line.
        settings = [resolver.resolve_settings(cfg) for cfg in configs]
        # Fail fast on an impossible --liger, before any process group, data or model work.
        kernels.plan(configs[0].model, settings[0].model_config.model_type, torch.device(device_type))
        with single_process_group() as dist:
            # Resolves the sequence length and an auto micro batch.
            runs = [resolver.prepare(s.config, world_size=dist.world_size, settings=s) for s in settings]
            first = runs[0]
            device_name = metrics.device_name(dist.device)
            work = Workload(
                run=runs[0],
                seq_length=first.seq_length,
                accumulation=ns.gradient_accumulation_steps,
                steps=ns.steps,
                warmup=ns.warmup_steps,
                flops_per_token=models.flops_per_token(first.model_config, first.seq_length),
                peak_tflops=metrics.peak_tflops(device_name, ns.peak_tflops),
            )
            print0(
                f"bench on {device_name}: {model}, seq {work.seq_length}, accumulation "
                f"{work.accumulation}, {work.warmup} warm-up + {work.steps} timed steps per row"
            )
            if ns.guard_overhead:
                print(guard_overhead(work, first, dist), flush=True)
                return 0
            if ns.packing_overhead:
                flags = _training_flags(ns, model, variants[0].path, checkpoint_dir) + list(variants[0].flags)
                apart = parse_args([*flags, "--packing", "documents"])
                documents = resolver.prepare(apart, world_size=dist.world_size)
                print(packing_overhead(work, first, documents, dist), flush=True)
                return 0
            if ns.preference_overhead:
                flags = _training_flags(ns, model, variants[0].path, checkpoint_dir) + list(variants[0].flags)
                count = (
                    int(first.micro_batch_size)
                    * ns.gradient_accumulation_steps
                    * (ns.warmup_steps + 2 * ns.steps)
                )
                pairs = synthetic_pairs(Path(scratch) / "pairs.jsonl", count, first.seq_length)
                data = ["--dataset", str(pairs), "--data_cache_dir", str(Path(scratch) / "data")]
                dpo = parse_args([*flags, *data, "--objective", "dpo", "--spike_guard", "off"])
                print(
                    preference_overhead(work, resolver.prepare(dpo, world_size=dist.world_size), dist),
                    flush=True,
                )
                return 0
            planned: list[Callable[[], Row]] = [
                partial(run_reference, work, first, dist.device, mode == "compiled") for mode in references
            ]
            planned += [
                partial(run_kit, work, run, dist, variant)
                for run, variant in zip(runs, variants, strict=True)
            ]
            rows: list[Row] = []
            for row_run in planned:
                rows.append(row_run())
                if rows[0].tokens_per_s is not None and rows[-1].tokens_per_s is not None:
                    rows[-1].vs_reference = rows[-1].tokens_per_s / rows[0].tokens_per_s
                print0(f"bench row {len(rows)} of {len(planned)}: {row_line(rows[-1])}")
                if ns.json:  # after every row: a bench stopped at a time limit keeps the rows it finished
                    done = len(rows) == len(planned)
                    _write_json(Path(ns.json), work, model, device_name, rows, complete=done)
    print(format_table(rows), flush=True)
    if work.peak_tflops is None:
        print("MFU: n/a (unknown peak for this device; pass --peak_tflops)")
    if dist.device.type != "cuda":
        print("peak mem on CPU: the process's resident memory after the row (host RSS)")
    return 0


def row_line(row: Row) -> str:
    if row.error or row.tokens_per_s is None:
        return f"{row.name}: {row.error or 'no throughput measured'}"
    mfu = "" if row.mfu is None else f", MFU {100 * row.mfu:.1f}%"
    return f"{row.name}: {row.tokens_per_s:,.0f} tokens/s{mfu}, peak {row.peak_mem_gib:.2f} GiB"


def _write_json(out: Path, work: Workload, model: str, device: str, rows: list[Row], complete: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "device": device,
        "model": model,
        "seq_length": work.seq_length,
        "gradient_accumulation_steps": work.accumulation,
        "steps": work.steps,
        "warmup_steps": work.warmup,
        "flops_per_token": work.flops_per_token,
        "peak_tflops": work.peak_tflops,
        "complete": complete,  # false: the bench stopped before its last row
        "rows": [asdict(r) for r in rows],
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(out)  # a reader never sees half a file
