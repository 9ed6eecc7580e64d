"""`dskit bench --sequence_parallel SIZES`: peak memory per rank and speed of one training step at each sequence
length, with groups of N ranks sharing each sequence (DeepSpeed's Ulysses, engines/sequence_parallel.py) for each
N given, and the longest length that fits a memory budget.

Each N runs as one group of N real ranks on this machine (a gloo process group on loopback on CPU, one GPU each on
CUDA): the kit's DeepSpeed engine (ZeRO-2, fp32 on CPU, bf16 on GPUs) trains the model on rows of random tokens
cut into the ranks' shards (step_batches.Batch.shard), each length from the shortest: a warm-up step, then a timed
one. Peak memory is what the step adds to what the rank held before it: on CUDA the allocator's peak; on CPU the
process's resident peak (Linux's VmHWM, reset before each length), so it includes the allocator's own slack.
A rank out of GPU memory ends its group's lengths with an "out of memory" row (seen on an H200: qwen3-0.6b at
32,768 tokens on one GPU without activation checkpointing), not a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from dskit import columns
from model_utils.errors import CommandParser, ConfigError

MiB = 2**20
MAX_DOUBLINGS = 8  # how far past the given lengths the budget search goes


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="dskit bench --sequence_parallel",
        description="Peak memory per rank and step time at each sequence length, with N ranks sharing each "
        "sequence, for each N.",
    )
    p.add_argument(
        "--sequence_parallel", required=True, help="ranks per sequence, comma-separated (e.g. 1,2)"
    )
    p.add_argument("--seq_lengths", default="1024,2048,4096", help="tokens per sequence, comma-separated")
    p.add_argument(
        "--budget_mib",
        type=float,
        help="a memory budget per rank: lengths keep doubling past the given ones while the step fits it, and the "
        "longest that fits is reported for each N",
    )
    p.add_argument("--model", default="tiny-qwen3", help="a preset (default: tiny-qwen3)")
    p.add_argument(
        "--activation_checkpointing", default="none", help="the kit's flag, for every row (default: none)"
    )
    p.add_argument("--tiled_mlp", action="store_true", help="the kit's --tiled_mlp, for every row")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    return p


def _sizes(text: str, flag: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--{flag} {text!r}: give whole numbers, comma-separated (e.g. 1,2)")
    return sizes


def _resident() -> tuple[int, int]:
    """This process's resident memory now and at its peak since the last reset (bytes)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _step_memory(device: Any, step: Any) -> tuple[float, int]:
    """The step's seconds and the memory it added at its peak."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from now
        before = _resident()[0]
    started = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _resident()[1]
    return seconds, peak - before


def _rank_main(
    rank: int,
    world: int,
    port: int,
    model: str,
    lengths: list[int],
    budget: float | None,
    out: str,
    checkpointing: str,
    tiled: bool,
) -> None:
    import torch

    from model_utils import engines
    from model_utils.config.presets import PRESETS
    from model_utils.data.step_batches import Batch
    from model_utils.launch import distributed
    from model_utils.model import activation_checkpointing, tiled_mlp

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist = distributed.init_distributed(sequence_parallel=world)
    cuda = dist.device.type == "cuda"
    from transformers import AutoModelForCausalLM

    config = PRESETS[model].build_config()
    config.max_position_embeddings = max(lengths) * 2**MAX_DOUBLINGS
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    activation_checkpointing.apply(built, checkpointing, announce=False)
    if tiled:
        tiled_mlp.apply(built)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": cuda},
    }
    engine = engines.engine_class("deepspeed")(built, ds, sequence_parallel=world)  # type: ignore[call-arg]
    engine.train()
    rows: list[dict[str, Any]] = []
    queue, doublings = list(lengths), 0
    while queue:
        length = queue.pop(0)
        # The length being tried: a rank that runs out of memory ends the spawn, and run() reads this.
        if rank == 0:
            Path(out).write_text(json.dumps({"rows": rows, "trying": length}))
        tokens = torch.randint(
            0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length)
        )
        batch = Batch(tokens, tokens.clone(), None, length - 1).shard(*dist.shard).to(dist.device)
        engine.train_step([batch])  # warm-up: allocations, the optimizer's state
        seconds, added = _step_memory(dist.device, lambda b=batch: engine.train_step([b]))
        worst = torch.tensor([float(added), seconds], dtype=torch.float64, device=dist.device)
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
        peak_mib, seconds = float(worst[0]) / MiB, float(worst[1])
        rows.append(
            {"sequence_parallel": world, "seq_length": length, "peak_mib": peak_mib, "seconds": seconds}
        )
        if budget is not None and not queue and peak_mib <= budget and doublings < MAX_DOUBLINGS:
            queue.append(length * 2)  # the budget search: on until a length does not fit
            doublings += 1
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "trying": None}))
    engine.close()
    torch.distributed.destroy_process_group()


def run(
    model: str, sizes: list[int], lengths: list[int], budget: float | None, checkpointing: str, tiled: bool
) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from model_utils.launch.distributed import free_port

    rows: list[dict[str, Any]] = []
    # glibc's malloc raises its mmap threshold to the size of each large block freed, and keeps later blocks of
    # that size in its heap after they are freed: a fixed threshold hands every large tensor back to the system
    # when freed, so the ranks' resident peak follows what they hold (read at their start).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    with tempfile.TemporaryDirectory(prefix="dskit-bench-sp-") as scratch:
        for n in sizes:
            out = str(Path(scratch) / f"{n}.json")
            args = (n, free_port(), model, lengths, budget, out, checkpointing, tiled)
            try:
                mp.spawn(_rank_main, args=args, nprocs=n)
            except mp.ProcessRaisedException as e:
                finished = rows_after_failure(n, Path(out), str(e))
                if finished is None:
                    raise
                rows += finished
                continue
            rows += json.loads(Path(out).read_text())["rows"]
    return rows


def rows_after_failure(n: int, out: Path, error: str) -> list[dict[str, Any]] | None:
    """The rows a group of n finished before a rank failed, and the length it was trying when that rank ran out of
    GPU memory: on a GPU the natural end of a search for the longest length, not a crash. None for any other
    failure, which is one."""
    if "OutOfMemoryError" not in error or not out.exists():
        return None
    state = json.loads(out.read_text())
    tried = {"sequence_parallel": n, "seq_length": state["trying"], "peak_mib": None, "seconds": None}
    return [*state["rows"], {**tried, "error": "out of memory"}]


def table(rows: list[dict[str, Any]], budget: float | None) -> str:
    lines = [("ranks per sequence", "seq length", "peak per rank", "vs 1 rank", "step", "tokens/s")]
    alone = {
        r["seq_length"]: r["peak_mib"] for r in rows if r["sequence_parallel"] == 1 and not r.get("error")
    }
    for r in rows:
        if r.get("error"):  # the rest of that group's lengths were not tried
            lines.append((str(r["sequence_parallel"]), f"{r['seq_length']:,}", r["error"], "", "", ""))
            continue
        ratio = alone.get(r["seq_length"])
        lines.append(
            (
                str(r["sequence_parallel"]),
                f"{r['seq_length']:,}",
                f"{r['peak_mib']:,.0f} MiB",
                f"{r['peak_mib'] / ratio:.2f}x" if ratio else "",
                f"{r['seconds']:.2f} s",
                f"{r['seq_length'] / r['seconds']:,.0f}",
            )
        )
    text = columns.align(lines)
    if budget is not None:
        for n in sorted({r["sequence_parallel"] for r in rows}):
            fits = [
                r["seq_length"]
                for r in rows
                if r["sequence_parallel"] == n and not r.get("error") and r["peak_mib"] <= budget
            ]
            longest = f"{max(fits):,} tokens" if fits else "none of the lengths"
            text += f"\nlongest within {budget:,.0f} MiB per rank with {n} rank(s) per sequence: {longest}"
    return (
        text
        + "\n(peak: what one training step adds to what the rank held before it, the largest over the ranks)"
    )


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    sizes = _sizes(ns.sequence_parallel, "sequence_parallel")
    lengths = _sizes(ns.seq_lengths, "seq_lengths")
    from model_utils.config.presets import PRESETS
    from model_utils.engines.sequence_parallel import cannot_split

    if ns.model not in PRESETS:
        raise ConfigError(
            f"--model {ns.model!r}: the sequence benchmark takes a preset: {', '.join(PRESETS)}"
        )
    config = PRESETS[ns.model].build_config()
    for n in sizes:
        for length in lengths:
            why = cannot_split(n, config, length, None, f"--sequence_parallel {n}")
            if why is not None:
                raise ConfigError(why.replace("--seq_length", "--seq_lengths"))
    from model_utils.config.arguments import every_n_layers

    every_n_layers(ns.activation_checkpointing)  # a malformed value is one line, before any rank starts
    rows = run(ns.model, sizes, lengths, ns.budget_mib, ns.activation_checkpointing, ns.tiled_mlp)
    print(table(rows, ns.budget_mib))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))
    return 0
