"""A rank that stops advancing in a real run of 2 CPU ranks of the tiny default model (through
`./train-singlenode.sh`, or the rank pool's ranks where the launcher is not under test): frozen with SIGSTOP during
a step, or during a checkpoint save, the hang watchdog (observe/watchdog.py)
names it, its host, phase and step in one line, its Python stacks are in the log, and the job ends with the
documented exit status within --hang_timeout and a few seconds, instead of gloo's 10-minute timeout and a
traceback from every rank (issue #28)."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from model_utils import launch_env
from model_utils.checkpoint import protocol
from model_utils.observe import watchdog
from support import step_control
from support.rank_pool import ENV, run_ranks
from support.singlenode import launch_and_interrupt, rank_pids

pytestmark = [pytest.mark.e2e]

HANG_TIMEOUT = 10
HANG = re.compile(
    r"^error: hang: rank 1 \(pid (\d+)\) on (\S+) stopped advancing in (\w+) of step (\d+): no heartbeat for "
    r"(\d+) s \(the process is frozen\); ranks 0 wait for it in \w+ of step \d+ \(--hang_timeout 10 s",
    re.M,
)


def frozen_stack(output: str, pid: int) -> str:
    """The stacks the frozen rank printed, from the watchdog's line announcing them to the next watchdog line."""
    start = re.search(rf"^watchdog: rank 1 \(pid {pid}\) on \S+, frozen in .*: its stacks$", output, re.M)
    assert start is not None, output[-6000:]
    rest = output[start.end() :]
    end = rest.find("error: hang:")
    return rest[: end if end >= 0 else None]


def run_and_check(tmp_path: Path, job: str) -> tuple[re.Match[str], str, float]:
    frozen: list[int] = []

    def freeze_rank_1(_group: int) -> None:
        pid = rank_pids(job)[1]
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)

    try:
        status, output, seconds = launch_and_interrupt(
            tmp_path, job, freeze_rank_1, "--hang_timeout", str(HANG_TIMEOUT)
        )
    finally:
        for pid in rank_pids(job).values():  # a failed test's ranks (a stopped process dies of SIGKILL too)
            os.kill(pid, signal.SIGKILL)
    assert status == watchdog.HANG_EXIT, output[-6000:]
    said = HANG.search(output)
    assert said is not None, output[-6000:]
    assert said[2] == socket.gethostname() and int(said[1]) == frozen[0]
    stack = frozen_stack(output, int(said[1]))
    assert "(most recent call first)" in stack and "train_deepspeed.py" in stack, output[-6000:]
    assert re.search(rf"^END \S+ exit status {watchdog.HANG_EXIT}$", output, re.M), output[-6000:]
    assert "Timed out waiting" not in output and "ChildFailedError" not in output, output[-6000:]
    return said, output, seconds


@pytest.mark.launcher
def test_a_rank_frozen_in_a_step_is_named_with_its_stack_and_the_job_ends_75(tmp_path: Path) -> None:
    said, output, seconds = run_and_check(tmp_path, f"hang-step-test-{os.getpid()}")
    print(f"frozen in a step: exit {seconds:.1f} s after the SIGSTOP (--hang_timeout {HANG_TIMEOUT})")
    assert said[3] in (watchdog.DATA, watchdog.COMPUTE, watchdog.DECISION), said[0]
    assert HANG_TIMEOUT <= int(said[5]) <= HANG_TIMEOUT + 2, said[0]
    # The stuck rank's own stack shows where it stood: in the training loop, not in the watchdog (the SIGSTOP lands
    # anywhere in a turn: in the step, or in its observers after the step was logged).
    assert re.search(r"line \d+ in fit$", frozen_stack(output, int(said[1])), re.M), output[-6000:]
    assert seconds < HANG_TIMEOUT + 15, f"{seconds:.0f} s from the freeze to the exit"


