"""`dskit plot`: one PNG of a run's loss, learning rate, throughput and memory over optimizer steps.

Reads the run's metrics JSONL, or a run log (`logs/X.out`): then its sibling `logs/X.metrics.jsonl`, or, when a
run wrote none, the log's own "Step N/M | ..." lines. A resumed or requeued run appends to the same files; a
resume restarts the story at its step, so what the interrupted job logged after that checkpoint is dropped and
the resumed job's records win. Resumes are drawn as vertical lines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dskit.plot.png import save_png
from model_utils.errors import CommandParser, ConfigError, first_line
from model_utils.observe import step_line

# Record keys that are plotted, in the metrics JSONL's names.
PLOTTED = (
    "loss",
    "val_loss",
    "lr",
    "tokens_per_s",
    "device_mem_alloc_gib",
    "device_mem_peak_gib",
    "host_rss_gib",
)
METRICS_SUFFIX = ".metrics.jsonl"
USAGE_HINT = "pass a run log (logs/NAME.out) or its metrics file (logs/NAME.metrics.jsonl)"


@dataclass(frozen=True)
class Series:
    steps: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class RunSeries:
    """What one plot shows: a series per PLOTTED key (possibly empty) and the steps runs resumed at."""

    source: Path  # the file the data came from (the metrics file when a log had one)
    run_id: str | None
    series: dict[str, Series]
    resumes: tuple[int, ...]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL; an unreadable line is an error naming it, except a last line still
    being written (no newline yet), which is skipped."""
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                print(
                    f"note: {path} line {number} is incomplete (still being written?): skipped",
                    file=sys.stderr,
                )
                continue
            raise ConfigError(
                f"{path} line {number} is not valid JSON ({err.msg}): fix or delete that line"
            ) from err
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(
                f'{path} line {number} is not a metrics record (a JSON object with an integer "step"): '
                "fix or delete that line"
            )
        records.append(record)
    return records


def parse_log(path: Path) -> list[dict[str, Any]]:
    """Records in the metrics file's terms from a run log's plain lines (no memory before the log had it)."""
    return step_line.parse_log(path.read_text(errors="replace"))


def build_series(records: list[dict[str, Any]]) -> tuple[dict[str, Series], tuple[int, ...], str | None]:
    """(series per PLOTTED key, resume steps, the last run_id) of records in file order.

    A "start" event at step S begins again from S: points and resume marks after S belong to a job that was
    interrupted after its last checkpoint and are dropped (a fresh start, S = 0, drops them all). Of two
    records for one step, the later wins.
    """
    points: dict[str, dict[int, float]] = {key: {} for key in PLOTTED}
    resumes: set[int] = set()
    run_id = None
    for record in records:
        step = record["step"]
        if record.get("event") == "start":
            for by_step in points.values():
                for stale in [s for s in by_step if s > step]:
                    del by_step[stale]
            resumes = {s for s in resumes if s <= step}
            if record.get("resumed_from") is not None:
                resumes.add(step)
            run_id = record.get("run_id", run_id)
            continue
        if "event" in record:
            continue
        for key in PLOTTED:
            value = _number(record.get(key))
            if value is not None:
                points[key][step] = value
    series = {
        key: Series(tuple(sorted(by_step)), tuple(by_step[s] for s in sorted(by_step)))
        for key, by_step in points.items()
    }
    return series, tuple(sorted(resumes)), run_id


def metrics_path_of_log(log: Path) -> Path:
    return log.with_name(log.stem + METRICS_SUFFIX)


def load_run(path: Path) -> RunSeries:
    """The series to plot for a metrics JSONL or a run log."""
    if not path.exists():
        raise ConfigError(f"{path} does not exist: {USAGE_HINT}")
    if not path.is_file():
        raise ConfigError(f"{path} is not a file: {USAGE_HINT}")
    if path.suffix in (".jsonl", ".json"):
        source, records = path, read_metrics(path)
    elif (sibling := metrics_path_of_log(path)).is_file():
        source, records = sibling, read_metrics(sibling)
    else:
        source, records = path, parse_log(path)
    series, resumes, run_id = build_series(records)
    if not any(s.steps for s in series.values()):
        what = "metrics records" if source.suffix in (".jsonl", ".json") else "'Step N/M | Loss ...' lines"
        raise ConfigError(
            f"{source} has no {what} with loss, lr, throughput or memory: plot a run that has logged at least "
            f"one step ({USAGE_HINT})"
        )
    return RunSeries(source, run_id, series, resumes)


