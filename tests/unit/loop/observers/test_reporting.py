"""The reporter's output at the loop's points, over a stand-in reporter that writes down what it is asked (the
reporter itself: tests/unit/loop/test_reporter.py; in a real run: tests/e2e/test_hooks.py): what runs, said at
the start; the start, checkpoint and end records; every step clocked (but one a rollback undid); a log line every
--logging_freq steps and at the last step, the progress bar between them; the validation line; the end line; and
the tracker's run ids, its state, continued by a resume."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model_utils.data import mixture
from model_utils.data.sampler import DataPosition
from model_utils.loop import hooks
from model_utils.loop.hooks import SavedCheckpoint, StepReport
from model_utils.loop.observers.reporting import Reporting
from model_utils.loop.state import TrainState
from model_utils.observe import step_line
from model_utils.observe.metrics import Score, Validation

VALIDATION = Validation(Score(2.25 * 32752, 32752, 131008), blocks=16, total_blocks=1777, seconds=2.5)


class Reporter:
    flops_per_token, peak_tflops, overhead_s = 3.6e9, None, 0.01

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def open(self, run_id: str, tracker: dict[str, Any], resumed_at: int | None) -> dict[str, Any]:
        self.calls.append(("open", run_id, resumed_at))
        return tracker or {"tensorboard": {"run_dir": f"logs/{run_id}"}}

    def restart_clock(self) -> None:
        self.calls.append(("restart_clock",))

    def event(self, record: dict[str, Any]) -> None:
        self.calls.append(("event", record))

    def step_clocked(self, report: StepReport) -> None:
        self.calls.append(("step_clocked", report.step, report.outcome))

    def log_step(self, report: StepReport, time_left: float | None, data_shares: dict | None = None) -> None:
        self.calls.append(("log_step", report.step, time_left, data_shares))

    def progress(self, step: int, loss: float) -> None:
        self.calls.append(("progress", step, loss))

    def log_validation(self, step: int, validation: Validation) -> None:
        self.calls.append(("log_validation", step, validation))

    def close(self) -> None:
        self.calls.append(("close",))


class Engine:
    title = "DeepSpeed"


def context(
    reporter: Reporter,
    step: int = 0,
    resumed: str | None = None,
    blocks: Any = None,
    saved: dict[str, Any] | None = None,
    logging_freq: int = 2,
    validation_only: bool = False,
) -> Any:
    loop = types.SimpleNamespace(logging_freq=logging_freq, validation_only=validation_only)
    run = types.SimpleNamespace(
        resume=types.SimpleNamespace(tag=resumed) if resumed else None,
        config=types.SimpleNamespace(loop=loop, lora=types.SimpleNamespace(enabled=False)),
        max_steps=5,
        train_blocks=np.zeros((3, 4)) if blocks is None else blocks,
        source=types.SimpleNamespace(name="tiny_qwen3"),
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        sequence_parallel=1,
        paired=False,
        seq_length=32,
        tokens_per_step=128,
        steps_per_epoch=100,
    )
    dist = types.SimpleNamespace(world_size=2, readers="2 ranks", device=torch.device("cpu"))
    state = TrainState(step=step, run_id="tiny_qwen3-1")
    return types.SimpleNamespace(
        run=run, dist=dist, engine=Engine(), reporter=reporter, state=state, saved=saved or {}
    )


def report(step: int, outcome: str = hooks.TRAINED) -> StepReport:
    return StepReport(step, outcome, 2.5, 1e-3, 0.7, 0.01, 0.2, TrainState(step=step))


def test_each_point_becomes_its_record_or_line(capsys: pytest.CaptureFixture[str]) -> None:
    reporter = Reporter()
    reporting = Reporting(context(reporter, step=2, resumed="t-2steps"), lambda: 600.0)
    reporting.on_start(TrainState(step=2, run_id="tiny_qwen3-1"))
    reporter.calls = [c for c in reporter.calls if c[0] not in ("open", "restart_clock")]
    outcomes = [reporting.after_step(report(s)) for s in (3, 4)]
    outcomes.append(reporting.after_step(report(5, hooks.DISCARDED)))  # no update: no line, no bar
    outcomes.append(reporting.after_step(report(5)))  # the last step is logged whatever the frequency
    assert reporting.after_validation(5, VALIDATION) is None and outcomes == [None] * 4
    reporting.after_checkpoint_saved(SavedCheckpoint(5, "t-5steps", Path("ck/t-5steps"), 1.5))
    reporting.at_checkpoint(report(5))
    reporting.on_end(TrainState(step=5, tokens_seen=640), "done")
    start = {"event": "start", "step": 2, "run_id": "tiny_qwen3-1", "resumed_from": "t-2steps"}
    assert reporter.calls == [
        ("event", {**start, "world_size": 2, "max_steps": 5}),
        ("step_clocked", 3, hooks.TRAINED),
        ("progress", 3, 2.5),
        ("step_clocked", 4, hooks.TRAINED),
        ("log_step", 4, 600.0, None),
        ("step_clocked", 5, hooks.DISCARDED),  # its time counts, its loss does not
        ("step_clocked", 5, hooks.TRAINED),
        ("log_step", 5, 600.0, None),
        ("log_validation", 5, VALIDATION),
        ("event", {"event": "checkpoint", "step": 5, "tag": "t-5steps", "save_s": 1.5}),
        ("event", {"event": "end", "step": 5, "reason": "done"}),
        ("close",),
    ]
    out = capsys.readouterr().out
    assert (
        "Training tiny_qwen3 with DeepSpeed for 5 steps: 2 ranks x micro batch 2 x accumulation 1 x 32 tokens = "
        "128 tokens/step, 100 steps/epoch"
    ) in out
    assert (
        "FLOPs/token 3.6 G (6N + attention); cpu peak bf16 TFLOP/s unknown: pass --peak_tflops for MFU" in out
    )
    assert step_line.done_line(5, 5, 640) in out and "Metrics overhead: 0.010 s of " in out


def test_a_rollback_restarts_the_interval_and_its_step_is_not_clocked() -> None:
    reporter = Reporter()
    reporting = Reporting(context(reporter), lambda: None)
    reporting.after_step(report(1))
    reporting.after_rollback(hooks.Rollback("a spike", must=False))
    reporting.after_step(report(2, hooks.ROLLED_BACK))
    assert [c[:2] for c in reporter.calls[1:]] == [("step_clocked", 1), ("progress", 1), ("restart_clock",)]


def test_the_tracker_run_is_opened_for_the_run_and_continued_by_a_resume() -> None:
    reporter = Reporter()
    fresh = Reporting(context(reporter), lambda: None)
    assert reporter.calls[0] == ("open", "tiny_qwen3-1", None)  # a fresh run: no step to continue at
    assert fresh.state_dict() == {"tracker": {"tensorboard": {"run_dir": "logs/tiny_qwen3-1"}}}
    again = Reporter()
    saved = {"reporting": fresh.state_dict()}
    resumed = Reporting(context(again, step=4, resumed="t-4steps", saved=saved), lambda: None)
    assert again.calls[0] == ("open", "tiny_qwen3-1", 4) and resumed.state_dict() == fresh.state_dict()
    assert resumed.resumed_from == "t-4steps" and resumed.mixture is None


def test_the_end_line_says_why_the_run_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    def ended(reason: str, last: StepReport | None) -> str:
        reporting = Reporting(context(Reporter()), lambda: None)
        if last is not None:
            reporting.at_checkpoint(last)
        capsys.readouterr()
        reporting.on_end(TrainState(step=3), reason)
        return capsys.readouterr().out

    usr1 = dataclasses.replace(
        report(3), requests=frozenset({hooks.PREEMPTED}), stop="preempted", stopped_by="USR1"
    )
    assert step_line.preempted_line(3, "USR1") in ended("preempted", usr1)
    ctrl_c = dataclasses.replace(
        usr1, requests=frozenset({hooks.PREEMPTED, hooks.INTERRUPTED}), stopped_by="INT"
    )
    assert step_line.preempted_line(3, "Ctrl-C") in ended("preempted", ctrl_c)
    assert step_line.preempted_line(3, "another rank") in ended("preempted", report(3))
    assert step_line.walltime_line(3) in ended("walltime", report(3))
    asked = dataclasses.replace(report(3), stop="watchdog", stopped_by="step 3 took 9 s")
    assert step_line.stopped_line(3, "watchdog", "step 3 took 9 s") in ended("watchdog", asked)
    assert step_line.stopped_line(3, "watchdog", "asked on another rank") in ended("watchdog", report(3))
    diverged = ended("diverged", report(3))  # its error line says it all
    assert diverged == ""


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
    reporter = Reporter()
    reporting = Reporting(context(reporter, blocks=mix), lambda: None)
    reporting.on_start(TrainState())
    (start,) = [c[1] for c in reporter.calls if c[0] == "event"]
    assert start["sources"]["web"] == {
        "planned_share": 0.75,
        "epoch_share": 0.75,
        "max_repeat": 1.0,
        "epoch_blocks": 30,
    }
    done = report(2)
    done.state.position = DataPosition(0, 20)
    reporting.after_step(done)
    shares = reporter.calls[-1][-1]
    order = mix.epoch_order(0)[:20]
    assert shares == {"web": np.mean(order < 30), "code": np.mean(order >= 30)}
    assert abs(shares["web"] - 0.75) <= 2 / 20  # interleaved: within two blocks of the share


def test_a_validation_only_run_says_so_in_its_start_record(capsys: pytest.CaptureFixture[str]) -> None:
    reporter = Reporter()
    reporting = Reporting(context(reporter, step=4, resumed="t-4steps", validation_only=True), lambda: None)
    reporting.on_start(TrainState(step=4, run_id="tiny_qwen3-2"))
    reporting.after_validation(4, VALIDATION)
    reporting.on_end(TrainState(step=4), step_line.VALIDATED)
    [(_, start), validation, (_, end)] = [c for c in reporter.calls if c[0] in ("event", "log_validation")]
    assert (start["step"], start["resumed_from"], start["validation_only"]) == (4, "t-4steps", True)
    assert validation == ("log_validation", 4, VALIDATION) and end == {
        "event": "end",
        "step": 4,
        "reason": "validated",
    }
    out = capsys.readouterr().out
    assert step_line.validated_line(4) in out and "Nothing to train" not in out
