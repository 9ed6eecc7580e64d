"""Preemption on a rank: SIGUSR1 only sets a flag (the stop is decided collectively after a step), and how often
SLURM requeued the job."""

from __future__ import annotations

import os
import signal

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