def default_output(path: Path) -> Path:
    """logs/X.out and logs/X.metrics.jsonl both plot to logs/X.png."""
    name = path.name.removesuffix(METRICS_SUFFIX) if path.name.endswith(METRICS_SUFFIX) else path.stem
    return path.with_name(name + ".png")


def _panel(ax: Any, run: RunSeries, title: str, lines: dict[str, str], ylabel: str) -> None:
    drawn = False
    for key, label in lines.items():
        s = run.series[key]
        if s.steps:
            marker = "o" if len(s.steps) < 30 or key == "val_loss" else None
            ax.plot(s.steps, s.values, label=label, marker=marker, markersize=3)
            drawn = True
    for i, step in enumerate(run.resumes):
        ax.axvline(step, color="grey", linestyle="--", linewidth=1, label="resumed" if i == 0 else None)
    if not drawn:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drawn and (len(lines) > 1 or run.resumes):
        ax.legend(fontsize="small")


def render(run: RunSeries, out: Path) -> None:
    """Write the PNG atomically: a failed render leaves any earlier plot at `out` as it was."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    try:
        _panel(axes[0, 0], run, "loss", {"loss": "train", "val_loss": "validation"}, "loss")
        _panel(axes[0, 1], run, "learning rate", {"lr": "lr"}, "lr")
        _panel(axes[1, 0], run, "throughput", {"tokens_per_s": "tokens/s (all ranks)"}, "tokens/s")
        memory = {
            "device_mem_alloc_gib": "device allocated",
            "device_mem_peak_gib": "device peak",
            "host_rss_gib": "host RSS",
        }
        _panel(axes[1, 1], run, "memory (rank 0)", memory, "GiB")
        axes[0, 1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        for ax in axes[1]:
            ax.set_xlabel("optimizer step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.suptitle(f"{run.run_id} ({run.source.name})" if run.run_id else run.source.name)
        fig.tight_layout()
        save_png(fig, out)
    finally:
        plt.close(fig)


def _check_output(out: Path, inputs: tuple[Path, ...]) -> None:
    if out.suffix.lower() != ".png":
        raise ConfigError(f"-o {out}: the plot is a PNG: give a file name ending in .png")
    if any(out.resolve() == p.resolve() for p in inputs):
        raise ConfigError(f"-o {out} is the run's own log or metrics file: choose another output file")
    if not out.parent.is_dir():
        raise ConfigError(f"-o {out}: directory {out.parent} does not exist: create it or choose another")
    if out.is_dir():
        raise ConfigError(f"-o {out} is a directory: give a file name ending in .png")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="dskit plot",
        description="Plot a run's train/validation loss, lr, tokens/s and memory over optimizer steps, with "
        "resumes marked, into one PNG.",
    )
    parser.add_argument(
        "source", metavar="RUN_LOG_OR_METRICS", help="logs/NAME.out or logs/NAME.metrics.jsonl"
    )
    parser.add_argument("-o", "--output", metavar="OUT.png", help="default: beside the input, NAME.png")
    parser.add_argument(
        "--schedules",
        action="store_true",
        help="first argument: draw the four lr schedules (cosine, wsd, linear, constant) for the training flags "
        "that follow instead of a run: dskit plot --schedules [TRAINING FLAGS] [-o OUT.png]",
    )
    return parser


def main(argv: list[str]) -> int:
    if argv[:1] == ["--schedules"]:
        from dskit.plot import schedule_plot

        return schedule_plot.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    source = Path(args.source)
    run = load_run(source)
    out = Path(args.output) if args.output else default_output(source)
    _check_output(out, (source, run.source))
    try:
        render(run, out)
    except OSError as err:
        raise ConfigError(f"cannot write {out}: {first_line(err)}: choose a writable output (-o)") from err
    train, val = run.series["loss"], run.series["val_loss"]
    print(
        f"wrote {out}: {len(train.steps)} training and {len(val.steps)} validation points, "
        f"{len(run.resumes)} resume(s), from {run.source}"
    )
    return 0
