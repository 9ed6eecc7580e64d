"""`dskit bench --checkpoint_mb SIZES`: a checkpoint's save and resume verification, timed against its size, with
the checksums computed the way the kit computes them now and the way it did before.

Real ranks (a gloo process group on loopback, `--ranks` processes on this machine) save through the real protocol
(checkpoint/protocol.py) a tag whose files are what a DeepSpeed ZeRO tag holds: one optimizer shard per rank (of
SIZE / ranks MB of random bytes) and rank 0's model states, with the protocol's own small files.

- per-rank (now): each rank checksums its own files right after writing them; rank 0 writes the manifest from
  the gathered checksums (protocol.save). Resume: the ranks verify their shares in parallel
  (protocol.verify_in_parallel), then rank 0 picks the tag (protocol.select_resume) without reading a file again.
- rank 0 (before): protocol.save with no rank checksumming its own files, so rank 0 alone reads and checksums
  every file after the barrier (file_manifest.build without the ranks' checksums: what protocol.save did), and
  resume verifies every file on rank 0 (select_resume alone).

Save is the wall time from the first write to the manifest written; verify from the start of the resume checks to
the tag chosen. Each also shows the CPU seconds of the busiest rank: on a machine with fewer cores than ranks (or
shared) the ranks take turns, so the wall time cannot show the parallel work; the busiest rank's CPU time is what
the wall time becomes where each rank has a core (or a node) of its own. The files were just written, so reads come from the page cache: this measures the
checksum passes (CPU), not the storage. The median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dskit import columns
from model_utils.errors import CommandParser, ConfigError

MB = 2**20


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="dskit bench --checkpoint_mb",
        description="Benchmark a checkpoint's save and resume verification with per-rank checksums against "
        "rank 0 checksumming every file (the kit before), at each size.",
    )
    p.add_argument(
        "--checkpoint_mb",
        required=True,
        help="total MB of the ranks' shard files, comma-separated sizes (e.g. 100,1000)",
    )
    p.add_argument("--ranks", type=int, default=2, help="processes saving the tag (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="runs per size and method; the median is shown")
    p.add_argument("--work_dir", help="where the tags are written (default: a temp dir); removed afterwards")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT")
    return p


class BenchEngine:
    """Writes what a ZeRO-1/2 tag of a DeepSpeed run holds, at a chosen size: one optimizer shard per rank and
    rank 0's model states (a tenth of a shard), the client state beside it."""

    LAYOUT = "deepspeed"  # the files below are that engine's: it answers who wrote each (writer_rank)
    MODEL_STATES = "mp_rank_00_model_states.pt"

    def __init__(self, rank: int, shard_bytes: int) -> None:
        from model_utils import engines

        self.rank, self.engine_type = rank, engines.checkpoint_format(self.LAYOUT)
        self.payload = os.urandom(shard_bytes)  # generated before the clock starts

    def save(self, tag_dir: Path, client_state: dict[str, Any]) -> None:
        import torch

        tag_dir.mkdir(parents=True, exist_ok=True)
        with (tag_dir / f"bf16_zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt").open("wb") as f:
            f.write(self.payload)
        if self.rank == 0:
            torch.save({"client_state": client_state, "module": self.payload[: len(self.payload) // 10]},
                       tag_dir / self.MODEL_STATES)  # fmt: skip

    def after_failed_save(self) -> None:
        pass

    def writer_rank(self, rel: str) -> int | None:
        return self.engine_type.writer_rank(rel)


class _SavedAsJson:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")


def _request(root: Path, step: int) -> Any:
    from model_utils.checkpoint import protocol

    return protocol.SaveRequest(
        str(root), protocol.checkpoint_tag("bench", step), step, {"step": step}, {}, {}
    )


@contextlib.contextmanager
def _rank0_checksums() -> Iterator[None]:
    """protocol.save as it was: no rank checksums its own files, so rank 0's manifest reads and checksums every
    file after the barrier (file_manifest.build hashes whatever the ranks did not)."""
    from model_utils.checkpoint import protocol

    own = protocol._digest_own_files
    protocol._digest_own_files = lambda *args: {}
    try:
        yield
    finally:
        protocol._digest_own_files = own


METHODS = ("before", "now")


def _phases(method: str, engine: BenchEngine, root: Path, rank: int) -> tuple[Any, Any]:
    """The save and the resume check of `method`, as functions every rank calls."""
    from model_utils.checkpoint import protocol

    def resume_pick() -> None:
        if rank == 0:
            assert protocol.select_resume(str(root), None) is not None

    def save() -> None:
        protocol.save(engine, _request(root, 1), rank, _SavedAsJson(), _SavedAsJson())  # type: ignore[arg-type]

    if method == "before":

        def save_before() -> None:
            with _rank0_checksums():
                save()

        return save_before, resume_pick

    def check_in_parallel() -> None:
        protocol.verify_in_parallel(str(root))
        resume_pick()

    return save, check_in_parallel


def _timed(fn: Any) -> tuple[float, float]:
    """The wall time of fn on every rank (barrier to barrier), and the most CPU time one rank spent in it: what
    the wall time is where each rank has a core of its own (on a shared machine, ranks wait for each other's)."""
    import torch

    torch.distributed.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    fn()
    cpu = torch.tensor([time.process_time() - cpu_started], dtype=torch.float64)
    torch.distributed.all_reduce(cpu, op=torch.distributed.ReduceOp.MAX)
    return time.perf_counter() - started, cpu.item()


def _rank_main(rank: int, world: int, port: int, sizes: list[int], repeats: int, work: str, out: str) -> None:
    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # print0 prints on rank 0 only
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    rows = []
    for size in sizes:
        engine = BenchEngine(rank, size * MB // world)
        times: dict[str, list[float]] = {
            f"{what}_{m}{cpu}": [] for what in ("save", "verify") for m in METHODS for cpu in ("", "_cpu")
        }
        tag_bytes = 0
        for repeat in range(repeats):
            for method in METHODS:
                root = Path(work) / f"{size}mb-{method}-{repeat}"
                saving, checking = _phases(method, engine, root, rank)
                with contextlib.redirect_stdout(io.StringIO()):  # the protocol's "Saved ..." lines
                    for what, fn in (("save", saving), ("verify", checking)):
                        wall, cpu = _timed(fn)
                        times[f"{what}_{method}"].append(wall)
                        times[f"{what}_{method}_cpu"].append(cpu)
                if rank == 0:
                    tag_bytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
                    shutil.rmtree(root)
                torch.distributed.barrier()
        rows.append(
            {"mb": size, "tag_mb": tag_bytes / MB, **{k: statistics.median(v) for k, v in times.items()}}
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


def run(sizes: list[int], ranks: int, repeats: int, work_dir: str | None) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from model_utils.launch.distributed import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dskit-bench-ckpt-", dir=work_dir) as scratch:
        out = str(Path(scratch) / "rows.json")
        mp.spawn(_rank_main, args=(ranks, port, sizes, repeats, scratch, out), nprocs=ranks)
        return json.loads(Path(out).read_text())


def table(rows: list[dict[str, Any]], ranks: int) -> str:
    lines = [
        (
            "tag",
            "save before",
            "save now",
            "verify before",
            "verify now",
            "busiest rank's CPU: save",
            "verify",
        )
    ]
    for r in rows:
        lines.append(
            (
                f"{r['tag_mb']:,.0f} MB",
                f"{r['save_before']:.2f} s",
                f"{r['save_now']:.2f} s",
                f"{r['verify_before']:.2f} s",
                f"{r['verify_now']:.2f} s",
                f"{r['save_before_cpu']:.2f} -> {r['save_now_cpu']:.2f} s",
                f"{r['verify_before_cpu']:.2f} -> {r['verify_now_cpu']:.2f} s",
            )
        )
    return columns.align(lines) + (
        f"\n({ranks} ranks; wall times; before: rank 0 checksums every file, now: each rank its own; the busiest "
        "rank's CPU seconds are the wall time where each rank has a core of its own; medians of the runs)"
    )


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    try:
        sizes = [int(s) for s in ns.checkpoint_mb.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or ns.ranks < 1 or ns.repeats < 1:
        raise ConfigError(
            f"--checkpoint_mb {ns.checkpoint_mb} --ranks {ns.ranks} --repeats {ns.repeats}: give sizes in whole MB "
            "(e.g. --checkpoint_mb 100,1000) and at least 1 rank and 1 repeat"
        )
    if ns.work_dir:
        Path(ns.work_dir).mkdir(parents=True, exist_ok=True)
    rows = run(sizes, ns.ranks, ns.repeats, ns.work_dir)
    print(table(rows, ns.ranks), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"ranks": ns.ranks, "rows": rows}, indent=1))
    return 0
