"""`dskit plot`: the series it draws from metrics files and run logs, real PNGs, and its bad-input errors."""

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
    series, resumes, run_id = build_series(requeued_run_records())
    assert resumes == (40,)
    assert run_id == RUN_ID
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
    series, resumes, _ = build_series(records)
    assert series["loss"].steps == (10, 20) and series["loss"].values == (9.0, 7.0)
    assert resumes == (10, 20)
    assert series["device_mem_alloc_gib"].steps == ()  # CPU: null device memory is not a point
    assert series["host_rss_gib"].values == (3.0, 3.0)

    series, resumes, _ = build_series([*records, {"event": "start", "step": 0, "resumed_from": None}])
    assert resumes == () and series["loss"].steps == ()


def test_plot_of_a_metrics_file_with_a_resume(tmp_path, capsys):
    metrics = write_jsonl(tmp_path / "logs" / f"{RUN_ID}.metrics.jsonl", requeued_run_records())
    assert cli.main(["plot", str(metrics)]) == 0
    out = tmp_path / "logs" / f"{RUN_ID}.png"
    assert_png(out)
    printed = capsys.readouterr().out
    assert f"wrote {out}: 6 training and 2 validation points, 1 resume(s)" in printed

    other = tmp_path / "elsewhere.png"
    assert cli.main(["plot", str(metrics), "-o", str(other)]) == 0
    assert_png(other)


LOG = """\
START 2026-11-22T16:00:00+00:00 on vm with 2 ranks (CPU)
2026-11-22 16:00:00 | No checkpoint in checkpoints: starting fresh
2026-11-22 16:00:01 | Step 10/60 | Loss 7.5000 | lr 1.50e-03 | grad_norm 1.23 | tokens/s 2600 (1300/device) | s/step 0.280
2026-11-22 16:00:02 | Step 20/60 | Loss 7.0000 | lr 3.00e-03 | grad_norm 1.10 | tokens/s 2650 (1325/device) | s/step 0.270
2026-11-22 16:00:02 | Step 20/60 | Validation Loss 6.9000 | Perplexity 992.27
2026-11-22 16:00:03 | Step 30/60 | Loss 9.0000 | lr 3.00e-03 | grad_norm 1.00 | tokens/s 2700 (1350/device) | s/step 0.260
END 2026-11-22T16:00:04+00:00 exit status 137
2026-11-22 16:01:00 | Resumed from checkpoints/tiny_qwen3-20steps at step 20 (world size 2)
2026-11-22 16:01:01 | Step 30/60 | Loss 6.5000 | lr 2.50e-03 | grad_norm 1.0 | tokens/s 2800 (1400/device) \
| TFLOPs/device 0.0123 | mem 1.0/2.5 GiB | RSS 3.1 GiB | data 0.5% | s/step 0.250 | ETA 0:00:10
2026-11-22 16:01:02 | Step 30/60 | Validation Loss 6.4000 | Perplexity 601.85
"""


def test_plot_of_a_run_log_without_a_metrics_file(tmp_path, capsys):
    log = tmp_path / "logs" / "tiny_20261122-160000.out"
    log.parent.mkdir()
    log.write_text(LOG)
    run = load_run(log)
    assert run.source == log
    assert run.resumes == (20,)
    assert run.series["loss"].steps == (10, 20, 30)
    assert run.series["loss"].values == (7.5, 7.0, 6.5)
    assert run.series["val_loss"].steps == (20, 30) and run.series["val_loss"].values == (6.9, 6.4)
    assert run.series["lr"].values == (1.5e-3, 3e-3, 2.5e-3)
    assert run.series["tokens_per_s"].values == (2600, 2650, 2800)
    assert run.series["device_mem_peak_gib"].steps == (30,) and run.series["host_rss_gib"].values == (3.1,)

    assert cli.main(["plot", str(log)]) == 0
    assert_png(tmp_path / "logs" / "tiny_20261122-160000.png")
    assert "3 training and 2 validation points, 1 resume(s)" in capsys.readouterr().out


def test_a_run_log_with_a_metrics_file_plots_the_metrics_file(tmp_path):
    log = tmp_path / "logs" / "job_42.out"
    metrics = write_jsonl(tmp_path / "logs" / "job_42.metrics.jsonl", requeued_run_records())
    log.write_text(LOG)
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

    only_events = write_jsonl(logs / "new.metrics.jsonl", requeued_run_records()[:1])
    assert "has no metrics records" in plot_error([str(only_events)], capsys)
    empty_log = logs / "crashed.out"
    empty_log.write_text("START ...\nTraceback (most recent call last):\n")
    assert "has no 'Step N/M | Loss ...' lines" in plot_error([str(empty_log)], capsys)

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
