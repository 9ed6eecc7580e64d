"""`dskit plot`: one PNG of a run's loss, learning rate, throughput and memory over optimizer steps.

A run is named by its id (the log's "Run ID: metrics to ..." line), one of its logs (`logs/X.out`: its sibling
`logs/X.metrics.jsonl`) or one of its metrics files. Each launch of `train-singlenode.sh` writes its own log and
metrics file, and a requeued SLURM job appends to its one: every job of the run, from every metrics file in that
directory, is stitched in the order the jobs started. A resume restarts the story at its step, so what the
interrupted job logged after that checkpoint is dropped and the resumed job's records win; a spike guard rollback
does the same. Resumes are drawn as vertical lines, rollbacks as the span of steps undone, skipped steps as
crosses on the loss panel. It reads the metrics records only, never the log's text: a run with `--metrics_file none`
cannot be plotted.
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
from model_utils.loop.spike_guard import ROLLBACK, SPIKE_SKIP

# A preference objective's (model_utils/engines/preference.py): a third row of panels, rewards and accuracy.
REWARDS = {
    "reward_chosen": "chosen",
    "reward_rejected": "rejected",
    "reward_margin": "margin",
    "val_reward_margin": "margin (validation)",
}
ACCURACY = {"reward_accuracy": "train", "val_reward_accuracy": "validation"}
PREFERENCE = (*REWARDS, *ACCURACY)
# Record keys that are plotted, in the metrics JSONL's names.
PLOTTED = (
    "loss",
    "val_loss",
    "lr",
    "tokens_per_s",
    "device_mem_alloc_gib",
    "device_mem_peak_gib",
    "host_rss_gib",
    *PREFERENCE,
)
METRICS_SUFFIX = ".metrics.jsonl"
USAGE_HINT = "pass a run id, a run log (logs/NAME.out) or a metrics file (logs/NAME.metrics.jsonl)"
# The gid of each kind of mark on the panels, so that tests and tools can find them among the artists.
RESUME_MARK, SKIP_MARK, ROLLBACK_MARK = "resume", "spike_skip", "rollback"


@dataclass(frozen=True)
class Series:
    steps: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class Rollback:
    to_step: int  # the checkpoint's step the run went back to
    from_step: int  # the step it had reached


@dataclass(frozen=True)
class Timeline:
    """Records in the order they were written, read as one run: a series per PLOTTED key (possibly empty), the
    steps it resumed at, the spike guard's skipped steps and rollbacks, and its run id (the last start's)."""

    series: dict[str, Series]
    resumes: tuple[int, ...]
    skips: tuple[int, ...]
    rollbacks: tuple[Rollback, ...]
    run_id: str | None


@dataclass(frozen=True)
class RunSeries:
    """What one plot shows: the run's timeline and the files it came from, oldest first."""

    sources: tuple[Path, ...]  # the metrics files (a log when a run wrote none)
    timeline: Timeline

    @property
    def source(self) -> Path:
        return self.sources[-1]

    @property
    def run_id(self) -> str | None:
        return self.timeline.run_id

    @property
    def series(self) -> dict[str, Series]:
        return self.timeline.series

    @property
    def resumes(self) -> tuple[int, ...]:
        return self.timeline.resumes


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


