"""The tiers' lock (tests/support/tier_lock.py) between real processes: a quiet test waits for the other tier's
running test, and the other tier's next test waits for the quiet one, even when it asks while the quiet test waits."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HOLD = """
import sys, time
sys.path.insert(0, {support!r})
from support import tier_lock
with tier_lock.holding(quiet={quiet}):
    print("start", time.monotonic(), flush=True)
    time.sleep({seconds})
    print("end", time.monotonic(), flush=True)
"""


def hold(lock: Path, quiet: bool, seconds: float) -> subprocess.Popen[str]:
    code = HOLD.format(support=str(Path(__file__).parents[1]), quiet=quiet, seconds=seconds)
    env = {"DSKIT_TEST_TIER_LOCK": str(lock), "PATH": "/usr/bin:/bin"}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def span(proc: subprocess.Popen[str]) -> tuple[float, float]:
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    (start, end) = [float(line.split()[1]) for line in out.splitlines()]
    return start, end


def test_a_quiet_test_runs_alone_and_is_not_overtaken(tmp_path: Path) -> None:
    lock = tmp_path / "tiers.lock"
    running = hold(lock, quiet=False, seconds=1.0)  # the other tier's test, under way
    time.sleep(0.3)
    quiet = hold(lock, quiet=True, seconds=1.0)
    time.sleep(0.3)
    following = hold(lock, quiet=False, seconds=0.1)  # the other tier's next test, asked while quiet waits
    first, alone, after = span(running), span(quiet), span(following)
    assert first[1] <= alone[0] and alone[1] <= after[0], (first, alone, after)


def test_shared_holders_run_together(tmp_path: Path) -> None:
    lock = tmp_path / "tiers.lock"
    a, b = hold(lock, quiet=False, seconds=1.0), hold(lock, quiet=False, seconds=1.0)
    (a_start, a_end), (b_start, b_end) = span(a), span(b)
    assert a_start < b_end and b_start < a_end
