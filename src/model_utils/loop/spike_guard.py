"""The spike guard: a step whose loss spikes makes no update; damage seen only after the update is rolled back.

The loss of a step is known before its last backward, so a spike there is skipped before the weights change
(the engine discards the step: engine.py). The gradient norm exists only after DeepSpeed's optimizer step, so
a spike there, or several skips in a row (the model, not one batch, went wrong), can only be undone by going
back to the last verified checkpoint and skipping the data that led there, as large pretraining runs do.

Every rank holds the same guard and feeds it the same numbers (the step's loss averaged across ranks once, and
DeepSpeed's global grad norm), so every rank reaches the same decision without a further collective. Outliers
never enter the windows, and the guard's state travels in every checkpoint.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from model_utils.config.arguments import GuardArgs
from model_utils.data.sampler import DataPosition

# The next action after a step the guard judged.
CONTINUE, ROLLBACK, STOP = "continue", "rollback", "stop"
# Its events, as the metrics file records them and `dskit plot` marks them (a rollback
# event is named as its action); here, not in hooks, so that the plot reads them without importing torch.
SPIKE_SKIP, SPIKE_GRAD_NORM = "spike_skip", "spike_grad_norm"


class Window:
    """The last `size` accepted values of one signal, judged by mean + sigma x standard deviation and, as a
    floor, a ratio to their median."""

    def __init__(self, size: int, values: list[float] | None = None) -> None:
        self.values: deque[float] = deque(values or [], maxlen=size)

    def threshold(self, sigma: float, ratio: float) -> float | None:
        """None until the window is full: a guard judging from three steps would reject the early descent.
        A clean run's grad norm is heavy-tailed: on Python source one step in 400 of the tiny model's is above
        4x its window's median (many sigma above its mean) and one of 20,500 reached 17x, so sigma alone rolled
        healthy runs back; the median floor does not move with the tail, and gradient clipping bounds such a
        step's update (docs/spike-guard.md#calibration). A robust sigma (median absolute deviation) is smaller
        still on such a tail: it judged more clean steps, not fewer."""
        if len(self.values) < (self.values.maxlen or 0):
            return None
        mean = math.fsum(self.values) / len(self.values)
        var = math.fsum((v - mean) ** 2 for v in self.values) / len(self.values)
        return max(mean + sigma * math.sqrt(var), ratio * statistics.median(self.values))


@dataclass(frozen=True)
class Spike:
    signal: str  # "loss" or "grad norm"
    value: float
    threshold: float | None  # None: the value is not finite

    def describe(self) -> str:
        if self.threshold is None:
            return f"{self.signal} is {self.value}"
        return f"{self.signal} {self.value:.4g} above the window's {self.threshold:.4g}"

    def to_dict(self) -> dict[str, Any]:
        return {"signal": self.signal, "value": self.value, "threshold": self.threshold}


def _judge(
    signal: str, value: float, window: Window, sigma: float, ratio: float, judging: bool
) -> Spike | None:
    """A non-finite value is a spike always; a finite one only once `judging` (the warm-up is over)."""
    if not math.isfinite(value):
        return Spike(signal, value, None)
    threshold = window.threshold(sigma, ratio) if judging else None
    return Spike(signal, value, threshold) if threshold is not None and value > threshold else None


def _key(pos: DataPosition) -> tuple[int, int]:
    return pos.epoch, pos.consumed


class SpikeGuard:
    def __init__(self, args: GuardArgs, mode: str) -> None:
        """`mode`: the resolved one (preflight may turn the default off where the engine cannot discard)."""
        self.args, self.mode = args, mode
        self.loss_window = Window(args.spike_window)
        self.grad_window = Window(args.spike_window)
        self.consecutive_skips = 0
        self.skipped_steps = 0  # over the whole run, rolled-back ones included
        self.rollbacks = 0
        # Data ranges [start, end) of positions never to train on: what led to each rollback.
        self.skipped_data: list[tuple[tuple[int, int], tuple[int, int]]] = []
        # Where the recent steps' data started: a rollback skips back this far.
        self.recent: deque[DataPosition] = deque(
            maxlen=args.rollback_skip_steps + args.max_consecutive_skips + 1
        )

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def describe(self) -> str:
        a = self.args
        if not self.active:
            return "Spike guard off"
        watch = (
            f"Spike guard {self.mode}: from step {max(a.spike_warmup_steps, a.spike_window) + 1}, a step whose loss "
            f"is above the last {a.spike_window} steps' mean + {a.spike_sigma:g} sigma and "
            f"{a.spike_loss_ratio:g}x their median (or not finite, at any step) makes no update"
        )
        grad = f"a grad norm above its own window's mean + {a.spike_sigma:g} sigma and {a.spike_grad_norm_ratio:g}x its median"
        if self.mode == "skip":
            return f"{watch}; {grad} is reported; {a.max_consecutive_skips} skips in a row stop the run"
        return (
            f"{watch}; {grad} or {a.max_consecutive_skips} skips in a row roll back to the last verified "
            f"checkpoint (at most {a.max_rollbacks} times), skipping the data of up to {a.rollback_skip_steps} "
            "steps before the spike"
        )

    # --- per step ---

    def step_starting(self, position: DataPosition) -> None:
        self.recent.append(position)

    def judging(self, step: int) -> bool:
        """Whether finite values are judged at optimizer step `step` (1-based): not during the warm-up, whose
        steep descent and growing grad norms are no spikes."""
        return step > self.args.spike_warmup_steps

    def judge_loss(self, step: int, loss: float) -> Spike | None:
        """Before the update of optimizer step `step`: a spike means the step must be discarded."""
        a = self.args
        return _judge("loss", loss, self.loss_window, a.spike_sigma, a.spike_loss_ratio, self.judging(step))

    def step_skipped(self) -> str:
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips < self.args.max_consecutive_skips:
            return CONTINUE
        return ROLLBACK if self.mode == "rollback" else STOP

    def step_applied(self, step: int, loss: float, grad_norm: float | None) -> tuple[Spike | None, str]:
        """After the update of optimizer step `step`: the loss enters its window; a grad-norm spike stays out of
        it and, in rollback mode, asks for a rollback."""
        self.consecutive_skips = 0
        self.loss_window.values.append(loss)
        if grad_norm is None:
            return None, CONTINUE
        a = self.args
        spike = _judge(
            "grad norm",
            grad_norm,
            self.grad_window,
            a.spike_sigma,
            a.spike_grad_norm_ratio,
            self.judging(step),
        )
        if spike is None:
            self.grad_window.values.append(grad_norm)
            return None, CONTINUE
        return spike, ROLLBACK if self.mode == "rollback" else CONTINUE

    def may_roll_back(self) -> bool:
        return self.rollbacks < self.args.max_rollbacks

    # --- data never to train on again ---

    def rolled_back(
        self, saved: dict[str, Any], checkpoint_at: DataPosition, now: DataPosition
    ) -> tuple[DataPosition, DataPosition]:
        """After the engine went back to a checkpoint: the windows as they were then (the steps since will be
        trained again), this run's counters, and a data range to skip: the spike's steps and up to
        --rollback_skip_steps before them, never before the checkpoint. Returns the range."""
        lookback = self.args.rollback_skip_steps + max(self.consecutive_skips, 1)
        candidates = [p for p in list(self.recent)[-lookback:] if _key(p) >= _key(checkpoint_at)]
        start = min(candidates, key=_key, default=checkpoint_at)
        self.skipped_data.append((_key(start), _key(now)))
        self.rollbacks += 1
        self.consecutive_skips = 0
        self.recent.clear()
        self.loss_window = Window(self.args.spike_window, saved.get("loss_window"))
        self.grad_window = Window(self.args.spike_window, saved.get("grad_window"))
        return start, now

    def skips_data_at(self, position: DataPosition) -> bool:
        key = _key(position)
        return any(start <= key < end for start, end in self.skipped_data)

    # --- checkpointed state ---

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_window": list(self.loss_window.values),
            "grad_window": list(self.grad_window.values),
            "consecutive_skips": self.consecutive_skips,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "skipped_data": [[list(start), list(end)] for start, end in self.skipped_data],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume: everything as saved (a checkpoint of an older kit has none: a fresh guard)."""
        if not state:
            return
        self.loss_window = Window(self.args.spike_window, state["loss_window"])
        self.grad_window = Window(self.args.spike_window, state["grad_window"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.skipped_steps = int(state["skipped_steps"])
        self.rollbacks = int(state["rollbacks"])
        self.skipped_data = [(tuple(s), tuple(e)) for s, e in state["skipped_data"]]  # type: ignore[misc]

    def counters(self) -> dict[str, float]:
        """The tracker's view: a point at each skip and rollback."""
        return {"spike_guard/skipped_steps": self.skipped_steps, "spike_guard/rollbacks": self.rollbacks}


@dataclass(frozen=True)
class Replay:
    """What the guard decided on a recorded run: the optimizer steps (1-based) of each kind of verdict."""

    steps: int
    skips: list[int]  # a loss spike: the step makes no update
    grad_norm_spikes: list[int]  # reported in skip mode
    rollbacks: list[int]  # rollback mode: a grad-norm spike, or max_consecutive_skips skips in a row

    def per_10k(self, verdicts: list[int]) -> float:
        return 10_000 * len(verdicts) / self.steps if self.steps else 0.0


def replay(args: GuardArgs, losses: list[float], grad_norms: list[float]) -> Replay:
    """A recorded run's losses and grad norms (one per optimizer step) through a rollback-mode guard, fed as
    the trainer feeds it, to measure its false positives offline (tools/spike_guard_replay.py, the calibration
    test). A recording has no other path: after a skip the next recorded step is judged, and after a rollback
    the guard goes on with its windows as they are (a real run would train the same steps again)."""
    guard = SpikeGuard(args, "rollback")
    skips: list[int] = []
    grad_norm_spikes: list[int] = []
    rollbacks: list[int] = []
    for step, (loss, grad_norm) in enumerate(zip(losses, grad_norms, strict=True), start=1):
        if guard.judge_loss(step, loss) is not None:
            skips.append(step)
            if guard.step_skipped() == ROLLBACK:
                rollbacks.append(step)
                guard.consecutive_skips = 0
            continue
        spike, action = guard.step_applied(step, loss, grad_norm)
        if spike is not None:
            grad_norm_spikes.append(step)
        if action == ROLLBACK:
            rollbacks.append(step)
    return Replay(len(losses), skips, grad_norm_spikes, rollbacks)
