"""A test's hold on when things happen in a real run, instead of racing a log line: an observer the test adds with
`--observers support.step_control:StepControl` (support.torchrun.ENV has tests/ on PYTHONPATH for the ranks),
driven by the environment, so that every rank of any launcher gets it.

- STEP_CONTROL_HOLD=PHASE@STEP[xN][/R][,...] with STEP_CONTROL_DIR=DIR: when the loop enters PHASE of STEP (a
  watchdog phase: data, compute, decision, validation, samples, checkpoint; or `end`: the loop has ended, its last
  save done, at STEP), the rank (rank R alone, with /R) writes DIR/held-PHASE@STEP-RANK and waits until it has
  caught N stop signals in all (USR1 or INT; default 1), then writes DIR/released-PHASE@STEP-RANK. So a test sends
  its signal once the ranks hold, and it lands in that phase of that step on any machine. A rank holds at each
  once per DIR: a requeued or resumed run that passes that step again does not (its held- file is there). A rank
  still holding after HOLD_LIMIT_S fails the run; a killed or frozen one just stays.
- STEP_CONTROL_SECONDS=S: a turn of the loop starts at least S seconds after the one before (the rank sleeps
  the rest before the step's compute): a signal test run under a slow step, as on a slow machine
  (docs/testing.md).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from model_utils.loop.hooks import Observer
from model_utils.loop.observers.context import LoopContext
from model_utils.loop.state import TrainState
from model_utils.observe import watchdog

FLAGS = ["--observers", "support.step_control:StepControl"]
HOLD, HOLD_DIR, STEP_SECONDS = "STEP_CONTROL_HOLD", "STEP_CONTROL_DIR", "STEP_CONTROL_SECONDS"
HOLD_LIMIT_S = 240.0
END = "end"  # the loop's end (on_end), after its last save


@dataclass(frozen=True)
class Hold:
    phase: str
    step: int
    signals: int  # in all, since the run started
    rank: int | None  # None: every rank

    @classmethod
    def parse(cls, spec: str) -> Hold:
        where, _, rank = spec.partition("/")
        where, _, count = where.partition("x")
        phase, _, step = where.partition("@")
        assert phase in (*watchdog.PHASES, END) and step.isdigit(), (
            f"{HOLD}={spec!r} is not PHASE@STEP[xN][/R]"
        )
        return cls(phase, int(step), int(count or 1), int(rank) if rank else None)

    @property
    def name(self) -> str:
        return f"{self.phase}@{self.step}"


def env(hold: str, hold_dir: Path) -> dict[str, str]:
    """The variables that hold the ranks of a launch at `hold` (PHASE@STEP[xN][/R][,...]), told in `hold_dir`."""
    hold_dir.mkdir(parents=True, exist_ok=True)
    return {HOLD: hold, HOLD_DIR: str(hold_dir)}


def wait_held(
    hold_dir: Path, hold: str, ranks: int = 2, alive: Any = lambda: True, timeout: float = 300
) -> None:
    """Until the ranks of `hold` (its first PHASE@STEP[...]: all `ranks`, or its /R) hold there; `alive()` False
    (the run ended) fails at once."""
    first = Hold.parse(hold.split(",")[0])
    count = ranks if first.rank is None else 1
    deadline = time.monotonic() + timeout
    while len(list(hold_dir.glob(f"held-{first.name}-*"))) < count:
        assert alive(), (
            f"the run ended before {count} ranks held at {first.name}: {sorted(os.listdir(hold_dir))}"
        )
        assert time.monotonic() < deadline, (
            f"fewer than {count} ranks held at {first.name} within {timeout} s"
        )
        time.sleep(0.02)


class StepControl(Observer):
    def __init__(self, ctx: LoopContext) -> None:
        self.rank = ctx.dist.rank
        self.step_s = float(os.environ.get(STEP_SECONDS) or 0)
        self.dir = Path(os.environ.get(HOLD_DIR) or ".")
        holds = [Hold.parse(spec) for spec in filter(None, os.environ.get(HOLD, "").split(","))]
        self.holds = [h for h in holds if h.rank in (None, self.rank) and not self._file("held", h).exists()]
        self.signals = 0
        self.last_step: float | None = None  # when the last step's compute began
        if self.holds:  # the trainer's stop handlers are in place: count each signal, pass it on
            for sig in (signal.SIGUSR1, signal.SIGINT):
                signal.signal(sig, self._counting(signal.getsignal(sig)))

    def _file(self, kind: str, hold: Hold) -> Path:
        return self.dir / f"{kind}-{hold.name}-{self.rank}"

    def _counting(self, handler: Any) -> Any:
        def count(signum: int, frame: FrameType | None) -> None:
            self.signals += 1
            handler(signum, frame)

        return count

    def on_phase(self, phase: str, step: int) -> None:
        self._hold_at(phase, step)

    def on_end(self, state: TrainState, reason: str) -> None:
        self._hold_at(END, state.step)

    def before_step(self, step: int) -> None:
        if self.step_s:
            if self.last_step is not None:
                time.sleep(max(0.0, self.last_step + self.step_s - time.perf_counter()))
            self.last_step = time.perf_counter()

    def _hold_at(self, phase: str, step: int) -> None:
        # Once each (the loop enters the data phase of a step twice: its own, and the next one's read).
        for hold in [h for h in self.holds if (h.phase, h.step) == (phase, step)]:
            self.holds.remove(hold)
            self._file("held", hold).touch()
            deadline = time.monotonic() + HOLD_LIMIT_S
            while self.signals < hold.signals:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"step_control: rank {self.rank} held at {hold.name} {HOLD_LIMIT_S} s without its signal"
                    )
                time.sleep(0.01)
            self._file("released", hold).touch()
