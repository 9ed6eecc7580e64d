"""The log line <-> record round trip: the trainer's lines and `dskit plot`'s parser come from one table in
step_line.py; fields a CPU run lacks are left out, NaN survives, validation and start lines parse back."""

from __future__ import annotations

import math

import pytest

from model_utils.observe import step_line

RECORD = {
    "step": 10,
    "loss": 7.12345,
    "lr": 3e-3,
    "grad_norm": 1.234,
    "tokens_per_s": 2600.4,
    "tokens_per_s_per_device": 1300.2,
    "tflops_per_device": 0.0123,
    "mfu": 0.4215,
    "device_mem_alloc_gib": 1.04,
    "device_mem_peak_gib": 2.01,
    "host_rss_gib": 3.3,
    "data_wait_frac": 0.012,
    "step_time_s": 0.5,
    "skipped_steps": 2,
    "eta_s": 3725,
}


def test_step_line_renders_every_field_and_parses_back() -> None:
    line = step_line.step_line(RECORD, 100, time_left=60)
    assert line == (
        "Step 10/100 | Loss 7.1235 | lr 3.00e-03 | grad_norm 1.23 | tokens/s 2600 (1300/device) | "
        "TFLOPs/device 0.0123 | MFU 42.1% | mem 1.0/2.0 GiB | RSS 3.3 GiB | data 1.2% | s/step 0.500 | "
        "skipped 2 | ETA 1:02:05 (job time left 0:01:00)"
    )
    parsed = step_line.parse(f"2026-11-23 12:00:00 | {line}")
    assert parsed is not None
    for key in ("loss", "grad_norm", "tokens_per_s", "host_rss_gib", "device_mem_peak_gib", "step_time_s"):
        assert parsed[key] == pytest.approx(RECORD[key], rel=1e-2, abs=1e-4), key
    assert parsed["mfu"] == pytest.approx(0.421) and parsed["data_wait_frac"] == pytest.approx(0.012)
    assert parsed["step"] == 10


def test_cpu_records_leave_out_what_they_do_not_have() -> None:
    record = {**RECORD, "mfu": None, "device_mem_alloc_gib": None, "device_mem_peak_gib": None}
    record["skipped_steps"] = 0
    line = step_line.step_line(record, 100)
    assert "MFU" not in line and "mem " not in line and "skipped" not in line
    assert line.endswith("| ETA 1:02:05")
    parsed = step_line.parse(line)
    assert parsed is not None and "mfu" not in parsed and "device_mem_alloc_gib" not in parsed


def test_nan_grad_norm_and_validation_and_start_lines() -> None:
    parsed = step_line.parse(step_line.step_line({**RECORD, "grad_norm": float("nan")}, 100))
    assert parsed is not None and math.isnan(parsed["grad_norm"])
    validation = step_line.validation_line({"step": 4, "val_loss": 2.5, "val_ppl": 12.18}, 8)
    assert validation == "Step 4/8 | Validation Loss 2.5000 | Perplexity 12.18"
    assert step_line.parse(validation) == {"step": 4, "val_loss": 2.5, "val_ppl": 12.18}
    resumed = step_line.resumed_line("ck/t-5steps", 5, 0, 40, 1e-3)
    assert step_line.parse(resumed) == {"event": "start", "step": 5, "resumed_from": "checkpoint"}
    assert step_line.parse(step_line.fresh_line("ck")) == {"event": "start", "step": 0, "resumed_from": None}
    assert step_line.parse("2026-11-23 12:00:00 | Training tiny for 8 steps") is None


def test_format_duration() -> None:
    assert step_line.format_duration(3725.9) == "1:02:05"
    assert step_line.format_duration(-3) == "0:00:00"
