"""Tests that need the machine to themselves while `make test` runs two tiers side by side (tools/test_tiers.py).

A test marked `quiet` compares the two ranks' time on one machine (the straggler report's clean run): on 2 cores,
the other tier's ranks take a core from one rank and not the other, and that rank is then slower for real. So
every test of either tier holds a shared lock on DSKIT_TEST_TIER_LOCK while it runs, and a `quiet` test an
exclusive one: the other tier pauses between two of its tests until the quiet test is done. A turnstile (a second
lock, taken briefly by every test and held by a quiet test while it waits) keeps the other tier from starting new
tests in front of a waiting quiet test. Without DSKIT_TEST_TIER_LOCK (pytest run alone) nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_ENV = "DSKIT_TEST_TIER_LOCK"
# Taken out of the environment when the session starts (conftest imports this): a pytest a test starts (dskit
# gpu-check's) must not queue for the lock its parent's test holds.
_PATH = os.environ.pop(LOCK_ENV, None)


def side_by_side() -> bool:
    """Whether this session runs beside the other tier (under `make test`)."""
    return bool(_PATH)


@contextlib.contextmanager
def holding(quiet: bool) -> Iterator[None]:
    path = _PATH
    if not path:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock, open(f"{path}.turnstile", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if quiet else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
