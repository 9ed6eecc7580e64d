"""Preemption on a rank: SIGUSR1 only sets a flag (the stop is decided collectively after a step), and how often
SLURM requeued the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from model_utils.launch import preemption


@pytest.fixture
def restored_handlers():
    before = {sig: signal.getsignal(sig) for sig in preemption.STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_sigusr1_is_recorded_not_acted_on(restored_handlers) -> None:
    request = preemption.StopRequest()
    assert request.signal_name is None
    os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's --signal=B:USR1@N, forwarded by the launcher
    assert request.signal_name == "SIGUSR1"  # this process goes on: no exit, no exception


def test_slurm_restart_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert preemption.slurm_restart_count() is None  # outside SLURM
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert preemption.slurm_restart_count() == 3
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert preemption.slurm_restart_count() == 0  # the first run of the job: SLURM leaves it unset


def test_ctrl_c_is_a_stop_request_too(restored_handlers) -> None:
    request = preemption.StopRequest()
    os.kill(os.getpid(), signal.SIGINT)  # the launcher's trap, on the terminal's Ctrl-C
    assert request.signal_name == "SIGINT" and request.interrupted  # no KeyboardInterrupt


def test_a_signal_during_start_up_is_kept_for_the_trainers_request(restored_handlers) -> None:
    preemption.install()
    os.kill(os.getpid(), signal.SIGUSR1)  # before the trainer exists: imports, the model, the engine
    request = preemption.StopRequest()
    assert request.signal_name == "SIGUSR1" and not request.interrupted
    assert preemption.StopRequest().signal_name is None  # handed over once


def test_a_second_ctrl_c_ends_the_rank_at_once_and_quietly() -> None:
    code = (
        "import os, signal, time\n"
        "from model_utils.launch import preemption\n"
        "preemption.install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "request = preemption.StopRequest()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == preemption.INTERRUPTED_EXIT == 130
    assert proc.stdout == proc.stderr == ""  # no traceback


def test_catches_tells_a_process_that_handles_a_signal_from_one_that_would_die_of_it(
    restored_handlers,
) -> None:
    starting = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"]
    )  # a rank before install
    try:
        assert not preemption.catches(starting.pid, signal.SIGUSR1)
    finally:
        starting.kill()
        starting.wait()
    assert not preemption.catches(starting.pid, signal.SIGUSR1)  # gone
    preemption.install()
    assert preemption.catches(os.getpid(), signal.SIGUSR1)
    assert not preemption.catches(os.getpid(), signal.SIGUSR2)
