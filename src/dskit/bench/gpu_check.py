"""`dskit gpu-check`: the kit's acceptance on this machine's GPU in one command, one JSON and one table.

Each step is a child process with its own time limit, so a hang costs that step's limit and not the run:

1. `ops`: DeepSpeed's CPU Adam op built (or loaded) for this accelerator, before anything timed needs it (the
   gpu tests' bench and the offload rows do).
2. `pytest`: the tests marked `gpu` (`python -m pytest -m gpu FILES`, the test files that mark any). Without a GPU
   they skip: "not run".
3. `bench`: `dskit bench`, the plain PyTorch reference (compiled and eager) against the kit's GPU-only and
   offload configs, Liger on and off, `--micro_batch_size auto`: qwen3-0.6b at sequence
   2048 on CUDA; on CPU the tiny preset at a short sequence, both configs and the eager reference.
4. `launcher`: `./train-singlenode.sh` for a few steps with this interpreter (DSKIT_PYTHON), its own
   checkpoint dir and metrics file.

Writes `<out_dir>/gpu-check-<timestamp>.json` and `.md` (device, versions, the bench rows, each check's pass,
fail or not run and why; each step's output beside them as `.<step>.log`), prints the table, and exits 1 when a
check failed. The planned time of each step (from the first run, on an H200) is in docs/speed.md ("GPU acceptance").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from model_utils.errors import CommandParser, ConfigError

STEP_NAMES = ("ops", "pytest", "bench", "launcher")
# what torchrun (or an in-process run) sets for a process group: never inherited by a step
RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Seconds planned for each step. On CUDA they add up to under the 10-minute budget, so a hang cannot overrun it
# (docs/speed.md "GPU acceptance": measured on an H200); on CPU they are generous (a cold build of DeepSpeed's CPU
# Adam takes minutes on 2 cores). A step may also use what the steps before it left unused (step_limit).
LIMITS = {
    "cuda": {"ops": 70, "pytest": 150, "bench": 315, "launcher": 60},
    "cpu": {"ops": 300, "pytest": 120, "bench": 300, "launcher": 300},
}
PYTEST_TEST_TIMEOUT_S = 90  # one hung gpu test fails alone (pytest-timeout), with its stack, and the rest run
GPU_CONFIG, OFFLOAD_CONFIG = "deepspeed/ds_config_gpu.json", "deepspeed/ds_config.json"
# The first kit row trains without Liger, so the auto micro batch it finds (which the reference rows train at
# too) fits the plain PyTorch loop: with Liger's fused loss the probe finds more, which the reference's fp32
# logits do not fit (on an H100 80GB, micro batch 16 OOMs eager). The kit's --compile row is left out: the
# compiled reference's cold compile took 3 minutes on the H200 machine, and a second one does not fit the 10
# minutes (`dskit bench --vary compile=true` runs it); Liger + compile failed on the measured H100 stack.
BENCH_ARGS = {
    "cuda": [
        "--deepspeed_config", GPU_CONFIG, OFFLOAD_CONFIG, "--liger", "off", "--micro_batch_size", "auto",
        "--vary", "liger=on", "--reference", "compiled,eager",
        "--steps", "10", "--warmup_steps", "3",
    ],
    "cpu": [
        "--deepspeed_config", GPU_CONFIG, OFFLOAD_CONFIG, "--micro_batch_size", "auto", "--reference", "eager",
        "--seq_length", "64", "--steps", "2", "--warmup_steps", "1",
    ],
}  # fmt: skip
LAUNCHER_STEPS = 10
# The kit's best GPU-only row must reach this share of the compiled reference's tokens/s: on an H100
# (docs/speed.md) ZeRO-2 + Liger ran at 1.12x plain PyTorch + torch.compile. Only judged on CUDA.
MIN_VS_COMPILED = 0.8
OUTPUT_TAIL = 15  # lines of a failed step's output in its reason


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="dskit gpu-check",
        description="Acceptance on this machine's GPU: the gpu-marked tests, dskit bench against the plain "
        "PyTorch reference and the default launcher for a few steps; one JSON and one markdown table. "
        "Without a GPU it runs the CPU subset. Run from the kit's checkout.",
    )
    p.add_argument(
        "--only",
        metavar="STEP,...",
        help=f"run only these steps, a comma list of {', '.join(STEP_NAMES)} (default: all)",
    )
    p.add_argument(
        "--out_dir", default="logs", help="where the JSON, markdown and step logs go (default: logs)"
    )
    return p


@dataclass
class Check:
    name: str
    status: str  # "pass", "fail" or "not run"
    reason: str
    seconds: float | None = None
    limit_s: int | None = None


@dataclass
class StepResult:
    returncode: int | None  # None: killed at its time limit
    seconds: float
    output: str


@dataclass
class Report:
    device: str
    device_name: str
    versions: dict[str, str]
    started: str
    steps: list[str]
    checks: list[Check] = field(default_factory=list)
    bench: dict[str, Any] | None = None  # dskit bench's JSON
    launcher: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)


def select_steps(only: str | None) -> list[str]:
    if only is None:
        return list(STEP_NAMES)
    steps = only.split(",")
    unknown = [s for s in steps if s not in STEP_NAMES]
    if unknown or len(set(steps)) != len(steps):
        raise ConfigError(
            f"--only {only!r}: use a comma list of {', '.join(STEP_NAMES)}, each once (e.g. --only pytest,bench)"
        )
    return [s for s in STEP_NAMES if s in steps]  # in the order they run


def versions() -> dict[str, str]:
    import torch

    found = {"python": platform.python_version(), "cuda": torch.version.cuda or "none"}
    for package in ("torch", "deepspeed", "transformers", "liger-kernel"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def run_step(cmd: list[str], limit_s: int, log: Path, env: dict[str, str]) -> StepResult:
    """One step as a child process in its own session; past its limit the whole process group is ended."""
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            returncode = None
            # The step's own session: torchrun's ranks and compile workers end with it.
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            _signal_group(proc.pid, signal.SIGKILL)  # whatever of the group outlived the grace period
            proc.wait()
    return StepResult(returncode, time.monotonic() - started, log.read_text(errors="replace"))


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(pgid, sig)


def _tail(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return " | ".join(lines[-OUTPUT_TAIL:])


def _ran(name: str, result: StepResult, limit_s: int) -> Check | None:
    """The failed check of a step that timed out or exited non-zero; None when it exited 0."""
    if result.returncode is None:
        return Check(
            name, "fail", f"timed out after {limit_s} s: {_tail(result.output)}", result.seconds, limit_s
        )
    if result.returncode != 0:
        reason = f"exit status {result.returncode}: {_tail(result.output)}"
        return Check(name, "fail", reason, result.seconds, limit_s)
    return None


def pytest_check(result: StepResult, junit: Path, device: str, limit_s: int) -> Check:
    def check(status: str, reason: str) -> Check:
        return Check("pytest -m gpu", status, reason, result.seconds, limit_s)

    if result.returncode == 5:
        return check("fail", "no tests marked gpu were collected")
    if result.returncode is None or not junit.exists():
        return _ran("pytest -m gpu", result, limit_s) or check("fail", "pytest wrote no report")
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, "pytest's junit XML has a testsuite"
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    counts = f"{total - skipped - failed} passed, {failed} failed, {skipped} skipped of {total}"
    timed = [(float(case.get("time", 0)), case.get("name", "?")) for case in suite.iter("testcase")]
    if timed:
        seconds, name = max(timed)
        counts += f"; slowest {name} {seconds:.0f} s"
    if failed or result.returncode != 0:
        return _ran("pytest -m gpu", result, limit_s) or check("fail", counts)
    if skipped == total:
        return check("not run", f"no GPU: the {total} gpu tests skipped" if device == "cpu" else counts)
    return check("pass", counts)


def _finite(losses: list[float | None]) -> bool:
    # The metrics file writes a non-finite loss as null (JSON has no NaN).
    return bool(losses) and all(x is not None and math.isfinite(x) for x in losses)


def layout(row: dict[str, Any]) -> str:
    """bench's batch layout (micro batch x accumulation x ranks x sequence), then where the state lives."""
    batch = row["layout"]
    if row["kind"] == "reference":
        return f"{batch}, one device, no ZeRO"
    zero = row["settings"].get("zero_optimization")
    if not zero:
        return f"{batch}, FSDP2"
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    where = "no offload" if offload == "none" else f"optimizer offloaded to {offload}"
    return f"{batch}, ZeRO-{zero.get('stage', 0)}, {where}"


