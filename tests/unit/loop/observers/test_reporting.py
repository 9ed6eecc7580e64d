"""The reporter's output at the loop's points, over a stand-in reporter that writes down what it is asked (the
reporter itself: tests/unit/observe/test_reporter.py; in a real run: tests/e2e/test_hooks.py): the start, checkpoint
and end records, a log line every --logging_freq steps and at the last step, the progress bar between them, the
validation line, and nothing for a step whose update does not stand."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np

from model_utils.data import mixture
from model_utils.data.sampler import DataPosition
from model_utils.loop import hooks
from model_utils.loop.hooks import SavedCheckpoint, StepReport
from model_utils.loop.observers.reporting import Reporting
from model_utils.loop.state import TrainState
from model_utils.observe.metrics import Score, Validation

VALIDATION = Validation(Score(2.25 * 32752, 32752, 131008), blocks=16, total_blocks=1777, seconds=2.5)


class Reporter:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def event(self, record: dict[str, Any]) -> None:
        self.calls.append(("event", record))

    def log_step(
        self,
        state: TrainState,
        lr: float,
        grad_norm: float | None,
        time_left: float | None,
        data_shares: dict[str, float] | None = None,
    ) -> None:
        self.calls.append(("log_step", state.step, lr, grad_norm, time_left, data_shares))

    def progress(self, step: int, loss: float) -> None:
        self.calls.append(("progress", step, loss))

    def log_validation(self, step: int, validation: Validation) -> None:
        self.calls.append(("log_validation", step, validation))


def report(step: int, outcome: str = hooks.TRAINED) -> StepReport:
    return StepReport(step, outcome, 2.5, 1e-3, 0.7, 0.01, 0.2, 600.0, TrainState(step=step))


def test_each_point_becomes_its_record_or_line() -> None:
    reporter = Reporter()
    reporting = Reporting(reporter, logging_freq=2, max_steps=5, world_size=2, resumed_from="t-2steps")  # type: ignore[arg-type]
    reporting.on_start(TrainState(step=2, run_id="tiny_qwen3-1"))
    outcomes = [reporting.after_step(report(s)) for s in (3, 4)]
    outcomes.append(reporting.after_step(report(5, hooks.DISCARDED)))  # no update: no line, no bar
    outcomes.append(reporting.after_step(report(5)))  # the last step is logged whatever the frequency
    assert reporting.after_validation(5, VALIDATION) is None and outcomes == [None] * 4
    reporting.after_checkpoint_saved(SavedCheckpoint(5, "t-5steps", Path("ck/t-5steps"), 1.5))
    reporting.on_end(TrainState(step=5), "done")
    start = {"event": "start", "step": 2, "run_id": "tiny_qwen3-1", "resumed_from": "t-2steps"}
    assert reporter.calls == [
        ("event", {**start, "world_size": 2, "max_steps": 5}),
        ("progress", 3, 2.5),
        ("log_step", 4, 1e-3, 0.7, 600.0, None),
        ("log_step", 5, 1e-3, 0.7, 600.0, None),
        ("log_validation", 5, VALIDATION),
        ("event", {"event": "checkpoint", "step": 5, "tag": "t-5steps", "save_s": 1.5}),
        ("event", {"event": "end", "step": 5, "reason": "done"}),
    ]


def test_from_the_loop_it_reads_the_run_and_the_tag_resumed_from() -> None:
    run = types.SimpleNamespace(
        resume=types.SimpleNamespace(tag="t-4steps"),
        config=types.SimpleNamespace(loop=types.SimpleNamespace(logging_freq=10, validation_only=False)),
        max_steps=100,
        train_blocks=np.zeros((3, 4)),
    )
    ctx = types.SimpleNamespace(run=run, dist=types.SimpleNamespace(world_size=8), reporter=Reporter())
    reporting = Reporting.from_loop(ctx)  # type: ignore[arg-type]
    assert (reporting.logging_freq, reporting.max_steps, reporting.world_size) == (10, 100, 8)
    assert reporting.resumed_from == "t-4steps" and reporting.reporter is ctx.reporter
    run.resume = None
    assert Reporting.from_loop(ctx).resumed_from is None  # type: ignore[arg-type]
    assert reporting.mixture is None


class Blocks:
    seq_length = 4

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_a_mixture_puts_its_plan_in_the_start_record_and_its_shares_read_in_each_logged_step() -> None:
    names, sizes = ["web", "code"], [30, 10]
    mix = mixture.Mixture(
        names, [Blocks(n) for n in sizes], mixture.plan(names, [3, 1], [1, 1], sizes), seed=1
    )
    run = types.SimpleNamespace(
        resume=None,
        config=types.SimpleNamespace(loop=types.SimpleNamespace(logging_freq=2, validation_only=False)),
        max_steps=10,
        train_blocks=mix,
    )
    reporter = Reporter()
    ctx = types.SimpleNamespace(run=run, dist=types.SimpleNamespace(world_size=1), reporter=reporter)
    reporting = Reporting.from_loop(ctx)  # type: ignore[arg-type]
    reporting.on_start(TrainState())
    assert reporter.calls[0][1]["sources"]["web"] == {
        "planned_share": 0.75,
        "epoch_share": 0.75,
        "max_repeat": 1.0,
        "epoch_blocks": 30,
    }
    done = StepReport(2, hooks.TRAINED, 2.5, 1e-3, 0.7, 0.01, 0.2, None, TrainState(step=2))
    done.state.position = DataPosition(0, 20)
    reporting.after_step(done)
    shares = reporter.calls[-1][-1]
    order = mix.epoch_order(0)[:20]
    assert shares == {"web": np.mean(order < 30), "code": np.mean(order >= 30)}
    assert abs(shares["web"] - 0.75) <= 2 / 20  # interleaved: within two blocks of the share


def test_a_validation_only_run_says_so_in_its_start_record() -> None:
    reporter = Reporter()
    reporting = Reporting(reporter, 2, 5, 1, "t-4steps", validation_only=True)  # type: ignore[arg-type]
    reporting.on_start(TrainState(step=4, run_id="tiny_qwen3-2"))
    reporting.after_validation(4, VALIDATION)
    reporting.on_end(TrainState(step=4), "validated")
    [(_, start), validation, (_, end)] = reporter.calls
    assert (start["step"], start["resumed_from"], start["validation_only"]) == (4, "t-4steps", True)
    assert validation == ("log_validation", 4, VALIDATION) and end == {
        "event": "end",
        "step": 4,
        "reason": "validated",
    }
