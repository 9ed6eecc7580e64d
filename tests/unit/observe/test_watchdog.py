"""The hang watchdog (observe/watchdog.py): how long each phase may go without advancing, whom the verdict names
among a host's heartbeats, and a real monitor thread beside a real frozen process (SIGSTOP): it names it, has it
print its stacks, writes the host's one line and exits with HANG_EXIT. Through the launcher with 2 ranks:
tests/e2e/test_hang.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from model_utils import launch_env, scratch
from model_utils.observe import watchdog
from model_utils.observe.watchdog import Beat, Monitor, allowance, collective_timeout_s, judge


def test_each_phase_may_take_its_allowance_and_the_collectives_wait_longer() -> None:
    assert allowance(60, watchdog.COMPUTE, 0.5) == 60  # --hang_timeout
    assert allowance(60, watchdog.COMPUTE, 20) == 200  # 10 slow steps
    assert allowance(60, watchdog.DATA, 1000) == 240  # never past the long phases'
    assert allowance(60, watchdog.CHECKPOINT, 0.5) == allowance(60, watchdog.VALIDATION, 0.5) == 240
    assert allowance(60, watchdog.SAMPLES, 0.5) == 240  # generating takes many forwards
    assert allowance(60, watchdog.COMPUTE, None) == 240  # the first step: compilation, warm-up
    longest = max(allowance(60, phase, median) for phase in watchdog.PHASES for median in (None, 0.1, 1e6))
    assert collective_timeout_s(60) > longest + 10  # gloo/NCCL never time out before the watchdog decides


def beat(
    rank: int, step: int, phase: str, progress_ago: float, alive_ago: float, now: float = 1000.0
) -> Beat:
    return Beat(rank, "node3", 100 + rank, step, phase, now - progress_ago, now - alive_ago)


def test_the_verdict_names_the_frozen_and_the_behind_and_not_those_waiting_for_them() -> None:
    me = beat(0, 12, watchdog.DECISION, 5, 0)
    others = [beat(1, 12, watchdog.COMPUTE, 30, 25), beat(2, 12, watchdog.DECISION, 5, 1)]
    assert judge(me, [me, beat(1, 12, watchdog.DECISION, 5, 1)], 1000.0, 20, 0.1) is None  # all fine
    frozen = judge(me, [me, *others], 1000.0, 20, 0.1)
    assert frozen is not None
    assert [b.rank for b in frozen.frozen] == [1] and [b.rank for b in frozen.waiting] == [0, 2]
    assert frozen.describe() == (
        "hang: rank 1 (pid 101) on node3 stopped advancing in compute of step 12: no heartbeat for 25 s (the "
        "process is frozen); ranks 0, 2 wait for it in decision of step 12 (--hang_timeout 20 s; their stacks "
        "are above; exit status 75: requeue or restart, docs/hangs.md)"
    )
    # Alive but stuck in its data (a hung filesystem): behind the others, named once this rank's wait is too long.
    looping = beat(1, 12, watchdog.DATA, 30, 1)
    assert judge(me, [me, looping], 1000.0, 20, 0.1) is None  # this rank waited 5 s only
    waited = beat(0, 12, watchdog.DECISION, 25, 0)
    behind = judge(waited, [waited, looping], 1000.0, 20, 0.1)
    assert behind is not None and [b.rank for b in behind.behind] == [1] and not behind.frozen
    assert "rank 1 (pid 101) on node3 stopped advancing in data of step 12 for 30 s" in behind.describe()


def test_a_host_whose_ranks_all_wait_says_the_stuck_rank_is_elsewhere() -> None:
    ranks = [beat(r, 40, watchdog.DECISION, 300 + r, 0) for r in range(4)]
    verdict = judge(ranks[0], ranks, 1000.0, 120, 1.0)
    assert verdict is not None and not verdict.stuck
    assert verdict.describe().startswith(
        "hang: no rank on node3 advanced for 303 s (ranks 0, 1, 2, 3 wait in decision of step 40): the rank that "
        "stopped is on another host, whose log names it"
    )
    # A checkpoint may take 4x as long before the same wait is a hang.
    saving = [beat(r, 40, watchdog.CHECKPOINT, 300 + r, 0) for r in range(4)]
    assert judge(saving[0], saving, 1000.0, 120, 1.0) is None


FROZEN_RANK = """
import sys, time
from pathlib import Path
from model_utils.observe import watchdog

monitor = watchdog.Monitor(1, 1.0, directory=Path(sys.argv[1]))
monitor.progress(3, watchdog.COMPUTE)
monitor.start()

def frozen_here():
    print("ready", flush=True)
    time.sleep(60)

