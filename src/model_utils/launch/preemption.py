"""Preemption: a signal asks for a checkpoint; all ranks agree on one step to save at, then exit.

SLURM sends USR1 ahead of the time limit or on preemption (`--signal=B:USR1@N`, `scancel --signal=USR1`); the
launcher forwards it to every rank (torchrun does not forward USR1 itself: pytorch/pytorch#154849). A rank that
sees the signal only sets a flag; the decision to stop is collective (`distributed.any_rank` after each step), so
every rank stops after the same step even if the signal reached them at different times.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGUSR1,)


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name


def slurm_restart_count() -> int | None:
    """How often SLURM requeued this job (unset on the first run), or None outside SLURM."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
