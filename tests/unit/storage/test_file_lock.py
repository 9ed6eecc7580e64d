"""One process at a time on a shared dir: a second holder waits, told whose lock it waits for, until the first
releases it (or dies: the kernel drops a flock); where the filesystem has no flock, a lock file whose holder on
this host is gone is taken over, and a live one is waited for. (Two preparations of data at once:
tests/unit/data/test_block_cache.py; two `dskit prepare-data`: tests/unit/dskit/test_prepare_data.py.)"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model_utils.storage import file_lock
from support.processes import ended_pid

HOLDER = """
import sys, time
from pathlib import Path
from model_utils.storage import file_lock
with file_lock.exclusive(Path(sys.argv[1]), print):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_second_holder_waits_naming_the_first_and_a_killed_holder_frees_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        said: list[str] = []
        first.kill()  # its flock goes with it: nothing stale is left to wait for
        first.wait(timeout=30)
        with file_lock.exclusive(lock, said.append):
            assert said == [] and f"pid {os.getpid()} " in lock.read_text()
        second = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(lock)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert second.stdout is not None and second.stdout.readline().strip() == "held"
        waited_at = time.monotonic()

        def release_soon(holder: str) -> None:
            said.append(holder)
            assert second.stdin is not None
            second.stdin.close()  # the holder finishes while this one waits

        with file_lock.exclusive(lock, release_soon):
            assert time.monotonic() - waited_at < 30
        assert len(said) == 1 and said[0].startswith(f"host {socket.gethostname()} pid {second.pid} since ")
        second.wait(timeout=30)
    finally:
        first.kill()


def test_without_flock_a_lock_left_by_a_killed_holder_is_taken_over(tmp_path: Path, monkeypatch) -> None:
    lock = tmp_path / ".lock"
    held = tmp_path / ".lock.held"
    held.write_text(f"host {socket.gethostname()} pid {ended_pid()} since 11:00:00")

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")  # a filesystem without flock

    monkeypatch.setattr(file_lock.fcntl, "flock", no_flock)
    said: list[str] = []
    with file_lock.exclusive(lock, said.append):
        assert (
            said == [] and f"pid {os.getpid()} " in held.read_text()
        )  # its holder is gone: nobody to wait for
    assert not held.exists()
    # One whose holder lives is waited for, naming it; it finishes during the first wait.
    held.write_text(f"host {socket.gethostname()} pid {os.getpid()} since 11:00:00")
    monkeypatch.setattr(file_lock, "POLL_S", 0.01)
    sleeps = []
    monkeypatch.setattr(file_lock.time, "sleep", lambda s: sleeps.append(held.unlink(missing_ok=True)))
    with file_lock.exclusive(lock, said.append):
        pass
    assert said == [
        f"host {socket.gethostname()} pid {os.getpid()} since 11:00:00; delete {held} if that process is gone"
    ]
    assert len(sleeps) == 1 and not held.exists()


def test_a_lock_that_cannot_be_made_is_an_error_not_a_wait(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), file_lock.exclusive(tmp_path / "missing" / ".lock", print):
        pass
