"""`dskit gpu-check`: step selection and a wrong directory as one line, a step past its time limit ended with its
process group, a launcher that hangs or logs no last step. The GPU-only verdicts (the pass of the gpu tests, the
kit against the compiled reference) cannot run here: they are checked on hand-written pytest and bench results.
The CPU subset run for real: tests/e2e/test_gpu_check.py; the launcher step: tests/e2e/test_gpu_check_launcher.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from dskit import cli
from dskit.bench import gpu_check

REPO = Path(__file__).resolve().parents[4]


def test_bad_steps_and_a_wrong_directory_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["gpu-check", "--only", "bench,tests"]) == 2
    assert cli.main(["gpu-check", "--only", "bench,bench"]) == 2
    assert cli.main(["gpu-check", "--out_dir", str(tmp_path / "o")]) == 2  # not the checkout
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        "error: --only 'bench,tests': use a comma list of ops, pytest, bench, launcher, each once "
        "(e.g. --only pytest,bench)",
        "error: --only 'bench,bench': use a comma list of ops, pytest, bench, launcher, each once "
        "(e.g. --only pytest,bench)",
        "error: dskit gpu-check runs from the kit's checkout (where train-singlenode.sh and tests/ are)",
    ]
    assert not (tmp_path / "o").exists()  # nothing ran
    assert gpu_check.select_steps("launcher,pytest") == ["pytest", "launcher"]  # in the order they run
    # The steps' limits on CUDA fit the 10-minute budget together, so no hang can overrun it; a step may use what
    # the steps before it left, never more.
    assert sum(gpu_check.LIMITS["cuda"].values()) < 600
    limits = gpu_check.LIMITS["cuda"]
    assert gpu_check.step_limit(limits, ["ops"], 0.0) == limits["ops"]
    assert gpu_check.step_limit(limits, ["ops", "pytest"], 50.0) == limits["pytest"] + limits["ops"] - 50
    steps = list(gpu_check.STEP_NAMES)
    assert gpu_check.step_limit(limits, steps, sum(limits.values()) - 60) == 60
    assert gpu_check.step_limit(limits, steps, sum(limits.values()) + 5) == 1  # a step's grace overran: 1 s
    assert tuple(gpu_check.STEPS) == gpu_check.STEP_NAMES == tuple(gpu_check.LIMITS["cuda"])


def test_a_step_past_its_limit_is_ended_with_its_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    # A child that starts a grandchild (as torchrun starts ranks) and both hang.
    cmd = ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; echo started; wait"]
    started = time.monotonic()
    result = gpu_check.run_step(cmd, 1, tmp_path / "step.log", dict(os.environ))
    assert result.returncode is None and time.monotonic() - started < 12
    grandchild = Path(f"/proc/{int(pid_file.read_text())}/stat")
    deadline = time.monotonic() + 5
    # Killed: gone, or a zombie until whichever process adopted it reaps it.
    while grandchild.exists() and _state(grandchild) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not grandchild.exists() or _state(grandchild) == "Z"
    check = gpu_check._ran("bench", result, 1)
    assert check is not None and check.status == "fail" and check.reason == "timed out after 1 s: started"

    ok = gpu_check.run_step(
        [sys.executable, "-c", "print('fine')"], 30, tmp_path / "ok.log", dict(os.environ)
    )
    assert (ok.returncode, ok.output) == (0, "fine\n") and gpu_check._ran("x", ok, 30) is None


def _state(stat: Path) -> str:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]  # after "pid (comm)"
    except FileNotFoundError:
        return "gone"


def _junit(path: Path, tests: int, skipped: int, failures: int) -> Path:
    cases = "".join(f'<testcase name="test_{i}" time="{10.0 * i + 0.4}"/>' for i in range(tests))
    path.write_text(
        f'<testsuites><testsuite name="pytest" errors="0" failures="{failures}" skipped="{skipped}" '
        f'tests="{tests}">{cases}</testsuite></testsuites>'
    )
    return path


def test_gpu_test_verdicts_on_a_gpu(tmp_path: Path) -> None:
    """Hand-written pytest reports (what a GPU run writes), since the gpu tests cannot pass here."""
    done = gpu_check.StepResult(0, 80.0, "6 passed")
    passed = gpu_check.pytest_check(done, _junit(tmp_path / "a.xml", 6, 0, 0), "cuda", 105)
    assert (passed.status, passed.reason) == (
        "pass",
        "6 passed, 0 failed, 0 skipped of 6; slowest test_5 50 s",
    )
    failed = gpu_check.StepResult(
        1, 80.0, "FAILED tests/unit/model/test_kernels.py::test_x\n1 failed, 5 passed"
    )
    check = gpu_check.pytest_check(failed, _junit(tmp_path / "b.xml", 6, 0, 1), "cuda", 105)
    assert check.status == "fail" and check.reason.startswith(
        "exit status 1: FAILED tests/unit/model/test_kernels"
    )
    none = gpu_check.StepResult(5, 9.0, "no tests ran")
    assert gpu_check.pytest_check(none, tmp_path / "missing.xml", "cuda", 105).status == "fail"


def _row(kind: str, tokens: float | None, config: str | None = None, compiled: bool = False) -> dict:
    settings = {"compile": compiled} if kind == "reference" else {"deepspeed_config": config}
    losses = [12.0, 11.0]
    return {"name": f"{kind} {config}", "kind": kind, "tokens_per_s": tokens, "error": None, "losses": losses,
            "settings": settings, "micro_batch_size": 8}  # fmt: skip


def test_on_cuda_the_kit_is_judged_against_the_compiled_reference() -> None:
    """Hand-written bench rows (a GPU's figures cannot be measured here)."""
    reference = [_row("reference", 65_000.0, compiled=True), _row("reference", 37_000.0)]
    good = {"rows": [*reference, _row("dskit", 60_000.0, gpu_check.GPU_CONFIG), _row("dskit", 30_000.0, "x")]}
    checks = gpu_check.bench_checks(good, "cuda")
    assert [c.status for c in checks] == ["pass"] * 5
    assert checks[-1].reason == "best 60,000 vs 65,000 tokens/s: 0.92x (measured on an H100: 1.12x)"
    slow = {"rows": [*reference, _row("dskit", 40_000.0, gpu_check.GPU_CONFIG)]}
    assert gpu_check.bench_checks(slow, "cuda")[-1].status == "fail"
    oom = {"rows": [{**_row("reference", None, compiled=True), "error": "out of memory"}]}
    assert [(c.status, c.reason) for c in gpu_check.bench_checks(oom, "cpu")] == [("fail", "out of memory")]
    flat = {"rows": [{**_row("dskit", 1.0, "x"), "losses": [7.0, 7.5]}]}
    assert gpu_check.bench_checks(flat, "cpu")[0].reason == "the loss did not fall: 7.000 -> 7.500"


def test_a_bench_stopped_at_its_limit_still_reports_the_rows_it_finished(tmp_path: Path) -> None:
    """On the H200 the bench overran its limit after four rows and the table showed none of them."""
    out = tmp_path / "bench.json"
    rows = [_row("reference", 65_000.0, compiled=True), _row("dskit", 60_000.0, gpu_check.GPU_CONFIG)]
    out.write_text(json.dumps({"complete": False, "rows": rows}))
    stopped = gpu_check.StepResult(None, 315.0, "Step 13/13 | Loss 9.5")
    checks, bench = gpu_check.bench_result(stopped, out, "cuda", 315)
    assert bench is not None and len(bench["rows"]) == 2
    assert (checks[0].status, checks[0].reason) == (
        "fail",
        "2 rows done; timed out after 315 s: Step 13/13 | Loss 9.5",
    )
    assert [c.status for c in checks[1:]] == ["pass", "pass", "pass"]  # the two rows and the ratio, judged
    checks, bench = gpu_check.bench_result(stopped, tmp_path / "none.json", "cuda", 315)
    assert bench is None and [c.reason for c in checks] == ["timed out after 315 s: Step 13/13 | Loss 9.5"]
    done = gpu_check.StepResult(0, 200.0, "")
    checks, _ = gpu_check.bench_result(done, out, "cuda", 315)
    assert (checks[0].status, checks[0].reason) == ("pass", "2 rows")


def test_the_cuda_bench_rows_parse_into_the_planned_configs(tmp_path: Path) -> None:
    """What `dskit bench` trains on a GPU (it cannot train here): both references, then the GPU-only config with
    Liger off first (its probed micro batch is the references'), the offload config, Liger on (no kit compile row:
    a second cold compile does not fit the 10 minutes)."""
    from dskit import bench
    from model_utils.config.arguments import parse_args

    ns = bench.build_parser().parse_args(gpu_check.BENCH_ARGS["cuda"])
    assert bench.reference_modes(ns.reference, "cuda") == ["compiled", "eager"]
    assert (ns.micro_batch_size, ns.steps, ns.warmup_steps, ns.seq_length) == ("auto", 10, 3, None)  # 2048
    variants = [bench.Variant(c, c, Path(c).name) for c in ns.deepspeed_config]
    variants += bench.vary_variants(ns.deepspeed_config[0], ns.vary, tmp_path)
    configs = [
        parse_args(bench._training_flags(ns, bench.GPU_MODEL, v.path, str(tmp_path)) + list(v.flags))
        for v in variants
    ]
    assert [(c.optim.deepspeed_config, c.model.liger, c.model.compile) for c in configs] == [
        (gpu_check.GPU_CONFIG, "off", False),
        (gpu_check.OFFLOAD_CONFIG, "off", False),
        (gpu_check.GPU_CONFIG, "on", False),
    ]
    assert all(c.optim.micro_batch_size == "auto" for c in configs)


def test_a_launcher_that_hangs_or_logs_no_last_step_fails(tmp_path: Path) -> None:
    """The failing verdicts of the launcher step (the real run: tests/e2e/test_gpu_check_launcher.py)."""
    hung = gpu_check.StepResult(None, 60.0, "Step 3/10 | Loss 7.1")
    check, summary = gpu_check.launcher_check(hung, tmp_path / "none.jsonl", 60)
    assert (check.status, check.reason, summary) == (
        "fail",
        "timed out after 60 s: Step 3/10 | Loss 7.1",
        None,
    )
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"step": 3, "loss": 7.1, "tokens_per_s": 900.0}) + "\n")
    check, summary = gpu_check.launcher_check(gpu_check.StepResult(0, 30.0, ""), short, 60)
    assert (check.status, summary) == ("fail", None)
    assert check.reason == f"no step {gpu_check.LAUNCHER_STEPS} in its metrics file (logged steps: [3])"
    diverged = tmp_path / "nan.jsonl"  # a NaN loss is written as null
    records = [{"step": s, "loss": None if s == 5 else 7.0, "tokens_per_s": 900.0} for s in range(1, 11)]
    diverged.write_text("".join(json.dumps(r) + "\n" for r in records))
    check, _ = gpu_check.launcher_check(gpu_check.StepResult(0, 30.0, ""), diverged, 60)
    assert (check.status, check.reason) == ("fail", "the loss is not finite at steps [5]")


