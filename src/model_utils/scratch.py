"""A launch's temporary dirs on this host, and the removal of those whose launcher is gone.

A launcher keeps its temporary files (the ranks' error file, the ledger pointer, torchrun's log dir, the ranks'
heartbeats) in one dir of the temp dir, named after the host, the user and the launcher's pid, and removes it as it
ends. A launcher that is itself killed (SIGKILL, the OOM killer, a second Ctrl-C's abort) cannot, and torchrun never
removes its own log dir (`torchelastic_*`, one per launch, empty unless a rank's output is redirected; this kit's
test machine had 1,026 of them in /tmp after a day of test runs). The next launch on the host removes the dirs of
launchers no longer running: only this host's and this user's (a temp dir may be shared between hosts), only by the
pid in the name.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from model_utils import processes


def prefix(kind: str, pid: int | None = None) -> str:
    """The start of the name of this host's and user's dirs of `kind`, and of one process's if `pid` is given."""
    owner = f"dskit-{kind}-{socket.gethostname()}-{os.getuid()}-"
    return owner if pid is None else f"{owner}{pid}-"


def make(kind: str) -> Path:
    """A new dir of `kind` for this process, in the temp dir."""
    return Path(tempfile.mkdtemp(prefix=prefix(kind, os.getpid())))


def remove_ended(kind: str) -> list[Path]:
    """This host's and user's dirs of `kind` whose process is no longer running, removed; returns them."""
    owner = prefix(kind)
    removed = []
    for directory in Path(tempfile.gettempdir()).glob(f"{owner}*"):
        pid = directory.name[len(owner) :].split("-", 1)[0]
        if pid.isdigit() and not processes.running(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed
