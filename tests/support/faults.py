"""Faults injected into a real run, for the spike guard's and the straggler report's tests: what a corrupted batch,
a bad step or a slow rank does. An observer the test adds with `--observers support.faults:observer` (FLAGS), set by
the environment (`env`), so that every rank of any launcher gets it.

FAULTS is a comma-separated list of `KIND@N`, acting on the N-th step of data this rank draws (every draw counts:
steps whose loss was discarded and steps replayed after a rollback too; data a rollback passes over does not), or
`KIND@N+`, on that one and every later one (damage that does not go away); `/R` after either limits it to rank R
(`slow@1+/1`). KIND is one of:

- `loss`: the step's loss x 1000, in its value and its gradient (a corrupted batch the loss shows);
- `grad`: the gradient x 1000 with the loss value unchanged (damage only the grad norm shows, after the update);
- `drop`: the data is consumed without training: what a step the guard skipped must be equal to;
- `slow`: the rank sleeps SLOW_FRACTION of its recent steps' median time (without the sleeps) inside the step's
  first forward (a throttled device: slow in its compute, after the step's start, where the ranks meet to count
  the step's targets, and before the kit's per-step collective, where the others then wait for it).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from model_utils.data.sampler import DataPosition
from model_utils.loop.hooks import Observer, StepReport, Stop
from model_utils.loop.observers.context import LoopContext

FLAGS = ["--observers", "support.faults:observer"]
FAULTS = "FAULTS"
FACTOR = 1000.0
KINDS = ("loss", "grad", "drop", "slow")
SLOW_FRACTION = 0.2


def env(spec: str) -> dict[str, str]:
    return {FAULTS: spec}


@dataclass(frozen=True)
class Fault:
    kind: str
    first: int
    lasting: bool
    rank: int | None = None  # only on this rank; None: on every rank

    @classmethod
    def parse(cls, spec: str) -> Fault:
        kind, _, where = spec.partition("@")
        where, slash, rank = where.partition("/")
        lasting = where.endswith("+")
        number = where.removesuffix("+")
        ok = kind in KINDS and number.isdigit() and int(number) >= 1 and (not slash or rank.isdigit())
        assert ok, (
            f"{FAULTS}={spec!r} is not KIND@N or KIND@N+ (then /R for rank R only), KIND one of {KINDS}"
        )
        return cls(kind, int(number), lasting, int(rank) if slash else None)

    def hits(self, draw: int) -> bool:
        return draw == self.first or (self.lasting and draw > self.first)


class Faults(Observer):
    """Counts the steps of data drawn and corrupts the loss of the ones a fault names (a forward hook)."""

    def __init__(self, faults: list[Fault], model: torch.nn.Module) -> None:
        self.faults = faults
        self.draws = 0
        self.armed: str | None = None  # the kind corrupting the current step's loss
        self._hook = model.register_forward_hook(self._corrupt)
        self._drawn_at: float | None = None  # when the current step started
        self.step_times: deque[float] = deque(maxlen=20)  # the recent steps' times, without the sleeps
        self._sleep_s = 0.0  # a slow fault's, due in the step's first forward
        self._slept_s = 0.0  # this step's

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Faults | None:
        return cls.from_env(ctx.engine.module, ctx.dist.rank)

    @classmethod
    def from_env(cls, model: torch.nn.Module, rank: int = 0) -> Faults | None:
        parsed = [Fault.parse(part.strip()) for part in os.environ.get(FAULTS, "").split(",") if part.strip()]
        mine = [f for f in parsed if f.rank in (None, rank)]
        return cls(mine, model) if mine else None

    def takes(self, position: DataPosition) -> bool:
        """A step's data is about to be trained on: a `drop` passes over it; a slow one sleeps in its forward."""
        self.draws += 1
        kind = next((f.kind for f in self.faults if f.hits(self.draws)), None)
        if kind == "drop":
            return False
        if kind == "slow":
            self._sleep_s = SLOW_FRACTION * (statistics.median(self.step_times) if self.step_times else 0.0)
        self._slept_s = 0.0
        self._drawn_at = time.perf_counter()
        self.armed = kind if kind in ("loss", "grad") else None
        return True

    def after_step(self, report: StepReport) -> Stop | None:
        self.armed = None  # validation after the step sees the model as it is
        self._sleep_s = 0.0  # a step without a forward (none here) sleeps no later
        if self._drawn_at is not None:
            self.step_times.append(time.perf_counter() - self._drawn_at - self._slept_s)
        return None

    def _corrupt(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._sleep_s > 0:
            time.sleep(self._sleep_s)
            self._slept_s, self._sleep_s = self._sleep_s, 0.0
        if self.armed is not None and getattr(output, "loss", None) is not None:
            loss = output.loss
            if self.armed == "loss":
                output.loss = loss * FACTOR
            else:  # the same value, FACTOR times the gradient
                output.loss = loss + (FACTOR - 1.0) * (loss - loss.detach())
        return output

    def on_close(self) -> None:
        self._hook.remove()


def observer(ctx: LoopContext) -> Faults | None:
    """What --observers calls on each rank: the faults FAULTS names for this rank, else none."""
    return Faults.from_loop(ctx)
