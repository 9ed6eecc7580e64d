"""`dskit plot`: the series it draws from metrics files (a run log names its own beside it), real PNGs, and its
bad-input errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from dskit import cli
from dskit.plot import build_series, default_output, load_run, read_metrics

T0 = 1_795_363_200.0
RUN_ID = "tiny_qwen3-20261122-160000"


def train(step: int, loss: float, gpu: bool = True) -> dict:
    return {
        "step": step,
        "time": T0 + step,
        "loss": loss,
        "lr": 3e-3 * min(1.0, step / 20),
        "grad_norm": 1.2,
        "tokens_per_s": 2600.0 + step,
        "tokens_per_s_per_device": 1300.0 + step / 2,
        "tflops_per_device": 0.01,
        "mfu": None,
        "device_mem_alloc_gib": 1.0 if gpu else None,
        "device_mem_peak_gib": 2.0 + step / 100 if gpu else None,
        "host_rss_gib": 3.0,
        "data_wait_frac": 0.01,
        "step_time_s": 0.2,
        "skipped_steps": 0,
        "tokens_seen": 512 * step,
        "epoch": 0,
        "consumed": 2 * step,
    }


def validation(step: int, loss: float) -> dict:
    return {"step": step, "time": T0 + step, "val_loss": loss, "val_ppl": math.exp(loss)}


def requeued_run_records() -> list[dict]:
    """Job 1 checkpoints at 40, logs 50 (and validates there), and is killed; job 2 resumes at 40 to 60."""
    job1 = [
        {"event": "start", "step": 0, "time": T0, "run_id": RUN_ID, "resumed_from": None, "world_size": 2},
        *(train(s, 8.0 - s / 20) for s in (10, 20, 30, 40, 50)),
        validation(30, 6.5),
        {"event": "checkpoint", "step": 40, "time": T0 + 40, "tag": "tiny_qwen3-40steps", "save_s": 0.04},
        validation(50, 9.9),
    ]
    job2 = [
        {
            "event": "start",
            "step": 40,
            "time": T0 + 99,
            "run_id": RUN_ID,
            "resumed_from": "tiny_qwen3-40steps",
        },
        train(50, 5.0),
        train(60, 4.5),
        validation(60, 4.8),
        {"event": "checkpoint", "step": 60, "time": T0 + 160, "tag": "tiny_qwen3-60steps", "save_s": 0.04},
        {"event": "end", "step": 60, "time": T0 + 161, "reason": "done"},
    ]
    return job1 + job2


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def assert_png(path: Path) -> None:
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (1200, 800)
        # Not a blank canvas: lines, labels and text in several colours.
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 50


def test_a_resume_drops_what_the_interrupted_job_logged_after_its_checkpoint():
    timeline = build_series(requeued_run_records())
    series = timeline.series
    assert timeline.resumes == (40,)
    assert timeline.run_id == RUN_ID
    loss = series["loss"]
    assert loss.steps == (10, 20, 30, 40, 50, 60)
    assert loss.values == pytest.approx([7.5, 7.0, 6.5, 6.0, 5.0, 4.5])  # step 50: the requeued job's
    # Job 1's validation at 50 happened after its checkpoint: the requeued job's timeline has none there.
    assert series["val_loss"].steps == (30, 60)
    assert series["val_loss"].values == (6.5, 4.8)
    assert series["device_mem_peak_gib"].values[-1] == pytest.approx(2.6)
    assert series["lr"].values[0] == pytest.approx(1.5e-3)


def test_later_records_win_and_a_fresh_start_begins_again():
    records = [
        *(train(s, 9.0, gpu=False) for s in (10, 20)),
        {"event": "start", "step": 10, "resumed_from": "tiny_qwen3-10steps"},
        train(20, 8.0, gpu=False),
        train(20, 7.0, gpu=False),  # a duplicate step with no event between: the later one
        {"event": "start", "step": 20, "resumed_from": "tiny_qwen3-20steps"},
        {"event": "start", "step": 20, "resumed_from": "tiny_qwen3-20steps"},  # a crash loop: one mark
    ]
    timeline = build_series(records)
    series = timeline.series
    assert series["loss"].steps == (10, 20) and series["loss"].values == (9.0, 7.0)
    assert timeline.resumes == (10, 20)
    assert series["device_mem_alloc_gib"].steps == ()  # CPU: null device memory is not a point
    assert series["host_rss_gib"].values == (3.0, 3.0)

    timeline = build_series([*records, {"event": "start", "step": 0, "resumed_from": None}])
    assert timeline.resumes == () and timeline.series["loss"].steps == ()


def test_plot_of_a_metrics_file_with_a_resume(tmp_path, capsys):
    metrics = write_jsonl(tmp_path / "logs" / f"{RUN_ID}.metrics.jsonl", requeued_run_records())
    assert cli.main(["plot", str(metrics)]) == 0
    out = tmp_path / "logs" / f"{RUN_ID}.png"
    assert_png(out)
    printed = capsys.readouterr().out
    assert f"wrote {out}: 6 training and 2 validation points, 1 resume(s), 0 skipped step(s)" in printed

    other = tmp_path / "elsewhere.png"
    assert cli.main(["plot", str(metrics), "-o", str(other)]) == 0
    assert_png(other)


def test_a_run_log_is_plotted_from_the_metrics_file_beside_it_never_from_its_text(tmp_path, capsys):
    log = tmp_path / "logs" / "job_42.out"
    log.parent.mkdir()
    log.write_text("2026-11-22 16:00:01 | Step 10/60 | Loss 7.5000 | lr 1.50e-03\n")
    err = plot_error([str(log)], capsys)  # --metrics_file none: nothing to plot, whatever the log says
    assert f"{log} has no metrics file beside it ({log.with_name('job_42.metrics.jsonl')})" in err


def test_a_run_log_with_a_metrics_file_plots_the_metrics_file(tmp_path):
    log = tmp_path / "logs" / "job_42.out"
    metrics = write_jsonl(tmp_path / "logs" / "job_42.metrics.jsonl", requeued_run_records())
    log.write_text("START ...\n")
    run = load_run(log)
    assert run.source == metrics
    assert run.series["loss"].steps == (10, 20, 30, 40, 50, 60)
    assert default_output(log) == default_output(metrics) == tmp_path / "logs" / "job_42.png"


def test_a_last_line_still_being_written_is_skipped(tmp_path, capsys):
    metrics = write_jsonl(tmp_path / "m.metrics.jsonl", [train(10, 7.0), train(20, 6.0)])
    with metrics.open("a") as f:
        f.write(json.dumps(train(30, 5.0))[:40])
    assert [r["step"] for r in read_metrics(metrics)] == [10, 20]
    assert "line 3 is incomplete" in capsys.readouterr().err


def plot_error(argv: list[str], capsys) -> str:
    assert cli.main(["plot", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_error_line_and_keeps_existing_files(tmp_path, capsys):
    logs = tmp_path / "logs"
    good = write_jsonl(logs / "good.metrics.jsonl", requeued_run_records())
    earlier_plot = logs / "good.png"
    earlier_plot.write_bytes(b"an earlier plot")

    assert "does not exist" in plot_error([str(logs / "missing.out")], capsys)
    assert "not a file" in plot_error([str(logs)], capsys)

    broken = logs / "broken.metrics.jsonl"
    broken.write_text(json.dumps(train(10, 7.0)) + "\n{not json\n" + json.dumps(train(20, 6.0)) + "\n")
    assert f"{broken} line 2 is not valid JSON" in plot_error([str(broken), "-o", str(earlier_plot)], capsys)

    not_a_record = write_jsonl(logs / "list.metrics.jsonl", [train(10, 7.0)])
    with not_a_record.open("a") as f:
        f.write('{"loss": 1.0}\n')
    assert "line 2 is not a metrics record" in plot_error([str(not_a_record)], capsys)

    just_started = {**requeued_run_records()[0], "run_id": "tiny_qwen3-20261122-170000"}
    only_events = write_jsonl(logs / "new.metrics.jsonl", [just_started])
    assert "has no metrics records" in plot_error([str(only_events)], capsys)
    empty_log = logs / "crashed.out"
    empty_log.write_text("START ...\nTraceback (most recent call last):\n")
    assert "has no metrics file beside it" in plot_error([str(empty_log)], capsys)

    assert "ending in .png" in plot_error([str(good), "-o", str(logs / "plot.pdf")], capsys)
    assert "does not exist" in plot_error([str(good), "-o", str(tmp_path / "nowhere" / "x.png")], capsys)
    assert "unrecognized arguments" in plot_error([str(good), "--dpi", "300"], capsys)
    assert "unrecognized arguments" in plot_error([str(good), "--out", "x.png"], capsys)  # no abbreviations

    assert earlier_plot.read_bytes() == b"an earlier plot"
    assert read_metrics(good) == requeued_run_records()
    assert sorted(p.name for p in logs.iterdir()) == [
        "broken.metrics.jsonl",
        "crashed.out",
        "good.metrics.jsonl",
        "good.png",
        "list.metrics.jsonl",
        "new.metrics.jsonl",
    ]


# --- a run in several files, the spike guard's marks, the axes ----------------------------------------------


def two_launches(logs: Path) -> tuple[Path, Path]:
    """A local run launched twice (train-singlenode.sh: a log and a metrics file per launch), beside another
    run's files."""
    records = requeued_run_records()
    cut = next(i for i, r in enumerate(records) if r.get("event") == "start" and r["step"] == 40)
    write_jsonl(logs / "tiny_qwen3-deepspeed_20261122-160000.metrics.jsonl", records[:cut])
    second = write_jsonl(logs / "tiny_qwen3-deepspeed_20261122-161500.metrics.jsonl", records[cut:])
    other = [{**records[0], "run_id": "tiny_qwen3-deepspeed-20261122-170000"}, train(10, 1.0), train(70, 1.0)]
    write_jsonl(logs / "tiny_qwen3-deepspeed_20261122-170000.metrics.jsonl", other)
    log = logs / "tiny_qwen3-deepspeed_20261122-161500.out"
    log.write_text("START ...\n")
    return log, second