def bench_checks(result: dict[str, Any], device: str) -> list[Check]:
    """Each row trained (no error, tokens/s, finite losses that fell); on CUDA the kit's best GPU-only row
    against the compiled reference."""
    checks = []
    for row in result["rows"]:
        losses = row["losses"]
        if row["error"] or not row["tokens_per_s"]:
            checks.append(Check(f"bench: {row['name']}", "fail", row["error"] or "no throughput measured"))
        elif not _finite(losses):
            checks.append(Check(f"bench: {row['name']}", "fail", f"a loss is not finite: {losses}"))
        elif losses[-1] >= losses[0]:
            reason = f"the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
            checks.append(Check(f"bench: {row['name']}", "fail", reason))
        else:
            reason = f"{row['tokens_per_s']:,.0f} tokens/s, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
            checks.append(Check(f"bench: {row['name']}", "pass", reason))
    if device == "cuda":
        checks.append(_vs_compiled(result["rows"]))
    return checks


def _vs_compiled(rows: list[dict[str, Any]]) -> Check:
    name = f"bench: kit GPU-only >= {MIN_VS_COMPILED}x compiled reference"
    compiled = next((r for r in rows if r["kind"] == "reference" and r["settings"]["compile"]), None)
    kit = [
        r["tokens_per_s"]
        for r in rows
        if r["kind"] == "dskit" and r["settings"]["deepspeed_config"] == GPU_CONFIG and r["tokens_per_s"]
    ]
    if compiled is None or not compiled["tokens_per_s"] or not kit:
        return Check(name, "fail", "the compiled reference or every GPU-only kit row did not train")
    ratio = max(kit) / compiled["tokens_per_s"]
    reason = f"best {max(kit):,.0f} vs {compiled['tokens_per_s']:,.0f} tokens/s: {ratio:.2f}x (measured on an H100: 1.12x)"
    return Check(name, "pass" if ratio >= MIN_VS_COMPILED else "fail", reason)


