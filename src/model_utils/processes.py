"""Whether a process of this host still runs: the one answer for the kit's stale-holder checks (a checkpoint dir's
lease, a data preparation's lock file, the watchdog's heartbeats, a launcher's temporary dir)."""

from __future__ import annotations

import os
from pathlib import Path


def running(pid: int) -> bool:
    """Whether process `pid` of this host runs: another user's counts; a killed one its parent has not reaped yet
    (a zombie, which `kill -0` still finds) does not: it can hold nothing any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
