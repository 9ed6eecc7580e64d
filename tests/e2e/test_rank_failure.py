"""A rank killed in a real run through `./train-singlenode.sh`: the job ends at once, and its last line before
END says which rank died, where and how (launch/supervise.py), instead of torchrun's ChildFailedError traceback.
2 CPU ranks of the tiny default model; rank 1 gets SIGKILL as soon as it exists (a rank dying at any point ends
the run the same way; killing it early spares the suite the ranks' start-up)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from support.torchrun import ENV, REPO

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

READY = re.compile(r"^Ranks started: ")  # the launcher has started torchrun: rank 1 follows within seconds


def rank_pids(job: str) -> dict[int, int]:
    """{rank: pid} of this launch's ranks (their environment names the job)."""
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


def test_a_killed_rank_ends_the_job_with_one_line_naming_it(tmp_path: Path) -> None:
    job = f"rank-kill-test-{os.getpid()}"
    env = {k: v for k, v in ENV.items() if not k.startswith(("DSKIT_", "OMP_NUM_THREADS"))}
    env.update(JOB_NAME=job, GPUS_PER_NODE="0", CPU_RANKS="2")
    cmd = [
        str(REPO / "train-singlenode.sh"),
        "--max_steps", "200", "--logging_freq", "1", "--checkpoint_freq", "1000", "--validation_freq", "1000",
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--data_cache_dir", str(tmp_path / "data"),
        "--metrics_file", str(tmp_path / "metrics.jsonl"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    watchdog = threading.Timer(600, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    lines: list[str] = []
    killed_at, victim = None, None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if killed_at is None and READY.search(line):
                deadline = time.monotonic() + 60
                while (victim := rank_pids(job).get(1)) is None:
                    assert time.monotonic() < deadline, "".join(lines)[-4000:]
                    time.sleep(0.05)
                os.kill(victim, signal.SIGKILL)
                killed_at, killed_line = time.monotonic(), len(lines)
        status = proc.wait()
    finally:
        watchdog.cancel()
        for pid in rank_pids(job).values():  # a failed test's ranks (torchrun runs in a session of its own)
            os.kill(pid, signal.SIGKILL)
        for path in (REPO / "logs").glob(f"{job}_*"):
            path.unlink()
    seconds = time.monotonic() - killed_at if killed_at else None
    output = "".join(lines)
    assert killed_at is not None, output[-4000:]
    assert status == 1, output[-4000:]
    tail = [line.rstrip("\n") for line in lines[killed_line:]]
    print(f"killed rank 1: exit after {seconds:.1f} s, {len(tail)} lines after the kill")
    assert re.fullmatch(r"END \S+ exit status 1", tail[-1]), output[-4000:]
    assert tail[-2] == (
        f"error: rank 1 (local rank 1, pid {victim}) on {socket.gethostname()} was killed by SIGKILL (signal 9); "
        "torchrun stopped the other ranks"
    ), output[-4000:]
    assert "ChildFailedError" not in output and "Root Cause" not in output, output[-4000:]
    assert seconds is not None and seconds < 30, f"{seconds:.0f} s from the kill to the exit"
