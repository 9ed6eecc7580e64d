"""`dskit estimate`: the verdict and the recommendation for given memory sizes (activation checkpointing only
when that makes it fit), the printed table, flags over the DeepSpeed config, and bad input as one line. The memory
model's figures themselves: tests/unit/engines/test_memory.py and each engine's test file.

Models are counted on the meta device: nothing is downloaded, nothing is allocated. There is no GPU here, so GPU
sizes are given with --gpu_memory_gib (and host RAM with --host_memory_gib).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest

from dskit import cli
from dskit import estimate as est
from dskit.estimate import GiB
from model_utils.config.arguments import parse_args
from model_utils.resolve import resolver
from model_utils.resolve.memory_estimate import resolve_layout
from support.estimates import checkpointing_layout, layout

REPO = Path(__file__).resolve().parents[3]


def test_80_gib_fits_qwen3_zero2_without_offload_at_micro_batch_8(shapes) -> None:
    shape = shapes["qwen3-0.6b"]
    cap = est.Capacity(80 * GiB, "--gpu_memory_gib", 512 * GiB, "--host_memory_gib")
    at8 = est.estimate(shape, layout(2, "none", micro_batch_size=8))
    at16 = est.estimate(shape, layout(2, "none", micro_batch_size=16))
    assert est.verdict(at8, cap).startswith("verdict: fits")
    assert est.verdict(at16, cap).startswith("verdict: does not fit")
    rec = est.recommend(shape, at8.layout, cap)
    assert rec.estimate is not None
    assert (rec.estimate.layout.offload, rec.estimate.layout.stage) == ("none", 1)  # fastest, and it fits
    assert rec.estimate.layout.micro_batch_size == 8


@pytest.mark.parametrize(
    ("gpu_gib", "seq_length"), [(80, 2048), (16, 2048), (12, 2048), (8, 512), (6, 512), (24, 8192)]
)
def test_recommendation_is_the_fastest_layout_that_fits(shapes, gpu_gib: int, seq_length: int) -> None:
    shape = shapes["qwen3-0.6b"]
    cap = est.Capacity(gpu_gib * GiB, "--gpu_memory_gib", 512 * GiB, "--host_memory_gib")
    asked = layout(2, "none", micro_batch_size=4, seq_length=seq_length)
    rec = est.recommend(shape, asked, cap)
    # Without offload before offload; within each, activation checkpointing only when nothing fits without it
    # (least recompute first), then the lowest ZeRO stage.
    # ZeRO-1 with offload is left out: no shipped config selects it (ZeRO-2's offload keeps less on the GPU).
    order = [
        (off, ckpt, stage)
        for off in est.OFFLOADS
        for ckpt in ("none", "every_4", "every_2", "full")
        for stage in (1, 2, 3)
        if (off != "optimizer+params" or stage == 3) and (off == "none" or stage > 1)
    ]
    fitting = [
        (off, ckpt, stage)
        for off, ckpt, stage in order
        if est.fits(
            est.estimate(
                shape,
                layout(stage, off, micro_batch_size=1, seq_length=seq_length, activation_checkpointing=ckpt),
            ),
            cap,
        )
    ]
    if not fitting:
        assert rec.estimate is None and rec.reason.startswith("nothing fits")
        return
    assert rec.estimate is not None
    chosen = rec.estimate.layout
    assert (chosen.offload, chosen.activation_checkpointing, chosen.stage) == fitting[0]
    assert est.fits(rec.estimate, cap)
    twice = est.estimate(shape, dataclasses.replace(chosen, micro_batch_size=2 * chosen.micro_batch_size))
    assert chosen.micro_batch_size == est.MAX_MICRO_BATCH or not est.fits(twice, cap)


def test_16_gib_needs_something_else_than_zero2_at_micro_batch_4(shapes) -> None:
    shape = shapes["qwen3-0.6b"]
    cap = est.Capacity(16 * GiB, "--gpu_memory_gib", 512 * GiB, "--host_memory_gib")
    asked = est.estimate(shape, layout(2, "none", micro_batch_size=4))
    assert est.verdict(asked, cap).startswith("verdict: does not fit")
    rec = est.recommend(shape, asked.layout, cap)
    assert rec.estimate is not None and rec.estimate.layout.micro_batch_size < 4
    assert "--gradient_accumulation_steps" in rec.reason


def test_host_ram_limits_the_recommendation(shapes) -> None:
    shape = shapes["qwen3-0.6b"]
    # Eight processes each building the fp32 model need ~27 GiB at start: 24 GiB of host RAM is too little.
    cap = est.Capacity(80 * GiB, "--gpu_memory_gib", 24 * GiB, "--host_memory_gib")
    rec = est.recommend(shape, layout(2, "none"), cap)
    assert rec.estimate is None
    assert "host RAM per node" in rec.reason and "more RAM or fewer GPUs per node" in rec.reason
    assert "verdict: does not fit" in est.verdict(est.estimate(shape, layout(2, "none")), cap)


def test_tight_is_between_the_headroom_and_the_capacity(shapes) -> None:
    e = est.estimate(shapes["tiny-qwen3"], layout(2, "none", seq_length=256))
    host = 1024 * GiB
    assert "verdict: tight" in est.verdict(
        e, est.Capacity(int(e.device_bytes_per_rank / 0.95), "x", host, "y")
    )
    assert "verdict: fits" in est.verdict(
        e, est.Capacity(int(e.device_bytes_per_rank / 0.85), "x", host, "y")
    )


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["estimate", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_command_prints_table_verdict_and_recommendation(capsys) -> None:
    rc, out, err = run_cli(
        capsys, "--nodes", "2", "--gpus_per_node", "8", "--gpu_memory_gib", "80", "--host_memory_gib", "64"
    )
    assert rc == 0, err
    # Defaults: the tiny preset with its 256 positions, the stage and offload of deepspeed/ds_config.json, and
    # Liger (auto: qwen3 is a model type Liger supports).
    zero = json.loads((REPO / "deepspeed" / "ds_config.json").read_text())["zero_optimization"]
    offloaded = zero.get("offload_optimizer", {}).get("device") == "cpu"
    header = out.splitlines()[1]
    assert header.startswith(f"2 nodes x 8 GPUs, ZeRO-{zero['stage']}, ")
    assert ("optimizer offloaded to CPU" in header) == offloaded
    assert "micro batch 1 x 256 tokens, bf16, Liger kernels" in header
    assert out.startswith("tiny-qwen3: 0.23M parameters")
    for label in ("parameters", "gradients", "optimizer states", "activations", "logits + loss", "buffers"):
        assert re.search(rf"^  {re.escape(label)} +\d+\.\d\d  ", out, re.M), label
    totals = re.findall(r"^  total +(\d+\.\d\d)", out, re.M)
    assert len(totals) == 2  # per GPU and per node
    lines = out.strip().splitlines()
    assert lines[-3].startswith("verdict: fits")
    assert lines[-2].startswith("recommend: ZeRO-1, no offload, micro batch 64 — the fastest")
    assert (
        lines[-1] == "train it with: --deepspeed_config deepspeed/ds_config_zero1.json --micro_batch_size 64"
    )


def test_a_preference_objective_counts_two_sequences_a_pair_and_never_splits_them(capsys) -> None:
    """--objective dpo: micro batch 4 is 4 pairs, 8 sequences in one forward, whose logits stay whole (no Liger
    fused loss); what fits is said in pairs, and no --sequence_parallel is recommended (pairs are not split)."""
    machine = [
        "--gpus_per_node",
        "8",
        "--gpu_memory_gib",
        "4",
        "--host_memory_gib",
        "64",
        "--seq_length",
        "256",
    ]
    rc, out, err = run_cli(capsys, *machine, "--micro_batch_size", "4", "--objective", "dpo")
    assert rc == 0, err
    assert "micro batch 4 pairs x 2 sequences x 256 tokens" in out.splitlines()[1]
    assert re.search(r"^  logits \+ loss +\d+\.\d\d  4 pairs x 2 x 256 tokens x 2048 vocab", out, re.M), out
    assert out.strip().splitlines()[-1].startswith("train it with:"), out
    _, rows, _ = run_cli(capsys, *machine, "--micro_batch_size", "8", "--liger", "off")
    _, pairs, _ = run_cli(
        capsys, *machine, "--micro_batch_size", "4", "--liger", "off", "--objective", "simpo"
    )
    activations = re.compile(r"^  activations +(\d+\.\d\d)", re.M)
    assert activations.search(rows).group(1) == activations.search(pairs).group(1)


def test_the_recommendation_never_splits_preference_pairs_across_ranks(shapes) -> None:
    lay = layout(2, "none", seq_length=32768, ranks_per_node=8)
    assert est.sequence_parallel_sizes(shapes["qwen3-0.6b"], lay)[:3] == [1, 2, 4]
    assert est.sequence_parallel_sizes(shapes["qwen3-0.6b"], dataclasses.replace(lay, pairs=True)) == [1]


def test_flags_override_the_deepspeed_config(capsys) -> None:
    rc, out, _ = run_cli(
        capsys, "--deepspeed_config", "deepspeed/ds_config_zero3.json", "--gpu_memory_gib", "80"
    )
    assert rc == 0 and "ZeRO-3, optimizer offloaded to CPU (pinned)" in out
    rc, out, _ = run_cli(
        capsys, "--zero_stage", "3", "--offload", "optimizer+params", "--micro_batch_size", "2"
    )
    assert rc == 0 and "ZeRO-3, optimizer and parameters offloaded to CPU (pinned), micro batch 2" in out


def test_verdict_against_this_machine(capsys) -> None:
    import psutil
    import torch

    if torch.cuda.is_available():
        pytest.skip("judges this machine's GPU instead")
    rc, out, _ = run_cli(capsys)
    assert rc == 0
    assert "no GPU on this machine: pass --gpu_memory_gib" in out
    assert f"of {psutil.virtual_memory().total / GiB:.2f} GiB" in out and "this machine) " in out
    assert "recommend: pass --gpu_memory_gib" in out


def test_an_instance_type_gives_its_gpus_their_memory_and_its_ram(capsys) -> None:
    """--instance_type p5.48xlarge: 8 H100s of 80 GB per node and 2 TiB of RAM, never this machine's; the GPU's
    peak for the forecast too. Sizes given as flags still win."""
    rc, out, err = run_cli(
        capsys, "--model", "qwen3-0.6b", "--nodes", "2", "--instance_type", "p5.48xlarge", "--tokens", "2e10",
        "--mfu", "0.4",
    )  # fmt: skip
    assert rc == 0, err
    assert out.splitlines()[1].startswith("2 nodes x 8 GPUs, ")
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: "))
    assert re.fullmatch(
        r"verdict: fits — GPU [\d.]+ of 79\.65 GiB \(\d+%, p5\.48xlarge's NVIDIA H100 80GB HBM3\) fits; "
        r"host RAM [\d.]+ of 2048\.00 GiB \(\d+%, p5\.48xlarge\) fits",
        verdict,
    ), verdict
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("forecast: 2e+10 tokens at MFU 40.0% of 989 TFLOP/s x 16 GPUs")
    )
    rc, out, _ = run_cli(
        capsys, "--instance_type", "p5.48xlarge", "--gpus_per_node", "4", "--gpu_memory_gib", "40",
        "--host_memory_gib", "512",
    )  # fmt: skip
    assert rc == 0 and out.splitlines()[1].startswith("1 node x 4 GPUs, ")
    assert "of 40.00 GiB (" in out and "--gpu_memory_gib) " in out and "of 512.00 GiB (" in out


def test_an_instance_type_the_kit_does_not_know_is_not_judged_by_this_machine(capsys) -> None:
    rc, out, _ = run_cli(capsys, "--instance_type", "g5.xlarge", "--gpus_per_node", "1")
    assert rc == 0
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: unknown") and "this machine" not in verdict, verdict
    assert "(no g5.xlarge in the kit's instance table: pass --gpu_memory_gib)" in verdict
    assert "(no g5.xlarge in the kit's instance table: pass --host_memory_gib)" in verdict


def test_the_instance_table_has_the_types_whose_gpus_the_health_gate_knows() -> None:
    """One owner per fact: the GPU count of a type is the health gate's, its memory this table's."""
    from model_utils.launch import health_gate

    assert set(est.INSTANCE_MEMORY) == set(health_gate.THRESHOLDS)
    assert est.instance("p5en.48xlarge") == est.Instance(
        "p5en.48xlarge", 8, "NVIDIA H200", 143771 * 2**20, 2048 * GiB
    )


def write_ds(tmp_path: Path, zero: dict) -> str:
    ds = json.loads((REPO / "deepspeed" / "ds_config.json").read_text())
    ds["zero_optimization"] = zero
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


BAD = {
    "stage 4": (["--zero_stage", "4"], "--zero_stage 4 is not a ZeRO stage: use 0, 1, 2 or 3"),
    "params offload at stage 2": (
        ["--zero_stage", "2", "--offload", "optimizer+params"],
        "parameter offload (--offload optimizer+params, or offload_param in the DeepSpeed config) needs ZeRO "
        "stage 3, not 2",
    ),
    "offload without ZeRO": (["--zero_stage", "0", "--offload", "optimizer"], "optimizer offload needs ZeRO"),
    "no nodes": (["--nodes", "0"], "--nodes 0 must be at least 1"),
    "no GPUs": (["--gpus_per_node", "0"], "--gpus_per_node 0 must be at least 1"),
    "no GPU memory": (["--gpu_memory_gib", "0"], "--gpu_memory_gib 0.0 must be positive"),
    "no micro batch": (["--micro_batch_size", "0"], "--micro_batch_size 0 must be at least 1"),
    "sequence too long": (
        ["--seq_length", "4096"],
        "--seq_length 4096 is above the model's maximum positions",
    ),
    "unknown model": (["--model", "tiny-qwen4"], "unknown model 'tiny-qwen4'"),
    "unknown offload": (["--offload", "params"], "argument --offload: invalid choice: 'params'"),
    "abbreviated flag": (["--node", "2"], "unrecognized arguments: --node 2"),
    "missing DeepSpeed config": (["--deepspeed_config", "nope.json"], "DeepSpeed config nope.json not found"),
    "unknown liger": (["--liger", "yes"], "argument --liger: invalid choice: 'yes'"),
    "more GPUs than the instance": (
        ["--instance_type", "p5.48xlarge", "--gpus_per_node", "16"],
        "--gpus_per_node 16: a p5.48xlarge has 8 GPUs: give at most 8, or leave it out (all of them)",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line(capsys, case: str) -> None:
    args, message = BAD[case]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert message in err


def test_bad_deepspeed_offload_sections_are_one_line(capsys, tmp_path: Path) -> None:
    nvme = write_ds(tmp_path, {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}})
    rc, _, err = run_cli(capsys, "--deepspeed_config", nvme)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "zero_optimization.offload_optimizer.device 'nvme'" in err and "not modelled" in err
    params_at_2 = write_ds(tmp_path, {"stage": 2, "offload_param": {"device": "cpu"}})
    rc, _, err = run_cli(capsys, "--deepspeed_config", params_at_2)
    assert rc == 2 and "needs ZeRO stage 3, not 2" in err


def test_fsdp_from_the_command_line_and_zero_flags_refused(capsys) -> None:
    rc, out, err = run_cli(capsys, "--backend", "fsdp", "--gpus_per_node", "8", "--gpu_memory_gib", "80")
    assert rc == 0, err
    assert "1 node x 8 GPUs, FSDP2, no offload, micro batch 1 x 256 tokens, bf16" in out.splitlines()[1]
    assert out.strip().splitlines()[-2].startswith("recommend: FSDP2, no offload, micro batch 64")
    assert out.strip().splitlines()[-1] == "train it with: --backend fsdp --micro_batch_size 64"
    rc, out, err = run_cli(capsys, "--backend", "fsdp", "--zero_stage", "2")
    assert rc == 2 and "--zero_stage is DeepSpeed's ZeRO: under --backend fsdp use --fsdp_cpu_offload" in err


def test_recommendation_adds_checkpointing_only_when_that_makes_it_fit(shapes, capsys) -> None:
    shape = shapes["qwen3-0.6b"]
    cap = est.Capacity(24 * GiB, "--gpu_memory_gib", 512 * GiB, "--host_memory_gib")
    # seq 2048 fits without it: nothing is recomputed.
    rec = est.recommend(shape, checkpointing_layout(micro_batch_size=4), cap)
    assert rec.estimate is not None and rec.estimate.layout.activation_checkpointing == "none"
    # seq 8192 (eager loss): not even ZeRO-3 with everything offloaded fits at micro batch 1 without it;
    # ZeRO-1 with full checkpointing does, before any offload.
    at_8k = checkpointing_layout(micro_batch_size=4, seq_length=8192)
    without = [
        est.estimate(shape, dataclasses.replace(at_8k, stage=s, micro_batch_size=1, **off))
        for s, off in [(1, {}), (3, {"offload_optimizer": True, "offload_params": True})]
    ]
    assert not any(est.fits(e, cap) for e in without)
    rec = est.recommend(shape, at_8k, cap)
    assert rec.estimate is not None
    chosen = rec.estimate.layout
    assert (chosen.stage, chosen.offload, chosen.activation_checkpointing) == (1, "none", "full")
    assert (
        "activation checkpointing full is what makes it fit (without it ZeRO-1 with no offload needs"
        in rec.reason
    )
    assert chosen.describe_recommended().endswith(", --activation_checkpointing full")
    # The command says so too.
    argv = [
        "estimate",
        "--model",
        "qwen3-0.6b",
        "--seq_length",
        "8192",
        "--liger",
        "off",
        "--zero_stage",
        "2",
    ]
    assert (
        cli.main([*argv, "--gpus_per_node", "8", "--gpu_memory_gib", "24", "--host_memory_gib", "512"]) == 0
    )
    out = capsys.readouterr().out
    assert "recommend: ZeRO-1, no offload, micro batch 1, --activation_checkpointing full — " in out
    assert cli.main([*argv, "--activation_checkpointing", "every_2", "--gpu_memory_gib", "24"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.endswith("eager (no Liger), activation checkpointing every_2")


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_every_layout_it_can_recommend_is_selected_by_the_flags_it_prints(shapes, backend: str) -> None:
    """Each layout the recommendation tries comes with flags that exist: training's parser takes them and the
    resolved run has that layout (stage, offload, micro batch, checkpointing); no other layout is ever tried."""
    asked = dataclasses.replace(
        layout(2, "none", seq_length=256), stage=0 if backend == "fsdp" else 2, backend=backend
    )
    tried = est.candidates(asked, shapes["tiny-qwen3"].num_layers)
    wanted = {"deepspeed": 6, "fsdp": 2}[
        backend
    ]  # 3 without offload, 2 with the optimizer's, ZeRO-3 with both
    assert len({(lay.stage, lay.offload) for lay, _ in tried}) == wanted
    for lay, flags in tried:
        chosen = dataclasses.replace(lay, micro_batch_size=4)
        rec_flags = [
            *flags,
            "--micro_batch_size",
            "4",
            "--activation_checkpointing",
            lay.activation_checkpointing,
        ]
        settings = resolver.resolve_settings(parse_args([*rec_flags, "--seq_length", "256"]))
        _, resolved = resolve_layout(settings, asked.nodes, asked.ranks_per_node, None, None)
        assert (resolved.backend, resolved.stage, resolved.offload) == (
            backend,
            chosen.stage,
            chosen.offload,
        ), flags
        assert (resolved.micro_batch_size, resolved.activation_checkpointing) == (
            4,
            lay.activation_checkpointing,
        )


def test_the_printed_selection_is_a_command_line_dskit_config_resolves(capsys) -> None:
    """What `dskit estimate` prints after `train it with:` runs as given: `dskit config` resolves it to that
    layout (here ZeRO-3 without offload, for a 0.6B model on 4 GiB GPUs at seq 512, 64 of them)."""
    rc, out, err = run_cli(
        capsys, "--model", "qwen3-0.6b", "--seq_length", "512", "--nodes", "8", "--gpus_per_node", "8",
        "--gpu_memory_gib", "4", "--host_memory_gib", "512",
    )  # fmt: skip
    assert rc == 0, err
    recommended, selection = out.strip().splitlines()[-2:]
    assert recommended.startswith("recommend: ZeRO-3, no offload, micro batch "), recommended
    flags = shlex.split(selection.removeprefix("train it with: "))
    assert flags[:2] == ["--deepspeed_config", "deepspeed/ds_config_zero3_gpu.json"]
    # The flags select the layout whatever the model (the tiny default here: no tokenizer to fetch).
    assert cli.main(["config", *flags]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["deepspeed"]["zero_optimization"]["stage"] == 3
    assert "offload_optimizer" not in printed["deepspeed"]["zero_optimization"]


# --- the forecast: time and cost of a planned run -----------------------------------------------------------


def test_the_forecast_is_the_tokens_flops_at_the_expected_mfu_priced_per_node_hour() -> None:
    from dskit import cost

    price = cost.Price(55.04, "table")
    # 1e9 FLOPs per token on 16 GPUs at 50% of 1000 TFLOP/s: 8e6 tokens/s; 2.88e11 tokens take 10 h.
    f = est.forecast(1e9, 2.88e11, gpus=16, nodes=2, mfu=0.5, peak_tflops=1000, price=price)
    assert f.tokens_per_s == pytest.approx(8e6) and f.hours == pytest.approx(10.0)
    assert f.node_hours == pytest.approx(20.0) and f.cost == pytest.approx(20 * 55.04)
    assert est.forecast(1e9, 2.88e11, gpus=16, nodes=2, mfu=0.5, peak_tflops=1000, price=None).cost is None


def test_the_command_forecasts_from_a_measured_bench(capsys, tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"peak_tflops": 989.0, "rows": [
        {"kind": "reference", "mfu": 0.5}, {"kind": "dskit", "mfu": 0.31}, {"kind": "dskit", "mfu": 0.38},
        {"kind": "dskit", "mfu": None},
    ]}))  # fmt: skip
    rc, out, err = run_cli(
        capsys, "--model", "qwen3-0.6b", "--nodes", "2", "--gpus_per_node", "8", "--gpu_memory_gib", "80",
        "--host_memory_gib", "1000", "--tokens", "2e10", "--mfu", str(bench), "--instance_type", "p5.48xlarge",
    )  # fmt: skip
    assert rc == 0, err
    line = out.strip().splitlines()[-1]
    # The best dskit row's MFU (not the reference's), the bench's peak, p5's table price.
    assert line.startswith("forecast: 2e+10 tokens at MFU 38.0% of 989 TFLOP/s x 16 GPUs ("), line
    hours = float(re.search(r": ([\d.]+) h of training", line)[1])
    node_hours = float(re.search(r", ([\d.]+) node-hours", line)[1])
    assert node_hours == pytest.approx(2 * hours, abs=0.1)
    money = float(
        re.search(r"= \$([\d,]+) at \$55.04/h \(on-demand us-east-1 prices of", line)[1].replace(",", "")
    )
    assert money == pytest.approx(node_hours * 55.04, rel=0.02)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens", "1e9"], "a forecast needs --mfu"),
        (["--mfu", "0.4"], "--tokens must be a positive number"),
        (["--tokens", "1e9", "--mfu", "40"], "--mfu 40 must be a fraction in"),
        (["--tokens", "1e9", "--mfu", "0.4"], "a forecast needs the GPU's peak: --peak_tflops"),
        (["--tokens", "1e9", "--mfu", "missing.json"], "--mfu missing.json: cannot read it as a bench JSON"),
    ],
)
def test_bad_forecast_flags_are_one_line_before_any_model_loads(capsys, flags, message) -> None:
    rc, _, err = run_cli(capsys, "--model", "/no/such/model", *flags)
    assert rc == 2 and message in err, err  # the model path is never reached


def test_a_cpu_bench_has_no_mfu_to_forecast_from(capsys, tmp_path: Path) -> None:
    bench = tmp_path / "cpu.json"
    bench.write_text(json.dumps({"peak_tflops": None, "rows": [{"kind": "dskit", "mfu": None}]}))
    rc, _, err = run_cli(capsys, "--tokens", "1e9", "--mfu", str(bench))
    assert rc == 2 and "no dskit row with a measured MFU" in err


def test_sequence_parallelism_is_recommended_at_the_fewest_gpus_per_sequence_that_fit(shapes, capsys) -> None:
    """Qwen3-0.6B at 32k tokens on 8 GPUs of 24 GiB: nothing fits on one GPU a sequence (even everything offloaded,
    fully checkpointed), nor on 2; on 4 ZeRO-1 with full checkpointing does. A rank keeps 1/N of the activations
    and logits."""
    shape = shapes["qwen3-0.6b"]
    cap = est.Capacity(24 * GiB, "--gpu_memory_gib", 512 * GiB, "--host_memory_gib")
    at_32k = checkpointing_layout(seq_length=32768)
    for n in (1, 2):
        slowest = dataclasses.replace(
            at_32k, stage=3, offload_optimizer=True, offload_params=True, activation_checkpointing="full"
        )
        assert not est.fits(est.estimate(shape, dataclasses.replace(slowest, sequence_parallel=n)), cap)
    rec = est.recommend(shape, at_32k, cap)
    assert rec.estimate is not None
    chosen = rec.estimate.layout
    assert (chosen.sequence_parallel, chosen.stage, chosen.activation_checkpointing) == (4, 1, "full")
    assert (
        rec.flags[-2:] == ("--sequence_parallel", "4")
        and "groups of 4 GPUs share each sequence" in rec.reason
    )
    one, two = (est.estimate(shape, dataclasses.replace(at_32k, sequence_parallel=n)) for n in (1, 2))
    assert (two.activations, two.logits) == (one.activations // 2, one.logits // 2)
    assert est.sequence_parallel_sizes(shape, at_32k) == [1, 2, 4, 8]  # 16 heads, 8 key/value heads, 8 GPUs
    fsdp = dataclasses.replace(at_32k, stage=0, backend="fsdp")
    rec = est.recommend(shape, fsdp, cap)  # FSDP2 shares sequences the same way
    assert rec.estimate is not None and rec.flags[-2:] == ("--sequence_parallel", "4"), rec.flags
    argv = ["estimate", "--model", "qwen3-0.6b", "--seq_length", "32768", "--gpus_per_node", "8"]
    assert cli.main([*argv, "--gpu_memory_gib", "24", "--host_memory_gib", "512", "--liger", "off"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].endswith("--activation_checkpointing full --sequence_parallel 4"), out
    assert cli.main([*argv, "--sequence_parallel", "3"]) == 2
    assert "--sequence_parallel 3 does not divide the 8 ranks into groups" in capsys.readouterr().err
