"""`dskit bench` for real: the tiny preset through the kit's training path (DeepSpeed engines in this process)
against the plain PyTorch reference, the spike guard's cost, the shipped configs on a GPU (marked gpu), and
`dskit bench --data` preparing data with real child processes. Not timing tests: every row ran, trained and
measured something sane. The command's input checks and tables: tests/unit/dskit/bench/."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from dskit import cli
from model_utils.compat import liger_internals
from model_utils.observe import metrics
from support.pretrained import tiny_model

pytestmark = pytest.mark.e2e


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
    captured = capsys.readouterr()
    printed = captured.out
    assert "Saved checkpoint" not in printed + captured.err  # no row reaches its run's last step, which saves

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
    assert (result["device"], result["model"], result["seq_length"], result["complete"]) == (
        "cpu",
        "tiny-qwen3",
        256,
        True,
    )
    assert "bench row 6 of 6: dskit: fsdp.json backend=fsdp, liger auto" in printed  # a line as each row ends
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
    argv = ["bench", "--guard_overhead", "--spike_window", "8", "--steps", "4", "--seq_length", "32"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "variant" not in out  # no table: this mode measures the guard alone
    found = re.search(
        r"spike guard: ([\d.]+) ms/step judging, ([\d.]+) ms/step off \(medians of 4 interleaved", out
    )
    assert found and float(found[1]) > 0 and float(found[2]) > 0, out


@pytest.mark.gpu
def test_bench_on_gpu(tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped configs (offload, GPU-only, ZeRO-3 with Liger's fallback) through the kit on a GPU."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    configs = ["deepspeed/ds_config.json", "deepspeed/ds_config_gpu.json", "deepspeed/ds_config_zero3.json"]
    argv = ["bench", "--model", "tiny-qwen3", "--seq_length", "256", "--micro_batch_size", "auto"]
    with liger_internals.patches_undone(
        tiny_model()
    ):  # the kit's rows patch transformers' Qwen3 module with Liger
        assert cli.main([*argv, "--steps", "3", "--deepspeed_config", *configs, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["reference", "dskit", "dskit", "dskit"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 and all(map(math.isfinite, r["losses"]))
        assert abs(r["losses"][0] - math.log(2048)) < 0.3
    assert os.environ.get("TORCH_EXTENSIONS_DIR")  # set for DeepSpeed's JIT builds


TABLE_FIELDS = (
    "procs",
    "units",
    "wall s",
    "tokenize s",
    "tokens/s",
    "tokens/s/proc",
    "CPU s",
    "tokens/CPU s",
)
TABLE_FIELDS += ("speed-up",)
TABLE_FIELDS += ("peak RSS tree GiB", "peak RSS proc GiB", "disk MB", "shards")


def _metrics_file(path: Path) -> None:
    """What a 2-rank run writes: a start event, then one record per logged interval (the first one slow)."""
    file = metrics.MetricsFile(path)
    file.write({"event": "start", "step": 0, "world_size": 2, "max_steps": 40})
    for step, rate in ((10, 100.0), (20, 1000.0), (30, 1200.0), (40, 800.0)):
        file.write(
            {"step": step, "tokens_per_s": 2 * rate, "tokens_per_s_per_device": rate, "step_time_s": 0.5}
        )


def test_data_bench_prepares_reads_and_compares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _metrics_file(tmp_path / "run.metrics.jsonl")
    out, work = tmp_path / "data.json", tmp_path / "work"
    argv = ["bench", "--data", "embedded", "--procs", "1,2", "--unit_mb", "1", "--read_steps", "20"]
    argv += ["--metrics", str(tmp_path / "run.metrics.jsonl"), "--json", str(out), "--work_dir", str(work)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out

    table = printed[printed.index("procs  ") :].splitlines()
    assert all(name in table[0] for name in TABLE_FIELDS)
    assert table[1].split()[0] == "1" and table[2].split()[0] == "2"
    assert "shards: identical at 1, 2 processes" in printed
    assert "read path" in printed and "blocks/s" in printed
    assert "trainer's need: 1,000 tokens/s per rank" in printed and "world size 2" in printed
    assert list(work.iterdir()) == []  # the preparations are deleted

    result = json.loads(out.read_text())
    assert result["source"] == "embedded" and result["tokenizer"] == "tiny-qwen3" and result["units"] == 3
    runs = result["runs"]
    assert [r["procs"] for r in runs] == [1, 2]
    # The same stream at every process count: the same tokens and the same shard checksums.
    assert runs[0]["tokens"] == runs[1]["tokens"] > 0 and runs[0]["documents"] == runs[1]["documents"] > 0
    assert runs[0]["shards_digest"] == runs[1]["shards_digest"] and result["shards_identical"] is True
    for r in runs:
        assert r["wall_s"] > r["tokenize_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["tokenize_s"])
        assert r["tokens_per_s_wall"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["tokens_per_s_per_proc"] == pytest.approx(r["tokens_per_s"] / min(r["procs"], r["units"]))
        assert r["peak_rss_tree_gib"] >= r["peak_rss_process_gib"] > 0 and r["rss_samples"] >= 1
        assert r["disk_mb"] * 2**20 >= 2 * r["tokens"]  # uint16 tokens (a 2048-token vocabulary), plus JSON
        # Per core: the CPU of the command and its workers, less what they had used when the plan was written.
        assert r["cpu_s"] > r["startup_cpu_s"] > 0
        assert r["tokens_per_cpu_s"] == pytest.approx(r["tokens"] / (r["cpu_s"] - r["startup_cpu_s"]))
    assert runs[0]["speedup"] == 1.0
    assert runs[1]["speedup"] == pytest.approx(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"])

    read = result["read"]
    assert (read["seq_length"], read["micro_batch_size"], read["steps"]) == (2048, 8, 20)
    assert 0 < read["blocks"] <= runs[0]["tokens"] // 2048  # the train split's blocks
    assert read["blocks_per_s"] == pytest.approx(20 * 8 / read["seconds"])
    assert read["tokens_per_s"] == pytest.approx(read["blocks_per_s"] * 2048)
    need = result["need"]
    # The median of the intervals after the first (which holds the warm-up), per rank.
    assert (need["tokens_per_s_per_rank"], need["world_size"], need["intervals"]) == (1000.0, 2, 3)
    assert need["step_time_s"] == 0.5
    assert result["headroom"] == pytest.approx(read["tokens_per_s"] / 1000.0)


def test_bench_measures_document_packing_against_the_stream_interleaved(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--packing_overhead", "--steps", "3", "--seq_length", "32"]) == 0
    out = capsys.readouterr().out
    assert "variant" not in out  # no table: this mode compares the two packings alone
    found = re.search(
        r"packing: ([\d.]+) ms/step documents, ([\d.]+) ms/step stream \(medians of 3 interleaved steps each\): "
        r"[-+][\d.]+%",
        out,
    )
    assert found and float(found[1]) > 0 and float(found[2]) > 0, out


def test_bench_measures_dpo_against_the_next_token_loss_on_the_same_pairs(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--preference_overhead: DPO's step and the next-token loss's on the same batches of synthetic pairs,
    interleaved, and the reference pass against a step (what a GPU session measures on Qwen3-0.6B)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--preference_overhead", "--steps", "3", "--seq_length", "32"]) == 0
    out = capsys.readouterr().out
    found = re.search(
        r"preference: ([\d.]+) ms/step DPO, ([\d.]+) ms/step the next-token loss on the same 1 pairs a step "
        r"\(2 x 32 tokens each; medians of 3 interleaved steps each\): [-+][\d.]+%; the reference pass ([\d.]+) s for "
        r"7 pairs",
        out,
    )
    assert found and all(float(found[i]) > 0 for i in (1, 2, 3)), out
    assert "Reference: the DPO reference log-probabilities of 7 train pairs computed" in out
