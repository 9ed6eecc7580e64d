"""`./train-singlenode.sh` run as a user runs it (its own process group, 2 CPU ranks, a job name of its own), and
interrupted at a line of its output: the Ctrl-C, USR1 and killed-rank tests (tests/e2e/test_interrupt.py,
test_rank_failure.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from support import step_control
from support.torchrun import ENV, REPO

STEP = re.compile(r"\| Step (\d+)/\d+ \| Loss ")


def launcher_env(job: str) -> dict[str, str]:
    """The environment of a launch named `job` on CPU ranks (the launcher sets OMP_NUM_THREADS itself)."""
    env = {k: v for k, v in ENV.items() if not k.startswith(("DSKIT_", "OMP_NUM_THREADS"))}
    env.update(JOB_NAME=job, GPUS_PER_NODE="0", CPU_RANKS="2")
    return env


def rank_pids(job: str) -> dict[int, int]:
    """{rank: pid} of the ranks of the launch named `job` (their environment names the job)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train_deepspeed.py" in cmdline and f"JOB_NAME={job}".encode() in environ:
            ranks = [v[5:] for v in environ if v.startswith(b"RANK=")]
            if ranks:
                pids[int(ranks[0])] = int(proc.name)
    return pids


def launch_and_interrupt(
    tmp_path: Path,
    job: str,
    interrupt: Callable[[int], None],
    *flags: str,
    when: re.Pattern[str] | str = STEP,
    env: dict[str, str] | None = None,
) -> tuple[int, str, float]:
    """Run the launcher for up to 200 steps (no planned save before the end), and call `interrupt(process group)`
    when `when` says: at the first line matching a pattern (default: the first logged step), or, given a hold
    (support/step_control.py: PHASE@STEP[xN][/R]), once the ranks it names hold there, so that a stop lands in
    that phase on any machine. `env`: added to the launch's environment. Returns (exit status, everything it
    printed, seconds from the interrupt to the exit)."""
    holds = tmp_path / "holds"
    hold = step_control.env(when, holds) if isinstance(when, str) else {}
    env = {**launcher_env(job), **hold, **(env or {})}
    cmd = [
        str(REPO / "train-singlenode.sh"),
        "--max_steps", "200", "--logging_freq", "1", "--checkpoint_freq", "1000", "--validation_freq", "1000",
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--data_cache_dir", str(tmp_path / "data"),
        "--metrics_file", str(tmp_path / "metrics.jsonl"), *step_control.FLAGS, *flags,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    watchdog = threading.Timer(600, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    lines: list[str] = []
    interrupted_at: list[float] = []
    failed: list[BaseException] = []

    def now() -> None:
        interrupted_at.append(time.monotonic())
        interrupt(proc.pid)

    def once_held() -> None:
        try:
            step_control.wait_held(holds, when, 2, lambda: proc.poll() is None)
            now()
        except BaseException as e:  # raised below, in the test's thread
            failed.append(e)
            os.killpg(proc.pid, signal.SIGKILL)

    holder = threading.Thread(target=once_held, daemon=True) if isinstance(when, str) else None
    try:
        if holder is not None:
            holder.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if holder is None and not interrupted_at and when.search(line):  # type: ignore[union-attr]
                now()
        status = proc.wait()
        if holder is not None:
            holder.join(timeout=60)
    finally:
        watchdog.cancel()
        for path in (REPO / "logs").glob(f"{job}_*"):  # only this test's files: other runs write theirs
            path.unlink()
    output = "".join(lines)
    if failed:
        raise AssertionError(f"{failed[0]}: {output[-4000:]}")
    assert interrupted_at, output[-4000:]
    return status, output, time.monotonic() - interrupted_at[0]
