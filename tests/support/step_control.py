"""A test's hold on when things happen in a real run, instead of racing a log line: an observer the test adds with
`--observers support.step_control:StepControl` (support.torchrun.ENV has tests/ on PYTHONPATH for the ranks),
driven by the environment, so that every rank of any launcher gets it.

- STEP_CONTROL_HOLD=PHASE@STEP[xN][/R] with STEP_CONTROL_DIR=DIR: when the loop enters PHASE of STEP (a watchdog
  phase: data, compute, decision, validation, samples, checkpoint), the rank (rank R alone, with /R) writes
  DIR/held-RANK and waits until it has caught N stop signals (USR1 or INT; default 1), then writes
  DIR/released-RANK. So a test sends its signal once the ranks hold, and it lands in that phase of that step on
  any machine. A rank holds once per DIR: a requeued or resumed run that passes that step again does not (its
  held-RANK is there). A rank still holding after HOLD_LIMIT_S fails the run; a killed or frozen one just stays.
- STEP_CONTROL_SECONDS=S: a turn of the loop starts at least S seconds after the one before (the rank sleeps
  the rest before the step's compute): a signal test run under a slow step, as on a slow machine
  (docs/testing.md).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from model_utils.loop.hooks import Observer
from model_utils.loop.observers.context import LoopContext
from model_utils.observe import watchdog

FLAGS = ["--observers", "support.step_control:StepControl"]
HOLD, HOLD_DIR, STEP_SECONDS = "STEP_CONTROL_HOLD", "STEP_CONTROL_DIR", "STEP_CONTROL_SECONDS"
HOLD_LIMIT_S = 240.0


def env(hold: str, hold_dir: Path) -> dict[str, str]:
    """The variables that hold the ranks of a launch at `hold` (PHASE@STEP[xN][/R]), told in `hold_dir`."""
    hold_dir.mkdir(parents=True, exist_ok=True)
    return {HOLD: hold, HOLD_DIR: str(hold_dir)}


def holding_ranks(hold: str, ranks: int) -> int:
    """How many of `ranks` ranks hold at `hold`: all of them, or one (/R)."""
    return 1 if "/" in hold else ranks


def wait_held(hold_dir: Path, ranks: int, alive: Any = lambda: True, timeout: float = 300) -> None:
    """Until `ranks` ranks hold (DIR/held-*); `alive()` False (the run ended) fails at once."""
    deadline = time.monotonic() + timeout
    while len(list(hold_dir.glob("held-*"))) < ranks:
        assert alive(), (
            f"the run ended before {ranks} ranks held ({sorted(p.name for p in hold_dir.iterdir())})"
        )
        assert time.monotonic() < deadline, f"fewer than {ranks} ranks held within {timeout} s"
        time.sleep(0.02)


class StepControl(Observer):
    def __init__(self, ctx: LoopContext) -> None:
        self.rank = ctx.dist.rank
        self.step_s = float(os.environ.get(STEP_SECONDS) or 0)
        self.hold: tuple[str, int, int] | None = None
        if spec := os.environ.get(HOLD):
            spec, _, rank = spec.partition("/")
            where, _, count = spec.partition("x")
            phase, _, step = where.partition("@")
            assert phase in watchdog.PHASES and step.isdigit(), f"{HOLD}={spec!r} is not PHASE@STEP[xN][/R]"
            self.dir = Path(os.environ[HOLD_DIR])
            if rank in ("", str(self.rank)) and not (self.dir / f"held-{self.rank}").exists():
                self.hold = (phase, int(step), int(count or 1))
        self.signals = 0
        self.last_step: float | None = None  # when the last step's compute began
        if self.hold is not None:  # the trainer's stop handlers are in place: count each signal, pass it on
            for sig in (signal.SIGUSR1, signal.SIGINT):
                signal.signal(sig, self._counting(signal.getsignal(sig)))

    def _counting(self, handler: Any) -> Any:
        def count(signum: int, frame: FrameType | None) -> None:
            self.signals += 1
            handler(signum, frame)

        return count

    def on_phase(self, phase: str, step: int) -> None:
        if self.hold is not None and self.hold[:2] == (phase, step):
            self._held()

    def before_step(self, step: int) -> None:
        if self.step_s:
            if self.last_step is not None:
                time.sleep(max(0.0, self.last_step + self.step_s - time.perf_counter()))
            self.last_step = time.perf_counter()

    def _held(self) -> None:
        assert self.hold is not None
        (self.dir / f"held-{self.rank}").touch()
        deadline = time.monotonic() + HOLD_LIMIT_S
        while self.signals < self.hold[2]:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"step_control: rank {self.rank} held {HOLD_LIMIT_S} s without a stop signal"
                )
            time.sleep(0.01)
        (self.dir / f"released-{self.rank}").touch()
        self.hold = (
            None  # once (the loop enters the data phase of a step twice: its own, the next one's read)
        )
