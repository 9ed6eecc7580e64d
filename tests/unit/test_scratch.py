"""scratch.py: a launch's temporary dirs named after host, user and pid, and the removal of those whose
process has ended (only this host's and user's, only by the pid in the name)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from model_utils import processes, scratch
from support.processes import ended_pid


@pytest.fixture
def temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_dir_is_named_after_host_user_and_process(temp: Path) -> None:
    made = scratch.make("launch")
    assert made.parent == temp and made.is_dir()
    assert made.name.startswith(f"dskit-launch-{socket.gethostname()}-{os.getuid()}-{os.getpid()}-")
    assert scratch.prefix("launch", 7) == f"dskit-launch-{socket.gethostname()}-{os.getuid()}-7-"


def test_only_the_dirs_of_ended_processes_of_this_host_and_user_are_removed(temp: Path) -> None:
    gone, me = ended_pid(), os.getpid()
    owner = f"{socket.gethostname()}-{os.getuid()}"
    ended = temp / f"dskit-launch-{owner}-{gone}-abc"
    (ended / "torchrun" / "attempt_0").mkdir(parents=True)  # what a killed launcher leaves: a tree
    running = temp / f"dskit-launch-{owner}-{me}-abc"
    other_host = temp / f"dskit-launch-otherhost-{os.getuid()}-{gone}-abc"  # a temp dir shared between hosts
    other_user = temp / f"dskit-launch-{socket.gethostname()}-{os.getuid() + 1}-{gone}-abc"
    other_kind = temp / f"dskit-watchdog-{owner}-{gone}-29500-0"
    not_a_pid = temp / f"dskit-launch-{owner}-x-abc"
    for directory in (running, other_host, other_user, other_kind, not_a_pid):
        directory.mkdir()
    assert processes.running(me) and not processes.running(gone)
    assert scratch.remove_ended("launch") == [ended]
    assert sorted(temp.iterdir()) == sorted([running, other_host, other_user, other_kind, not_a_pid])
    assert scratch.remove_ended("watchdog") == [other_kind]