def launcher_check(
    result: StepResult, metrics_file: Path, limit_s: int
) -> tuple[Check, dict[str, Any] | None]:
    name = f"launcher: ./train-singlenode.sh --max_steps {LAUNCHER_STEPS}"
    failed = _ran(name, result, limit_s)
    if failed:
        return failed, None
    records = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    )
    steps = {r["step"]: r for r in records if "loss" in r}
    last = steps.get(LAUNCHER_STEPS)
    not_finite = [step for step, r in steps.items() if not _finite([r["loss"]])]
    reason = None
    if last is None:
        reason = f"no step {LAUNCHER_STEPS} in its metrics file (logged steps: {sorted(steps)})"
    elif not_finite:
        reason = f"the loss is not finite at steps {not_finite}"
    if reason:
        return Check(name, "fail", reason, result.seconds, limit_s), None
    summary = {"steps": LAUNCHER_STEPS, "loss": last["loss"], "tokens_per_s": last["tokens_per_s"]}
    reason = (
        f"{LAUNCHER_STEPS} steps, loss {last['loss']:.3f}, {last['tokens_per_s']:,.0f} tokens/s at the last"
    )
    return Check(name, "pass", reason, result.seconds, limit_s), summary


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(scale * value, spec)


def markdown(report: Report) -> str:
    v = report.versions
    lines = [
        f"# dskit gpu-check {report.started}",
        "",
        f"Device: {report.device_name} ({report.device}). Versions: torch {v['torch']} (CUDA {v['cuda']}), "
        f"deepspeed {v['deepspeed']}, transformers {v['transformers']}, liger-kernel {v['liger-kernel']}, "
        f"python {v['python']}. Steps: {', '.join(report.steps)}.",
        "",
    ]
    if report.bench:
        b = report.bench
        lines += [
            f"Bench: {b['model']}, sequence {b['seq_length']}, {b['warmup_steps']} warm-up + {b['steps']} timed "
            "steps per row; MFU against the device's dense bf16 peak; peak memory on CPU is the process's RSS.",
            "",
            "| config | layout | tokens/s | MFU | peak GiB | first step s | vs reference |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in b["rows"]:
            lines.append(
                f"| {r['name']} | {layout(r)} | "
                f"{r['error'] or _fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['mfu'], '.1f', 100)}"
                f"{'%' if r['mfu'] is not None else ''} | {_fmt(r['peak_mem_gib'], '.2f')} | "
                f"{_fmt(r['first_step_s'], '.1f')} | {_fmt(r['vs_reference'], '.2f')}"
                f"{'x' if r['vs_reference'] is not None else ''} |"
            )
        lines.append("")
    lines += ["| check | result | seconds | why |", "|---|---|---:|---|"]
    for c in report.checks:
        took = (
            "-"
            if c.seconds is None
            else f"{c.seconds:.0f}" + ("" if c.limit_s is None else f" / {c.limit_s}")
        )
        lines.append(f"| {c.name} | {c.status.upper()} | {took} | {c.reason.replace('|', '/')} |")
    failed = sum(c.status == "fail" for c in report.checks)
    lines += ["", f"{'FAILED' if failed else 'PASSED'}: {failed} of {len(report.checks)} checks failed"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Context:
    """What every step runs with: this interpreter, the children's environment, a scratch dir."""

    root: Path
    device: str
    stamp: str
    env: dict[str, str]
    scratch: Path

    @property
    def python(self) -> str:
        return sys.executable


def step_ops(ctx: Context, log: Path, limit: int, report: Report) -> list[Check]:
    name = "ops: DeepSpeed CPU Adam"
    code = "from model_utils.launch import ops; ops.warm_deepspeed_ops(['CPUAdamBuilder'])"
    result = run_step([ctx.python, "-c", code], limit, log, ctx.env)
    return [_ran(name, result, limit) or Check(name, "pass", "built or loaded", result.seconds, limit)]


GPU_MARK = re.compile(r"\bmark\.gpu\b")


def gpu_test_files(root: Path) -> list[str]:
    """The test files that mark tests `gpu` (pytest.mark.gpu, as a decorator, pytestmark or a param's marks): the
    step collects these, not the whole suite (8 of its CPU-s, to select 7 tests from 1,400)."""
    return sorted(
        str(path.relative_to(root))
        for path in (root / "tests").rglob("test_*.py")
        if GPU_MARK.search(path.read_text(errors="replace"))
    )


def step_pytest(ctx: Context, log: Path, limit: int, report: Report) -> list[Check]:
    junit = ctx.scratch / "pytest.xml"
    # -v: the log names each test as it starts, so a step stopped at its limit says which test it was in
    cmd = [
        ctx.python, "-m", "pytest", "-m", "gpu", *gpu_test_files(ctx.root), "-v", "-p", "no:cacheprovider",
        "-o", f"timeout={PYTEST_TEST_TIMEOUT_S}", "--junitxml", str(junit),
    ]  # fmt: skip
    return [pytest_check(run_step(cmd, limit, log, ctx.env), junit, ctx.device, limit)]


def step_bench(ctx: Context, log: Path, limit: int, report: Report) -> list[Check]:
    out = ctx.scratch / "bench.json"
    cmd = [ctx.python, "-m", "dskit.cli", "bench", *BENCH_ARGS[ctx.device], "--json", str(out)]
    checks, report.bench = bench_result(run_step(cmd, limit, log, ctx.env), out, ctx.device, limit)
    return checks


def bench_result(
    result: StepResult, out: Path, device: str, limit: int
) -> tuple[list[Check], dict[str, Any] | None]:
    """The bench step's checks and rows. dskit bench writes its JSON after every row, so a bench stopped at its
    limit still reports (and judges) the rows it finished."""
    failed = _ran("bench", result, limit)
    if not out.exists():
        return [failed or Check("bench", "fail", "dskit bench wrote no JSON", result.seconds, limit)], None
    bench = json.loads(out.read_text())
    rows = len(bench["rows"])
    if failed:
        failed.reason = f"{rows} rows done; {failed.reason}"
    ran = failed or Check("bench", "pass", f"{rows} rows", result.seconds, limit)
    return [ran, *bench_checks(bench, device)], bench


def step_launcher(ctx: Context, log: Path, limit: int, report: Report) -> list[Check]:
    metrics_file = ctx.scratch / "launcher.metrics.jsonl"
    cmd = [
        str(ctx.root / "train-singlenode.sh"),
        "--max_steps", str(LAUNCHER_STEPS), "--logging_freq", "1",
        "--checkpoint_dir", str(ctx.scratch / "checkpoints"), "--metrics_file", str(metrics_file),
    ]  # fmt: skip
    # The launcher trains with this interpreter instead of syncing its own environment; its log goes to logs/.
    env = {**ctx.env, "DSKIT_PYTHON": ctx.python, "JOB_NAME": f"gpu-check-{ctx.stamp}"}
    check, report.launcher = launcher_check(run_step(cmd, limit, log, env), metrics_file, limit)
    return [check]


def step_limit(limits: dict[str, int], so_far: list[str], elapsed_s: float) -> int:
    """The last step of so_far may take its own planned seconds and what the steps before it left unused: the
    run never outlasts the sum of the plans."""
    return max(1, round(sum(limits[s] for s in so_far) - elapsed_s))


STEPS = {"ops": step_ops, "pytest": step_pytest, "bench": step_bench, "launcher": step_launcher}


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    steps = select_steps(ns.only)
    root = Path.cwd()
    if not (root / "train-singlenode.sh").is_file() or not (root / "tests").is_dir():
        raise ConfigError(
            "dskit gpu-check runs from the kit's checkout (where train-singlenode.sh and tests/ are)"
        )
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"gpu-check-{stamp}"
    report = Report(
        device=device,
        device_name=torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        versions=versions(),
        started=stamp,
        steps=steps,
    )
    limits = LIMITS[device]
    print(
        f"gpu-check on {report.device_name}: {', '.join(f'{s} (limit {limits[s]} s)' for s in steps)}; a "
        "step may also use what the steps before it left",
        flush=True,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dskit-gpu-check-") as scratch:
        # The children train on what torch sees here, whatever DS_ACCELERATOR the caller's shell exports (the
        # Makefile exports cpu for the test suite); each sets up its own process group, so the caller's
        # rendezvous variables (a port its own group may still hold) are not passed on.
        env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
        ctx = Context(root, device, stamp, {**env, "DS_ACCELERATOR": device}, Path(scratch))
        for i, step in enumerate(steps):
            limit = step_limit(limits, steps[: i + 1], time.monotonic() - started)
            print(f"gpu-check: {step} (limit {limit} s) ...", flush=True)
            checks = STEPS[step](ctx, Path(f"{base}.{step}.log"), limit, report)
            report.checks += checks
            for c in checks:
                print(f"gpu-check: {c.name}: {c.status} ({c.reason[:200]})", flush=True)
    table = markdown(report)
    Path(f"{base}.md").write_text(table)
    Path(f"{base}.json").write_text(
        json.dumps({**asdict(report), "failed": report.failed, "limits_s": limits}, indent=2) + "\n"
    )
    print(table, end="", flush=True)
    print(f"written: {base}.json, {base}.md", flush=True)
    return 1 if report.failed else 0