def test_the_pytest_step_collects_the_files_of_every_gpu_test(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The step hands pytest only the test files that mark tests gpu (collecting the whole suite cost most of it):
    those hold every gpu test this session collected (under `make test`, the whole main tier), and the scan finds
    the mark however it is written."""
    files = set(gpu_check.gpu_test_files(REPO))
    marked = {
        str(Path(item.path).relative_to(REPO))
        for item in request.session.items
        if item.get_closest_marker("gpu")
    }
    assert marked <= files and "tests/e2e/test_bench.py" in files
    mark = "pytest.mark." + "gpu"  # not spelled out here: this file has no gpu test for the scan to find
    forms = {
        "test_decorated.py": f"@{mark}\ndef test_a(): pass\n",
        "test_module.py": f"pytestmark = [{mark}]\n",
        "test_param.py": f"CASES = [pytest.param(1, marks={mark})]\n",
        "test_none.py": "def test_gpus_counted(): pass  # pytest.mark.gpuless is another mark\n",
    }
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    for name, text in forms.items():
        (tmp_path / "tests" / "unit" / name).write_text(text)
    assert gpu_check.gpu_test_files(tmp_path) == [
        "tests/unit/test_decorated.py",
        "tests/unit/test_module.py",
        "tests/unit/test_param.py",
    ]