def build_series(records: list[dict[str, Any]]) -> Timeline:
    """The timeline of records in the order they were written.

    A "start" event at step S begins again from S: points and marks after S belong to a job that was interrupted
    after its last checkpoint and are dropped (a fresh start, S = 0, drops them all). A spike guard "rollback" to
    step S undoes the points after S in the same way (the steps trained again are logged again). Of two records
    for one step, the later wins.
    """
    points: dict[str, dict[int, float]] = {key: {} for key in PLOTTED}
    resumes: set[int] = set()
    skips: set[int] = set()
    rollbacks: list[Rollback] = []
    run_id = None

    def drop_after(step: int) -> None:
        for by_step in points.values():
            for stale in [s for s in by_step if s > step]:
                del by_step[stale]

    for record in records:
        step, event = record["step"], record.get("event")
        if event == "start":
            drop_after(step)
            resumes = {s for s in resumes if s <= step}
            skips = {s for s in skips if s <= step}
            rollbacks = [r for r in rollbacks if r.from_step <= step]
            if record.get("resumed_from") is not None and not record.get("validation_only"):
                resumes.add(step)  # a --validation_only run's checkpoint is read, not resumed
            run_id = record.get("run_id", run_id)
        elif event == ROLLBACK:
            drop_after(step)
            from_step = record.get("from_step")
            rollbacks.append(Rollback(step, from_step if isinstance(from_step, int) else step))
        elif event == SPIKE_SKIP:
            skips.add(step)
        elif event is None:
            for key in PLOTTED:
                value = _number(record.get(key))
                if value is not None:
                    points[key][step] = value
    series = {
        key: Series(tuple(sorted(by_step)), tuple(by_step[s] for s in sorted(by_step)))
        for key, by_step in points.items()
    }
    return Timeline(series, tuple(sorted(resumes)), tuple(sorted(skips)), tuple(rollbacks), run_id)


def metrics_path_of_log(log: Path) -> Path:
    return log.with_name(log.stem + METRICS_SUFFIX)


def run_segments(records: list[dict[str, Any]]) -> list[tuple[str | None, list[dict[str, Any]]]]:
    """A metrics file cut at its start records: (run id, records) per job that wrote into it; what came before
    any start has run id None."""
    segments: list[tuple[str | None, list[dict[str, Any]]]] = [(None, [])]
    for record in records:
        if record.get("event") == "start":
            segments.append((record.get("run_id"), []))
        segments[-1][1].append(record)
    return [(run_id, part) for run_id, part in segments if part]


def _started_at(segment: list[dict[str, Any]]) -> float:
    time = _number(segment[0].get("time"))
    return math.inf if time is None else time


def stitch(run_id: str, files: list[Path]) -> tuple[tuple[Path, ...], list[dict[str, Any]]]:
    """Every job of `run_id` in these metrics files (resumed runs write a file per launch, a requeued SLURM job
    appends to one), in the order they started; and the files that had one, in that order."""
    found: list[tuple[float, int, Path, list[dict[str, Any]]]] = []
    for path in files:
        if run_id not in path.read_text(errors="replace"):  # most files in logs/ are other runs': not parsed
            continue
        for order, (segment_run, records) in enumerate(run_segments(read_metrics(path))):
            if segment_run == run_id:
                found.append((_started_at(records), order, path, records))
    found.sort(key=lambda item: (item[0], str(item[2]), item[1]))
    sources = tuple(dict.fromkeys(path for _, _, path, _ in found))
    return sources, [record for *_, records in found for record in records]


def _run_of(target: str, search_dir: Path) -> tuple[str | None, Path | None]:
    """(run id, None) for a run id or name, (None, the file) for a log or metrics file."""
    path = Path(target)
    if path.exists():
        if not path.is_file():
            raise ConfigError(f"{path} is not a file: {USAGE_HINT}")
        return None, path
    looks_like_path = "/" in target or target.endswith((".out", ".jsonl", ".json", ".log"))
    if looks_like_path or not search_dir.is_dir():
        raise ConfigError(f"{path} does not exist: {USAGE_HINT}")
    return target, None


