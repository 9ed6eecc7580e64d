"""Metric arithmetic: FLOPs per token, device peaks, throughput, memory, and the JSONL writer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import psutil
import pytest
import torch

from model_utils.observe import metrics


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
    ],
)
def test_peak_table_matches_device_names_as_torch_reports_them(name: str, peak: float | None) -> None:
    assert metrics.peak_tflops(name) == peak


def test_peak_override_wins() -> None:
    assert metrics.peak_tflops("cpu", 1.5) == 1.5
    assert metrics.peak_tflops("NVIDIA H100 80GB HBM3", 500.0) == 500.0


def test_throughput_per_device_tflops_and_mfu() -> None:
    rate = metrics.throughput(
        tokens=8192, trained_tokens=2000, seconds=2.0, world_size=4, flops_per_tok=1e9, peak=10.0
    )
    assert rate.tokens_per_s == 4096 and rate.tokens_per_s_per_device == 1024
    assert rate.trained_tokens_per_s == 1000  # the targets among them
    # FLOPs and MFU of every token processed: a masked token costs its forward and backward all the same.
    assert rate.tflops_per_device == pytest.approx(1024 * 1e9 / 1e12)
    assert rate.mfu == pytest.approx(rate.tflops_per_device / 10.0)
    assert metrics.throughput(8192, 8192, 2.0, 4, 1e9, None).mfu is None


def test_memory_on_cpu_is_host_rss_only() -> None:
    alloc, peak, rss = metrics.memory_gib(torch.device("cpu"))
    assert alloc is None and peak is None
    assert rss == pytest.approx(psutil.Process().memory_info().rss / 2**30, rel=0.2)


def test_metrics_file_appends_strict_json(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "run.metrics.jsonl"
    first = metrics.MetricsFile(path)
    first.write({"step": 1, "grad_norm": math.nan, "loss": 2.5})
    assert path.read_text().count("\n") == 1  # on disk at once (tailed live), the file still open
    first.close()
    second = metrics.MetricsFile(path)  # a resumed run's
    second.write({"step": 2, "loss": math.inf})
    second.close()
    second.close()  # idempotent
    second.write({"step": 3})  # after close: opened again
    records = [json.loads(line) for line in path.read_text().splitlines()]  # strict: no NaN tokens
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["grad_norm"] is None and records[0]["loss"] == 2.5 and records[1]["loss"] is None
    assert all(isinstance(r["time"], float) for r in records)
    second.close()
    metrics.MetricsFile(None).write({"step": 4})  # off: writes nothing, no error