frozen_here()
"""


def test_a_frozen_rank_is_named_prints_its_stacks_and_the_ranks_exit_75(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(launch_env.ERROR_FILE, str(tmp_path / "error"))
    monkeypatch.setenv(launch_env.HANG_HOSTS_FILE, str(tmp_path / "hang_hosts"))
    beats = tmp_path / "beats"
    child = subprocess.Popen(
        [sys.executable, "-c", FROZEN_RANK, str(beats)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    exits: list[int] = []
    monitor = Monitor(0, 1.0, directory=beats, exit=exits.append, dump_wait_s=0.5)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        monitor.progress(3, watchdog.DECISION)
        monitor.start()
        while not exits and time.monotonic() < stopped + 20:
            time.sleep(0.05)
        detected = time.monotonic() - stopped
    finally:
        monitor.stop()
        child.kill()
    _, child_err = child.communicate()
    assert exits == [watchdog.HANG_EXIT]
    assert 1.0 <= detected < 4, detected  # --hang_timeout and a round of the thread
    err = capfd.readouterr().err
    line = (
        f"error: hang: rank 1 (pid {child.pid}) on {socket.gethostname()} stopped advancing in compute of step 3: "
        "no heartbeat for "
    )
    assert line in err, err
    assert (tmp_path / "error").read_text().startswith(line.removeprefix("error: "))  # the message
    # train.sbatch requeues without it, saying why
    hosts = (tmp_path / "hang_hosts").read_text()
    assert hosts == f"{socket.gethostname()} a rank stopped advancing (hang)\n"
    assert f"watchdog: rank 1 (pid {child.pid}) on {socket.gethostname()}, frozen in compute of step 3" in err
    assert "watchdog: rank 0 " in err and "(most recent call first)" in err  # this rank's own stacks
    # The frozen process's stacks, printed on DUMP_SIGNAL once continued: where it stood.
    assert "(most recent call first)" in child_err and "in frozen_here" in child_err, child_err
    assert not beats.exists()  # no heartbeat left behind: this rank's, nor the frozen one's
    assert (
        child.returncode == -signal.SIGKILL
    )  # ended by the judge after its stacks, not left to the launcher


CHURNING_RANK = """
import sys, threading, time
from model_utils.observe import watchdog

sys.setrecursionlimit(10_000)
watchdog.listen_for_stacks()

def deep(n):
    return 0 if n == 0 else deep(n - 1) + 1

def churn():  # another thread's frames come and go all the time, across the frame stack's chunks
    while True:
        deep(600)

def training_step():
    while True:
        deep(60)
        time.sleep(0.0001)  # lets the other thread run Python while this one waits

threading.Thread(target=churn, daemon=True).start()
print("ready", flush=True)
training_step()
"""


def test_a_frozen_rank_prints_its_training_threads_stack_while_its_other_threads_run(tmp_path: Path) -> None:
    """Frozen and asked for its stacks again and again, a rank whose threads run Python survives each time and
    prints where its training thread stood. (Sent to the process with every thread's stack, the dump crashed it
    with SIGSEGV in about half of the tries: the handler read the stacks that the threads, continued, changed.)"""
    stacks = tmp_path / "stderr"
    with stacks.open("w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHURNING_RANK], stdout=subprocess.PIPE, stderr=err, text=True
        )
    tries = 12
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        for done in range(tries):
            time.sleep(0.02)
            child.send_signal(signal.SIGSTOP)
            watchdog.ask_for_stacks(child.pid)
            # Its stack is out before the next try (two signals pending at once would make one).
            deadline = time.monotonic() + 20
            while stacks.read_text().count("(most recent call first)") <= done and child.poll() is None:
                assert time.monotonic() < deadline, stacks.read_text()[-2000:]
                time.sleep(0.01)
        time.sleep(0.1)
        alive = child.poll() is None
    finally:
        child.kill()
        child.wait()
    printed = stacks.read_text()
    assert alive, (child.returncode, printed[-2000:])
    assert printed.count("(most recent call first)") == tries, printed[-2000:]
    assert printed.count("in training_step") == tries, printed[-2000:]
    assert "in churn" not in printed  # its own thread only


def test_ranks_that_advance_make_no_verdict_and_leave_no_files(tmp_path: Path) -> None:
    exits: list[int] = []
    monitors = [Monitor(r, 1.0, directory=tmp_path / "beats", exit=exits.append) for r in range(2)]
    for m in monitors:
        m.start()
    for step in range(1, 16):  # 1.5 s: past --hang_timeout, always advancing
        for m in monitors:
            m.progress(step, watchdog.COMPUTE)
            m.step_took(0.1)
        time.sleep(0.1)
    assert sorted(b.rank for b in monitors[0].beats()) == [0, 1]
    for m in monitors:
        m.stop()
    assert exits == [] and all(m.verdict is None for m in monitors)
    assert not (tmp_path / "beats").exists()


def test_each_launch_and_restart_of_a_host_has_its_own_heartbeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(launch_env.WATCHDOG_DIR, raising=False)
    monkeypatch.setenv(launch_env.LAUNCH_DIR, str(tmp_path / "launch"))
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = watchdog.heartbeat_dir()
    assert first.parent == tmp_path / "launch"  # the kit's launcher's dir: removed with it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted its workers
    assert watchdog.heartbeat_dir() != first
    monkeypatch.setenv("MASTER_PORT", "29512")  # another launch on the host
    assert len({first, watchdog.heartbeat_dir()}) == 2
    # Under another launcher: in the temp dir, named after the ranks' parent (scratch.remove_ended finds it).
    monkeypatch.delenv(launch_env.LAUNCH_DIR)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert watchdog.heartbeat_dir() == tmp_path / (
        scratch.prefix(watchdog.HEARTBEATS, os.getppid()) + "29512-1"
    )
    monkeypatch.setenv(launch_env.WATCHDOG_DIR, "/scratch/beats")
    assert watchdog.heartbeat_dir() == Path("/scratch/beats")