def load_run(target: str | Path, search_dir: Path = Path("logs")) -> RunSeries:
    """The series to plot for a run id (its metrics files in `search_dir`), a metrics JSONL or a run log (every
    metrics file of its run beside it, stitched)."""
    run_id, path = _run_of(str(target), search_dir)
    if path is None:
        assert run_id is not None
        sources, records = stitch(run_id, sorted(search_dir.glob("*" + METRICS_SUFFIX)))
        if not sources:
            raise ConfigError(
                f"no metrics file in {search_dir}/ has run {run_id}: give the id its log names (the line "
                f"'Run ID: metrics to ...'), --dir where its metrics files are, or {USAGE_HINT}"
            )
        return _checked(sources, records)
    metrics = path if path.suffix in (".jsonl", ".json") else metrics_path_of_log(path)
    if not metrics.is_file():
        raise ConfigError(
            f"{path} has no metrics file beside it ({metrics}): the log names the run's metrics file in its line "
            f"'Run ID: metrics to ...' (none with --metrics_file none): plot that file or the run id"
        )
    records = read_metrics(metrics)
    own_run = build_series(records).run_id
    if own_run is None:
        return _checked((metrics,), records)
    siblings = sorted({*metrics.parent.glob("*" + METRICS_SUFFIX), metrics})
    sources, stitched = stitch(own_run, siblings)
    return _checked(sources, stitched)


def _checked(sources: tuple[Path, ...], records: list[dict[str, Any]]) -> RunSeries:
    timeline = build_series(records)
    if not any(s.steps for s in timeline.series.values()):
        raise ConfigError(
            f"{sources[-1]} has no metrics records with loss, lr, throughput or memory: plot a run that has logged "
            f"at least one step ({USAGE_HINT})"
        )
    return RunSeries(sources, timeline)


def default_output(target: str | Path, search_dir: Path = Path("logs")) -> Path:
    """logs/X.out and logs/X.metrics.jsonl both plot to logs/X.png; a run id to <search_dir>/<run id>.png."""
    path = Path(target)
    if not path.exists() and path.parent == Path("."):
        return search_dir / f"{target}.png"
    name = path.name.removesuffix(METRICS_SUFFIX) if path.name.endswith(METRICS_SUFFIX) else path.stem
    return path.with_name(name + ".png")


def step_locator(steps: tuple[int, ...], most: int = 10) -> Any:
    """Ticks on logged steps: multiples of the logging interval (the steps' common divisor), 1, 2 or 5 times
    10^k of them, at most `most` ticks over the run."""
    from matplotlib.ticker import MaxNLocator, MultipleLocator

    interval = math.gcd(*steps) if steps else 1
    if interval == 0:
        return MaxNLocator(integer=True)
    span = max(steps) - min(0, min(steps))
    scale = 1
    while span / (interval * scale) > most:
        scale = next(s * 10**k for k in range(12) for s in (1, 2, 5) if s * 10**k > scale)
    return MultipleLocator(interval * scale)


def _panel(ax: Any, run: RunSeries, title: str, lines: dict[str, str], ylabel: str) -> None:
    drawn = False
    for key, label in lines.items():
        s = run.series[key]
        if s.steps:
            marker = "o" if len(s.steps) < 30 or key == "val_loss" else None
            ax.plot(s.steps, s.values, label=label, marker=marker, markersize=3)
            drawn = True
    for i, step in enumerate(run.resumes):
        ax.axvline(
            step,
            color="grey",
            linestyle="--",
            linewidth=1,
            label="resumed" if i == 0 else None,
            gid=RESUME_MARK,
        )
    if not drawn:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _guard_marks(ax: Any, timeline: Timeline) -> None:
    """The spike guard's skipped steps (a cross on the axis: their loss was not applied, and a spike's value
    would squash the curve) and its rollbacks (the span of steps undone)."""
    if timeline.skips:
        ax.plot(
            timeline.skips,
            [0.02] * len(timeline.skips),
            linestyle="none",
            marker="x",
            color="red",
            transform=ax.get_xaxis_transform(),  # x in steps, y in axes fractions
            clip_on=False,
            label="spike skipped",
            gid=SKIP_MARK,
        )
    for i, back in enumerate(timeline.rollbacks):
        ax.axvspan(
            back.to_step,
            max(back.from_step, back.to_step),
            color="orange",
            alpha=0.2,
            label="rolled back" if i == 0 else None,
            gid=ROLLBACK_MARK,
        )


