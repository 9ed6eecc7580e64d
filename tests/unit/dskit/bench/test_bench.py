"""`dskit bench`'s input checks (bad flags and --vary as one line before any training) and its table (a row that
ran out of memory stays in it). The bench training for real, on CPU and on a GPU: tests/e2e/test_bench.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from dskit import bench, cli


def test_bench_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--steps", "0"]) == 2
    assert cli.main(["bench", "--stepz", "3"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert (
        errors[0]
        == "error: --steps and --warmup_steps must be at least 1 (the first step compiles and warms up)"
    )
    assert errors[1].startswith("error: unrecognized arguments: --stepz 3") and len(errors) == 2
    assert cli.main(["bench", "--spike_window", "8"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --spike_window sets the guard's window for --guard_overhead: add that, or drop it"
    ]
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


def test_the_guard_overhead_run_judges_from_the_windows_filling_not_after_the_guards_warm_up(
    tmp_path: Path,
) -> None:
    """`--guard_overhead` trains the window's steps, then alternates the guard off and on: every step it times
    must be judged, so the run turns the guard's warm-up (longer than the window by default) off."""
    from model_utils.config.arguments import parse_args

    ns = bench.build_parser().parse_args(["--guard_overhead", "--steps", "3", "--warmup_steps", "1"])
    cfg = parse_args(bench._training_flags(ns, bench.CPU_MODEL, bench.DEFAULT_CONFIG, str(tmp_path)))
    assert (
        cfg.guard.spike_warmup_steps == 0
        and cfg.loop.max_steps
        == bench.GUARD_WINDOW + ns.warmup_steps + 2 * ns.steps + 1  # never its last: no save
    )
    small = bench.build_parser().parse_args(
        ["--guard_overhead", "--spike_window", "8", "--steps", "3", "--warmup_steps", "1"]
    )
    cfg = parse_args(bench._training_flags(small, bench.CPU_MODEL, bench.DEFAULT_CONFIG, str(tmp_path)))
    assert cfg.guard.spike_window == 8 and cfg.loop.max_steps == 8 + small.warmup_steps + 2 * 3 + 1
    plain = parse_args(
        bench._training_flags(
            bench.build_parser().parse_args(["--steps", "3", "--warmup_steps", "1"]),
            bench.CPU_MODEL,
            "x",
            "y",
        )
    )
    assert "spike_warmup_steps" not in plain.explicit
