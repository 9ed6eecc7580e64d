"""A clean log: each line a run of the default launcher writes is the kit's own or a warning to act on.

Runs the rendered ./train-singlenode.sh for a few steps on CPU ranks (its own checkpoint dir, data cache and
metrics file in tmp_path; the log it writes to logs/ is removed) and checks each line of the log against the
formats below: a new kind of line from a library shows up here with the line itself. The same holds for the
ranks of a LoRA run with --profile_steps (one tiny run of both), of the shared FSDP reference run, and for
`dskit export` of the shared DeepSpeed and FSDP reference runs' checkpoints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.pretrained import save_tiny_qwen3
from support.rank_pool import train
from support.reference_runs import Reference
from support.singlenode import launcher_env
from support.torchrun import ENV, REPO

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"  # model_utils/observe/log.py print0
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d"  # the launcher's `date -Is`
DS = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[WARNING\] "  # DeepSpeed's logger

KIT_LINES = {
    # the trainer and prepare (print0, warn0: the kit's own lines and warnings)
    "print0": rf"{STAMP} \| \S.*",
    "prepare": r"ok: \S+, train \d+ blocks x \d+ tokens, validation (none|\d+ blocks), .+",
    # templates/train-singlenode.sh.j2, templates/_common.sh.j2 and src/dskit/launcher/
    "logging to": r"Logging to logs/\S+\.out",
    "start": rf"START {ISO} on \S+(, running on node \S+ through srun)?",
    "host": r"Host \S+: training here",
    "uv bootstrap": r"uv not found: installing it with pip",
    "versions": r"Versions: python \S+, torch \S+ \(CUDA \S+\), deepspeed \S+",
    "gpu count": r"WARNING: \S+ has \d+ GPUs, the launch values say \d+: using all \d+",
    "cuda toolkit": r"CUDA toolkit: /usr/local/cuda-\S+",
    "ranks": r"Ranks per node: \d+ \((GPUs|CPU, no GPU on \S+)\)",
    "threads": r"Threads per rank: OMP_NUM_THREADS=\d+ \((\d+ cores / \d+ ranks|from the environment)\)",
    "end": rf"END {ISO} exit status \d+",
    "ranks started": r"Ranks started: Ctrl-C here or `kill -USR1 \d+` saves a checkpoint and stops them",
    # dskit export (src/dskit/export.py main)
    "exported": r"exported \S+ to \S+ \((bf16|fp32)(, the LoRA adapter only)?\)",
    # dskit doctor (src/dskit/doctor/: main, format_table, summary)
    "doctor header": r"dskit doctor on \S+ \(\d+ nodes?\):",
    "doctor columns": r"check +status +found +fix",
    "doctor rule": r"-+  -{6}  -+  -+",
    "doctor row": r"[A-Za-z][\w ()/.-]*?  +(PASS|WARN|FAIL|SKIP)(  .*)?",
    "doctor wrapped": r" {20,}\S.*",
    "doctor summary": r"doctor: \d+ PASS, \d+ WARN, \d+ FAIL, \d+ SKIP: .+",
}

# Warnings a user can act on that a default launch may print. (DeepSpeed's "total_num_steps N is less than
# warmup_num_steps M" is not one: the kit shortens a warm-up longer than the run and says so in its own line,
# which this test's 3-step run with the default 10-step warm-up checks.)
ACTIONABLE_WARNINGS: dict[str, str] = {}

ALLOWED = [re.compile(p) for p in (*KIT_LINES.values(), *ACTIONABLE_WARNINGS.values())]


def unexplained(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip() and not any(p.fullmatch(line) for p in ALLOWED)]


def test_every_line_of_a_default_launch_is_the_kits_own_or_actionable(tmp_path: Path) -> None:
    job = f"clean-log-test-{os.getpid()}"
    env = launcher_env(
        job
    )  # CPU ranks on any machine (with OMP_NUM_THREADS set, torchrun would print a banner)
    cmd = [
        str(REPO / "train-singlenode.sh"),
        "--max_steps", "3", "--logging_freq", "1",
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--data_cache_dir", str(tmp_path / "data"),
        "--metrics_file", str(tmp_path / "metrics.jsonl"),
    ]  # fmt: skip
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        logs = sorted((REPO / "logs").glob(f"{job}_*.out"))
        log = logs[0].read_text(errors="replace") if logs else ""
    finally:  # only this test's files: other runs may be writing theirs
        for path in (REPO / "logs").glob(f"{job}_*"):
            path.unlink()
    seconds = time.monotonic() - started
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len(logs) == 1, logs
    lines = log.splitlines()
    assert lines[0].startswith("START ") and lines[-1].endswith("exit status 0"), log[-4000:]
    assert re.search(rf"^{STAMP} \| Step 3/3 \| Loss ", log, re.M), log[-4000:]
    assert re.search(rf"^{STAMP} \| Training finished$", log, re.M), log[-4000:]
    assert "Warm-up of 10 steps is longer than the run: warming up over its 3 steps" in log

    # The launcher's stdout is the log (tee) plus "Logging to ...": the log, then what only the terminal saw.
    in_log = set(lines)
    terminal_only = [line for line in proc.stdout.splitlines() if line not in in_log]
    offending = unexplained(lines + terminal_only + proc.stderr.splitlines())
    assert not offending, (
        f"{len(offending)} line(s) of the launch ({seconds:.0f} s) are neither the kit's own nor an "
        "actionable warning: prevent them (launcher environment) or filter them by logger and exact message "
        "(src/model_utils/launch/startup.py):\n" + "\n".join(offending)
    )


def assert_clean(what: str, output: str) -> None:
    offending = unexplained(output.splitlines())
    assert not offending, (
        f"{len(offending)} line(s) of {what} are neither the kit's own nor an actionable warning: prevent them "
        "or filter them by logger and exact message (src/model_utils/launch/startup.py):\n"
        + "\n".join(offending)
    )


def test_every_line_of_a_lora_run_with_a_profile_is_the_kits_own(tmp_path: Path) -> None:
    base = save_tiny_qwen3(tmp_path / "base")  # a pretrained model: its weights are loaded on every rank
    flags = [
        "--model", str(base), "--lora_r", "4", "--lora_alpha", "8", "--profile_steps", "2:2",
        "--max_steps", "2", "--logging_freq", "1", "--seq_length", "64", "--micro_batch_size", "2",
        "--validation_fraction", "0", "--checkpoint_dir", str(tmp_path / "ckpt"),
        "--data_cache_dir", str(tmp_path / "data"), "--metrics_file", str(tmp_path / "metrics.jsonl"),
    ]  # fmt: skip
    log = train(flags, tmp_path)
    assert "LoRA r=4 alpha=8" in log and "Profiled steps 2-2: " in log, log[-4000:]
    assert_clean("a LoRA run with --profile_steps", log)


def test_every_line_of_an_fsdp_run_is_the_kits_own(fsdp_reference: Reference) -> None:
    assert_clean("the FSDP reference run", fsdp_reference.straight_log)


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_every_line_of_dskit_export_is_the_kits_own(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    reference: Reference = request.getfixturevalue(f"{engine}_reference")
    # As from a user's shell on a machine without a GPU: no DS_ACCELERATOR set.
    env = {k: v for k, v in ENV.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run(
        [sys.executable, "-m", "dskit.cli", "export", str(reference.straight), str(tmp_path / "model")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert_clean(f"dskit export of a {engine} checkpoint", proc.stdout + proc.stderr)