def test_a_rank_frozen_in_a_checkpoint_save_is_named_in_its_phase(tmp_path: Path) -> None:
    """The watchdog is the ranks' own (the launcher only passes its status on, as the test above shows): the rank
    pool's ranks, rank 1 freezing itself in its first save."""
    freeze = {**ENV, launch_env.FAULT_INJECT: "rank1_before_barrier" + protocol.FREEZE_SUFFIX}
    flags = [
        "--max_steps", "200", "--logging_freq", "1", "--checkpoint_freq", "3", "--validation_freq", "1000",
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--data_cache_dir", str(tmp_path / "data"),
        "--hang_timeout", str(HANG_TIMEOUT), *step_control.FLAGS,
    ]  # fmt: skip
    started = time.monotonic()
    proc = run_ranks(flags, cwd=tmp_path, env=freeze, timeout=300)
    seconds = time.monotonic() - started
    output = proc.stdout + proc.stderr
    # The judge ends the frozen rank after its stacks (else, continued into the save's barrier, it would hold the
    # job for the launcher's 30-s close)
    assert proc.exitcodes == [watchdog.HANG_EXIT, -signal.SIGKILL], (proc.exitcodes, output[-6000:])
    said = HANG.search(output)
    assert said is not None, output[-6000:]
    assert said[2] == socket.gethostname() and (said[3], said[4]) == (watchdog.CHECKPOINT, "3"), said[0]
    stack = frozen_stack(output, int(said[1]))
    assert "(most recent call first)" in stack and "in save" in stack, output[-6000:]
    # A checkpoint may take 4x --hang_timeout, but a frozen process is judged by its heartbeat: --hang_timeout
    # (and a round of the watchdog's thread) after it froze; the steps and the save before it take their time.
    assert HANG_TIMEOUT <= int(said[5]) <= HANG_TIMEOUT + 2, said[0]
    assert seconds < 90, f"{seconds:.0f} s from the start to the exit"
    # The SIGCONT that lets the frozen rank print its stacks may let the save finish before the ranks exit: then
    # it is a whole, verified checkpoint; else its staging dir is debris the next save removes.
    newest = protocol.newest_verified(tmp_path / "ckpt")
    assert newest is None or newest.tag == "tiny_qwen3-3steps"


def test_a_node_that_fails_the_health_gate_is_named_before_any_step_and_the_ranks_end_75(
    tmp_path: Path,
) -> None:
    """The health gate (launch/health_gate.py) in the rank's entry: a floor no node reaches fails this one, before
    the model or data are loaded; one line names it, its host goes to the hosts file train.sbatch requeues without
    (tests/unit/dskit/test_render.py holds that path), and every rank ends with the watchdog's status 75."""
    from support.rank_pool import ENV, run_ranks

    hosts = tmp_path / "hang_hosts"
    flags = ["--max_steps", "2", "--checkpoint_dir", str(tmp_path / "ckpt"), "--health_min_busbw", "1e6"]
    run = run_ranks(flags, cwd=tmp_path, env={**ENV, launch_env.HANG_HOSTS_FILE: str(hosts)})
    out = run.stdout + run.stderr
    # Every rank ends with 75; the first to exit makes torchrun end the other (SIGTERM), which may come first. The
    # job's status is the first failure's: 75.
    assert watchdog.HANG_EXIT in run.exitcodes, out[-4000:]
    assert set(run.exitcodes) <= {watchdog.HANG_EXIT, -signal.SIGTERM}, (run.exitcodes, out[-4000:])
    host = socket.gethostname()
    assert f"error: health gate: node {host} failed: all-reduce bus bandwidth " in out, out[-4000:]
    assert "below the floor of 1e+06 GB/s (--health_min_busbw) (exit status 75: requeue without it)" in out
    assert hosts.read_text() == f"{host} failed the health gate\n"
    assert "Step 1/" not in out and "Traceback" not in out and not (tmp_path / "ckpt").exists()
