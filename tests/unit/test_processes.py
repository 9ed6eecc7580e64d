"""processes.py: whether a process of this host runs (this one, one that ended, a zombie not yet reaped)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from model_utils import processes


def test_a_running_process_runs_and_an_ended_or_unreaped_one_does_not() -> None:
    assert processes.running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while processes.running(child.pid):  # exited but not reaped: a zombie, which kill -0 still finds
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.05)
    assert child.poll() == 0  # reaped only now: it was a zombie while it counted as ended
    assert not processes.running(child.pid)
