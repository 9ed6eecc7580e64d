"""Preemption and Ctrl-C: a signal asks for a checkpoint; all ranks agree on one step to save at, then exit.

SLURM sends USR1 ahead of the time limit or on preemption (`--signal=B:USR1@N`, `scancel --signal=USR1`); the
launcher forwards it to every rank (torchrun does not forward USR1 itself: pytorch/pytorch#154849). A rank that
sees the signal only sets a flag; the decision to stop is collective (`distributed.any_rank` after each step), so
every rank stops after the same step even if the signal reached them at different times.

SIGINT is Ctrl-C on `./train-singlenode.sh`: the launcher runs the ranks in their own session, so the terminal's
SIGINT reaches the launcher alone (torchrun would otherwise kill the ranks 30 s into their save), and it sends
SIGINT to the ranks, which stop as for USR1. A second SIGINT on a rank ends it at once, without saving or a
traceback.

`install` takes both signals from the entry point's first line on, so a signal during start-up (imports, the
model, the engine) is kept for the StopRequest the trainer makes, instead of killing the rank with a traceback.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGINT)
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C

# The stop signal that came before a StopRequest existed (install's handler), handed to the first one made.
_pending: list[str] = []


def _stop_or_abort(signum: int, already_stopping: bool) -> str:
    if signum == signal.SIGINT and already_stopping:
        os._exit(INTERRUPTED_EXIT)  # a second Ctrl-C: abort now, quietly, without the save
    return signal.Signals(signum).name


def _remember(signum: int, frame: FrameType | None) -> None:
    _pending.append(_stop_or_abort(signum, bool(_pending)))


def install() -> None:
    """Keep a stop signal that arrives before the trainer's StopRequest (the entry point calls this first)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _remember)


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = _pending[0] if _pending else None
        _pending.clear()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = _stop_or_abort(signum, self.signal_name is not None)

    @property
    def interrupted(self) -> bool:
        """Whether the stop is a Ctrl-C (SIGINT) rather than a preemption (USR1)."""
        return self.signal_name == signal.SIGINT.name


def slurm_restart_count() -> int | None:
    """How often SLURM requeued this job (unset on the first run), or None outside SLURM."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process pid has a handler for sig (its SigCgt mask in /proc/PID/status). A launcher sends a rank
    the stop only once it does: a rank still starting (before `install`) would die of USR1 (dskit/launcher/stop.py
    asks it of each rank before it sends a stop)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False  # exited meanwhile
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool((int(line.split()[1], 16) >> (sig - 1)) & 1)
    return False
