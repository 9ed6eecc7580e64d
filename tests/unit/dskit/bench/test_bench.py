"""`dskit bench` on CPU: the tiny preset through the kit's real training path (DeepSpeed in this process) and the
plain PyTorch reference, printed as a table and written as JSON. Not a timing test: it checks that every row
ran, trained and measured something sane."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from dskit import bench, cli
from model_utils.model import kernels
from support.pretrained import tiny_model

CONFIGS = ["deepspeed/ds_config.json", "deepspeed/ds_config_gpu.json"]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU defaults (tiny preset); test_bench_on_gpu is the GPU run"
)
def test_bench_prints_and_writes_both_rows(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the packed-data cache (.cache/data) lands here, not in the checkout
    out = tmp_path / "bench.json"
    vary = [
        "--vary",
        "zero_optimization.overlap_comm=false",
        "--vary",
        "micro_batch_size=2",
        "--vary",
        "backend=fsdp",
    ]
    assert cli.main(["bench", "--deepspeed_config", *CONFIGS, *vary, "--json", str(out)]) == 0
    printed = capsys.readouterr().out

    table = printed[printed.index("variant") :].splitlines()
    assert "tokens/s" in table[0] and "vs reference" in table[0] and "launch->1st step s" in table[0]
    assert table[1].startswith("reference: PyTorch") and table[1].rstrip().endswith("1.00x")
    assert table[2].startswith("dskit: ds_config.json, liger auto, compile false")
    assert table[3].startswith("dskit: ds_config_gpu.json")
    assert table[4].startswith("dskit: ds_config.json zero_optimization.overlap_comm=false, liger auto")
    assert (
        table[5].startswith("dskit: ds_config.json micro_batch_size=2, liger auto")
        and " 2 x 1 x 1 x 256 = 512 " in table[5]  # the layout: micro x accumulation x ranks x seq
    )
    assert "mb x accum x ranks x seq = tokens/step" in table[0]
    assert table[6].startswith("dskit: fsdp.json backend=fsdp, liger auto")  # FSDP2 on fsdp's own default

    result = json.loads(out.read_text())
    assert (result["device"], result["model"], result["seq_length"]) == ("cpu", "tiny-qwen3", 256)
    assert result["flops_per_token"] > 0 and result["peak_tflops"] is None
    rows = result["rows"]
    assert [r["kind"] for r in rows] == ["reference", "dskit", "dskit", "dskit", "dskit", "dskit"]
    assert [r["settings"].get("deepspeed_config") for r in rows[1:5]] == [*CONFIGS, CONFIGS[0], CONFIGS[0]]
    assert rows[4]["settings"]["changed"] == {"micro_batch_size": "2"}
    assert rows[5]["settings"]["changed"] == {"backend": "fsdp"}
    # The varied row trained with the first config and that one key changed, as DeepSpeed received it.
    assert rows[3]["settings"]["changed"] == {"zero_optimization.overlap_comm": False}
    base, varied = rows[1]["settings"]["zero_optimization"], rows[3]["settings"]["zero_optimization"]
    assert base["overlap_comm"] is True and varied == {**base, "overlap_comm": False}
    steps = result["warmup_steps"] + result["steps"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 and r["mfu"] is None
        assert r["first_step_s"] >= r["setup_s"] > 0
        assert r["micro_batch_size"] == (2 if r is rows[4] else 1) and len(r["losses"]) == steps
        assert r["layout"] == f"{r['micro_batch_size']} x 1 x 1 x 256 = {256 * r['micro_batch_size']}"
        # Same seed, same random init, same first batch: every row starts near ln(vocab) and learns.
        assert abs(r["losses"][0] - math.log(2048)) < 0.3
        assert r["losses"][-1] < r["losses"][0]
    assert abs(rows[1]["losses"][0] - rows[0]["losses"][0]) < 0.05  # the kit trains what the reference trains
    ratios = [r["vs_reference"] for r in rows]
    assert ratios[0] == 1.0 and all(x > 0 for x in ratios)
    assert ratios[1] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])


def test_bench_measures_the_spike_guard_interleaved_once_its_window_is_full(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--guard_overhead", "--steps", "4", "--seq_length", "32"]) == 0
    out = capsys.readouterr().out
    assert "variant" not in out  # no table: this mode measures the guard alone
    found = re.search(
        r"spike guard: ([\d.]+) ms/step judging, ([\d.]+) ms/step off \(medians of 4 interleaved", out
    )
    assert found and float(found[1]) > 0 and float(found[2]) > 0, out


def test_bench_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--steps", "0"]) == 2
    assert cli.main(["bench", "--stepz", "3"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert (
        errors[0]
        == "error: --steps and --warmup_steps must be at least 1 (the first step compiles and warms up)"
    )
    assert errors[1].startswith("error: unrecognized arguments: --stepz 3") and len(errors) == 2
    assert cli.main(["bench", "--reference", "compiled,jit"]) == 2
    assert cli.main(["bench", "--reference", "eager,eager"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --reference {given!r}: use a comma list of eager and compiled, each once "
        "(e.g. --reference compiled,eager)"
        for given in ("compiled,jit", "eager,eager")
    ]
    assert bench.reference_modes(None, "cuda") == ["compiled"] and bench.reference_modes(None, "cpu") == [
        "eager"
    ]


@pytest.mark.parametrize(
    ("vary", "message"),
    [
        ("overlap_comm", "--vary 'overlap_comm': use KEY=V1,V2 with a dotted DeepSpeed config key"),
        ("zero_optimization..stage=1", "use KEY=V1,V2 with a dotted DeepSpeed config key"),
        ("bf16.enabled.x=1", "'enabled' in deepspeed/ds_config.json is not a section"),
        ("zero_optimization.overlap_comn=false", "DeepSpeed rejects"),
        (
            "train_micro_batch_size_per_gpu=4",
            "--micro_batch_size 1 disagrees with train_micro_batch_size_per_gpu",
        ),
        ("liger=maybe", "--liger 'maybe' is not one of auto, on, off"),
    ],
)
def test_bad_vary_is_one_line_before_any_training(
    vary: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--vary", vary]) == 2
    captured = capsys.readouterr()
    errors = captured.err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], errors
    assert "variant" not in captured.out  # no table: nothing trained


def test_a_row_that_ran_out_of_memory_stays_in_the_table() -> None:
    """On a GPU a row can run out of memory (the reference at a micro batch that fits only with Liger)."""
    from dskit.bench import Row, format_table

    rows = [
        Row("reference", "reference", 16, error="out of memory"),
        Row("dskit", "dskit", 16, tokens_per_s=73_500.0, mfu=0.3, peak_mem_gib=61.0, first_step_s=40.0),
    ]
    table = format_table(rows).splitlines()
    assert "out of memory" in table[1] and table[1].rstrip().endswith("-")
    assert "73,500" in table[2] and "30.0%" in table[2] and "61.00" in table[2]


@pytest.mark.gpu
def test_bench_on_gpu(tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped configs (offload, GPU-only, ZeRO-3 with Liger's fallback) through the kit on a GPU."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    configs = ["deepspeed/ds_config.json", "deepspeed/ds_config_gpu.json", "deepspeed/ds_config_zero3.json"]
    argv = ["bench", "--model", "tiny-qwen3", "--seq_length", "256", "--micro_batch_size", "auto"]
    with kernels.patches_undone(tiny_model()):  # the kit's rows patch transformers' Qwen3 module with Liger
        assert cli.main([*argv, "--steps", "3", "--deepspeed_config", *configs, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["reference", "dskit", "dskit", "dskit"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 and all(map(math.isfinite, r["losses"]))
        assert abs(r["losses"][0] - math.log(2048)) < 0.3
    assert os.environ.get("TORCH_EXTENSIONS_DIR")  # set for DeepSpeed's JIT builds