def test_a_run_launched_twice_is_stitched_from_its_id_its_logs_or_any_of_its_files(tmp_path, capsys):
    logs = tmp_path / "logs"
    log, second = two_launches(logs)
    first = logs / "tiny_qwen3-deepspeed_20261122-160000.metrics.jsonl"
    for target in (RUN_ID, log, first, second):
        run = load_run(target, logs)
        assert run.sources == (first, second), target
        assert run.run_id == RUN_ID and run.resumes == (40,)
        assert run.series["loss"].steps == (10, 20, 30, 40, 50, 60)  # not the other run's 70
        assert run.series["loss"].values[4] == 5.0  # step 50: the resumed launch's
        assert run.series["val_loss"].steps == (30, 60)

    assert cli.main(["plot", RUN_ID, "--dir", str(logs)]) == 0
    assert_png(logs / f"{RUN_ID}.png")
    assert f"from {first}, {second}" in capsys.readouterr().out

    err = plot_error(["tiny_qwen3-20991231-000000", "--dir", str(logs)], capsys)
    assert f"no metrics file in {logs}/ has run tiny_qwen3-20991231-000000" in err


def guarded_run_records() -> list[dict]:
    """Steps 1-30 logged every 5; a skip at 23; a rollback at 30 to the checkpoint of 20, then 25 and 30 again."""
    start = {"event": "start", "step": 0, "time": T0, "run_id": RUN_ID, "resumed_from": None}
    skip = {"event": "spike_skip", "step": 23, "signal": "loss", "value": 40.0, "threshold": 9.0}
    rollback = {
        "event": "rollback",
        "step": 20,
        "from_step": 30,
        "tag": "tiny_qwen3-20steps",
        "reason": "grad norm",
        "skip_from": {"epoch": 0, "consumed": 40},
        "skip_to": {"epoch": 0, "consumed": 60},
    }
    before = [train(s, 8.0 - s / 10) for s in (5, 10, 15, 20, 25, 30)]
    return [start, *before, skip, rollback, train(25, 5.0), train(30, 4.0)]


