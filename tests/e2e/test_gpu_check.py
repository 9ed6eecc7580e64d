"""`dskit gpu-check`'s CPU subset run for real: the gpu tests (they skip: "not run", not pass), dskit bench's rows,
and the JSON and markdown it writes. Its launcher step: test_gpu_check_launcher.py; its verdicts, step selection
and time limits: tests/unit/dskit/bench/test_gpu_check.py."""

from __future__ import annotations

import importlib.metadata
import json
import re
import socket
from pathlib import Path

import pytest
import torch

from dskit import cli
from dskit.bench import gpu_check
from support.torchrun import REPO

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU subset; on a GPU `make gpu-check` is the run")
def test_cpu_subset_runs_the_gpu_tests_and_bench_and_writes_json_and_markdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)  # the checkout: tests/ and deepspeed/ (bench's data cache: .cache/data, ignored)
    out = tmp_path / "out"
    # This process's own rendezvous (an in-process run's group, its port still held) is not the steps' business.
    held = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
    with held:
        assert cli.main(["gpu-check", "--only", "bench,pytest", "--out_dir", str(out)]) == 0
    printed = capsys.readouterr().out

    (report_file,) = out.glob("gpu-check-*.json")
    report = json.loads(report_file.read_text())
    assert (report["device"], report["steps"], report["failed"]) == ("cpu", ["pytest", "bench"], False)
    assert set(report["versions"]) == {"python", "cuda", "torch", "deepspeed", "transformers", "liger-kernel"}
    assert report["versions"]["torch"] == importlib.metadata.version("torch")
    checks = {c["name"]: c for c in report["checks"]}
    # Without a GPU the gpu tests ran as a real pytest run and skipped: not counted as a pass.
    gpu = checks["pytest -m gpu"]
    assert gpu["status"] == "not run" and re.fullmatch(r"no GPU: the \d+ gpu tests skipped", gpu["reason"])
    assert 0 < gpu["seconds"] <= gpu["limit_s"] == gpu_check.LIMITS["cpu"]["pytest"]
    assert checks["bench"]["status"] == "pass" and checks["bench"]["reason"] == "3 rows"
    assert not any(name.startswith(("ops", "launcher")) for name in checks)  # not selected

    bench = report["bench"]
    assert (bench["model"], bench["seq_length"], bench["steps"]) == ("tiny-qwen3", 64, 2)
    rows = bench["rows"]
    assert [(r["kind"], r["settings"].get("deepspeed_config")) for r in rows] == [
        ("reference", None),
        ("dskit", gpu_check.GPU_CONFIG),
        ("dskit", gpu_check.OFFLOAD_CONFIG),
    ]
    assert rows[0]["settings"]["compile"] is False and rows[0]["vs_reference"] == 1.0
    for r in rows:
        assert checks[f"bench: {r['name']}"]["status"] == "pass"
        assert r["tokens_per_s"] > 0 and r["first_step_s"] > 0 and r["peak_mem_gib"] > 0
    assert (
        rows[2]["layout"] == "1 x 1 x 1 x 64 = 64"
    )  # bench's: micro batch x accumulation x ranks x sequence
    assert gpu_check.layout(rows[2]) == "1 x 1 x 1 x 64 = 64, ZeRO-2, optimizer offloaded to cpu"

    markdown = (out / report_file.name.replace(".json", ".md")).read_text()
    assert markdown in printed  # the table printed at the end is the file
    assert "| config | layout | tokens/s | MFU | peak GiB | first step s | vs reference |" in markdown
    assert (
        "| reference: PyTorch, AdamW, bf16 autocast, eager | 1 x 1 x 1 x 64 = 64, one device, no ZeRO |"
        in markdown
    )
    assert "| ds_config_gpu.json" not in markdown and "ZeRO-2, no offload |" in markdown
    assert re.search(r"^\| pytest -m gpu \| NOT RUN \| \d+ / 120 \| no GPU", markdown, re.M)
    assert markdown.rstrip().endswith("PASSED: 0 of 5 checks failed")
    assert {p.name.split(".", 1)[1] for p in out.iterdir()} == {"json", "md", "pytest.log", "bench.log"}
