"""Process ids for the tests of stale-holder checks (processes.py's callers)."""

from __future__ import annotations

import subprocess
import sys


def ended_pid() -> int:
    """The pid of a process that has ended and been reaped (a pid is not reused this soon)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(done.stdout)