def test_spike_guard_skips_and_rollbacks_are_read_and_marked_on_the_loss(tmp_path):
    from dskit.plot import ROLLBACK_MARK, SKIP_MARK, Rollback, figure

    timeline = build_series(guarded_run_records())
    assert timeline.skips == (23,)
    assert timeline.rollbacks == (Rollback(to_step=20, from_step=30),)
    assert timeline.series["loss"].values[-2:] == (5.0, 4.0)  # the steps trained again after the rollback

    run = load_run(write_jsonl(tmp_path / "guarded.metrics.jsonl", guarded_run_records()))
    fig = figure(run)
    try:
        loss_ax, lr_ax = fig.axes[0], fig.axes[1]
        skips = [line for line in loss_ax.lines if line.get_gid() == SKIP_MARK]
        assert [tuple(line.get_xdata()) for line in skips] == [(23,)]
        spans = [patch for patch in loss_ax.patches if patch.get_gid() == ROLLBACK_MARK]
        assert len(spans) == 1
        assert (spans[0].get_x(), spans[0].get_x() + spans[0].get_width()) == (20, 30)
        labels = loss_ax.get_legend_handles_labels()[1]
        assert "spike skipped" in labels and "rolled back" in labels
        assert not [p for p in lr_ax.patches if p.get_gid() == ROLLBACK_MARK]  # the loss panel's marks
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_memory_starts_at_zero_and_step_ticks_fall_on_logged_steps(tmp_path):
    from dskit.plot import RESUME_MARK, figure

    records = [
        {"event": "start", "step": 0, "time": T0, "run_id": RUN_ID, "resumed_from": None},
        *({**train(s, 7.0), "device_mem_alloc_gib": 0.910 + s / 1000} for s in (2, 4, 6, 8)),
        {"event": "start", "step": 4, "time": T0 + 50, "run_id": RUN_ID, "resumed_from": "tiny_qwen3-4steps"},
    ]
    run = load_run(write_jsonl(tmp_path / "short.metrics.jsonl", records))
    fig = figure(run)
    try:
        loss_ax, memory_ax = fig.axes[0], fig.axes[3]
        bottom, top = memory_ax.get_ylim()
        assert bottom == 0 and top >= 1.1 * 0.918  # not 0.910-0.918 blown up into a cliff, nor on the frame
        assert [line.get_xdata()[0] for line in memory_ax.lines if line.get_gid() == RESUME_MARK] == [4]
        low, high = memory_ax.get_xlim()
        ticks = [t for t in memory_ax.get_xticks() if low <= t <= high]
        assert ticks and all(t == int(t) and int(t) % 2 == 0 for t in ticks), ticks  # logged every 2 steps
        assert list(loss_ax.get_xticks()) == list(memory_ax.get_xticks())  # one shared step axis
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)

    long_run = build_series([train(s, 7.0) for s in range(10, 610, 10)])
    from dskit.plot import step_locator

    locs = step_locator(long_run.series["loss"].steps).tick_values(0, 600)
    assert len(locs) <= 12 and all(loc % 10 == 0 for loc in locs)


def test_a_preference_run_gets_its_rewards_and_accuracy_panels(tmp_path):
    """--objective dpo: rewards (chosen, rejected, margin, validation's margin) and reward accuracy below the four
    panels; a run without them keeps four."""
    from dskit.plot import figure

    rewards = {"reward_chosen": 0.1, "reward_rejected": -0.2, "reward_margin": 0.3, "reward_accuracy": 0.75}
    records = [{**train(s, 0.69 - s / 100), **rewards} for s in (1, 2, 3)]
    records.append(
        {"step": 3, "time": T0 + 3, "val_loss": 0.6, "val_reward_margin": 0.25, "val_reward_accuracy": 1.0}
    )
    run = load_run(write_jsonl(tmp_path / "dpo.metrics.jsonl", records))
    fig = figure(run)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[4:] == ["rewards", "reward accuracy"], titles
    assert [line.get_label() for line in fig.axes[5].get_lines()] == ["train", "validation"]
    plain = figure(load_run(write_jsonl(tmp_path / "lm.metrics.jsonl", [train(1, 7.0), train(2, 6.5)])))
    assert len(plain.axes) == 4