def _legend(ax: Any) -> None:
    if len(ax.get_legend_handles_labels()[1]) > 1:
        ax.legend(fontsize="small")


def render(run: RunSeries, out: Path) -> None:
    """Write the PNG atomically: a failed render leaves any earlier plot at `out` as it was."""
    fig = figure(run)
    try:
        save_png(fig, out)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def figure(run: RunSeries) -> Any:
    """The run's four panels (loss, lr, throughput, memory) on one figure, and a preference objective's rewards and
    reward accuracy below them; the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preference = any(run.series[key].steps for key in PREFERENCE)
    rows = 3 if preference else 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), sharex=True)
    try:
        loss_ax, lr_ax, rate_ax, memory_ax = axes.flat[:4]
        if preference:
            rewards_ax, accuracy_ax = axes.flat[4:]
            _panel(rewards_ax, run, "rewards", REWARDS, "reward")
            _panel(accuracy_ax, run, "reward accuracy", ACCURACY, "share of pairs")
        _panel(loss_ax, run, "loss", {"loss": "train", "val_loss": "validation"}, "loss")
        _guard_marks(loss_ax, run.timeline)
        _panel(lr_ax, run, "learning rate", {"lr": "lr"}, "lr")
        _panel(rate_ax, run, "throughput", {"tokens_per_s": "tokens/s (all ranks)"}, "tokens/s")
        memory = {
            "device_mem_alloc_gib": "device allocated",
            "device_mem_peak_gib": "device peak",
            "host_rss_gib": "host RSS",
        }
        _panel(memory_ax, run, "memory (rank 0)", memory, "GiB")
        # From 0: a steady 0.91 GiB autoscaled alone looks like a cliff over a few MiB of noise; the headroom
        # keeps the curves off the frame and out from under the legend.
        highest = max((v for key in memory for v in run.series[key].values), default=0.0)
        memory_ax.set_ylim(0, highest * 1.3 or 1.0)
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        for ax in axes.flat:
            _legend(ax)
        steps = tuple(sorted({s for series in run.series.values() for s in series.steps}))
        loss_ax.xaxis.set_major_locator(step_locator(steps))  # shared by the four panels (sharex)
        for ax in axes[-1]:
            ax.set_xlabel("optimizer step")
        files = f"{len(run.sources)} files" if len(run.sources) > 1 else run.source.name
        fig.suptitle(f"{run.run_id} ({files})" if run.run_id else run.source.name)
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig


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
        "resumes, spike guard skips and rollbacks marked, into one PNG. Every metrics file of the run is "
        "stitched.",
    )
    parser.add_argument(
        "source",
        metavar="RUN",
        help="a run id (its metrics files in --dir), logs/NAME.out or logs/NAME.metrics.jsonl",
    )
    parser.add_argument(
        "-o", "--output", metavar="OUT.png", help="default: beside the input, NAME.png (a run id: DIR/ID.png)"
    )
    parser.add_argument(
        "--dir",
        default="logs",
        metavar="DIR",
        help="where a run id's metrics files are (default: logs, where the launchers and --report_dir put them)",
    )
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
    search_dir = Path(args.dir)
    run = load_run(args.source, search_dir)
    out = Path(args.output) if args.output else default_output(args.source, search_dir)
    _check_output(out, (Path(args.source), *run.sources))
    try:
        render(run, out)
    except OSError as err:
        raise ConfigError(f"cannot write {out}: {first_line(err)}: choose a writable output (-o)") from err
    train, val = run.series["loss"], run.series["val_loss"]
    timeline = run.timeline
    print(
        f"wrote {out}: {len(train.steps)} training and {len(val.steps)} validation points, "
        f"{len(timeline.resumes)} resume(s), {len(timeline.skips)} skipped step(s), "
        f"{len(timeline.rollbacks)} rollback(s), from {', '.join(map(str, run.sources))}"
    )
    return 0
