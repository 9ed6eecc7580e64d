"""The job's time limit: when it ends, and whether the next checkpoint would still land before it does.

Under SLURM the end time comes from `squeue` (it moves when an admin or `scontrol update` changes the limit, so
it is re-read every few minutes). The plan is made on rank 0 and shared through the loop's one collective.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

REFRESH_S = 300.0
# Left between the end of the last save and the job's end: SLURM kills the job at its limit, not after.
MIN_MARGIN_S = 60.0
# Before the first save is timed: a guess that errs on the early side (checkpoint writes are ~0.2-2 GB/s).
FIRST_SAVE_GUESS_S = 120.0


def slurm_end_time() -> float | None:
    """Unix time at which SLURM ends this job, or None outside SLURM, without a limit, or if squeue fails."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        return datetime.fromisoformat(out).timestamp()  # squeue prints local time without a zone
    except (OSError, subprocess.SubprocessError, ValueError):
        return None  # "N/A"/"NONE" (no limit) or no squeue: nothing to plan against


@dataclass
class Decision:
    save_now: bool = False  # the next regular checkpoint would land too late: save at this step
    stop_now: bool = False  # one more step would leave too little time to save: save and stop


class WalltimePlanner:
    """Decides, after each step, whether the remaining job time forces an early checkpoint or a stop."""

    def __init__(
        self,
        end_time_source: Callable[[], float | None] = slurm_end_time,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = end_time_source
        self.clock = clock
        self.end_time = end_time_source()
        self.read_at = clock()
        self.save_s: float | None = None  # the slowest save so far
        self.early_save_step: int | None = None

    def record_save(self, seconds: float) -> None:
        self.save_s = max(seconds, self.save_s or 0.0)

    def remaining(self) -> float | None:
        now = self.clock()
        if now - self.read_at >= REFRESH_S:
            self.end_time, self.read_at = self.source(), now
        return None if self.end_time is None else self.end_time - now

    def reserve(self, step_time: float) -> float:
        """Seconds that must stay free at the end: one save, plus a margin of at least two steps."""
        save = FIRST_SAVE_GUESS_S if self.save_s is None else self.save_s
        return save + max(MIN_MARGIN_S, 2 * step_time)

    def decide(self, step: int, step_time: float, next_checkpoint_step: int) -> Decision:
        remaining = self.remaining()
        if remaining is None or step_time <= 0:
            return Decision()
        reserve = self.reserve(step_time)
        if remaining - step_time < reserve:
            return Decision(stop_now=True)
        checkpoint_lands_in = (next_checkpoint_step - step) * step_time
        if checkpoint_lands_in > remaining - reserve and self.early_save_step is None:
            self.early_save_step = step
            return Decision(save_now=True)
        return Decision()
