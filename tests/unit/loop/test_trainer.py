"""The loop's step without a model: a bare Trainer over a stand-in engine, data and consensus, with observers.
What a step asks of the ranks' one collective, the targets it carries, when evaluations run and what a step's time
holds, where an observer's stop lands. The loop for real: tests/e2e (test_trainer.py and test_hooks.py
in-process; test_training_runs.py, test_guarded_runs.py through torchrun)."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import torch

from model_utils.config.arguments import parse_args
from model_utils.launch.distributed import DistInfo
from model_utils.launch.preemption import StopRequest
from model_utils.loop import hooks, stragglers, trainer
from model_utils.loop.consensus import Agreement
from model_utils.loop.state import TrainState
from model_utils.observe import watchdog


class CountingConsensus:
    """The per-step collective, counted: what every rank would agree given this rank's say (the other rank says
    the same)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float | None, list[bool], object, int | None]] = []

    def agree(self, loss, flags, times=None, targets=None) -> Agreement:  # type: ignore[no-untyped-def]
        self.calls.append((None if loss is None else float(loss), list(flags), times, targets))
        rank_times = None if times is None else (times, times)
        summed = None if targets is None else 2 * targets
        return Agreement(None if loss is None else float(loss), tuple(flags), rank_times, 0.001, summed)


class Engine:
    """An engine's step as the trainer calls it: records the targets it is handed, asks `keep` once the forwards
    ran, applies the step when kept (and `applies`)."""

    def __init__(self, loop: trainer.Trainer, loss: float = 3.0) -> None:
        self.loop, self.loss, self.handed, self.applies = loop, loss, [], True

    def train_step(self, micro_batches, keep, targets=None):  # type: ignore[no-untyped-def]
        self.handed.append(targets)
        kept = keep(torch.tensor(self.loss, dtype=torch.float64))
        return torch.tensor(self.loss), kept and self.applies

    def lr(self) -> float:
        return 1e-3

    def optimizer_steps(self) -> int:
        return self.loop.state.step  # as many as the loop counted

    def grad_norm(self) -> float:
        return 1.0

    def skipped_steps(self) -> int:
        return 0

    def wall_clock_ms(self) -> dict:
        return {}

    def train(self) -> None:
        pass


def bare_trainer(world_size: int, observers: list[hooks.Observer] = (), *flags: str) -> trainer.Trainer:  # type: ignore[assignment]
    """A Trainer at step 7 with `world_size` ranks (this one rank 0), positions as numbers (each step's is the one
    before + 1), 11 targets a step on each rank."""
    loop = object.__new__(trainer.Trainer)
    loop.run = SimpleNamespace(tokens_per_step=64)
    loop.cfg = parse_args(["--max_steps", "100", *flags])
    loop.max_steps = 100
    loop.dist = DistInfo(0, 0, world_size, torch.device("cpu"))
    loop.hooks = hooks.Hooks(observers)
    loop.consensus = CountingConsensus()
    loop.agreement, loop.next_targets = None, None
    loop.step_times = stragglers.StepTimes()
    loop.sampler = SimpleNamespace(advance=lambda position: position + 1)
    loop.batches = SimpleNamespace(
        targets_at=lambda position: 11, at=lambda position: [SimpleNamespace(targets=11)]
    )
    loop.state = TrainState(step=7)
    loop.state.position = 0  # type: ignore[assignment]
    loop.signals = StopRequest()
    loop.engine = Engine(loop)
    return loop


class Judge(hooks.Observer):
    """Judges each step's loss; records what each step's last point was told."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.reports: list[hooks.StepReport] = []

    def keeps(self, step: int, loss: float) -> bool:
        self.losses.append(loss)
        return True

    def at_checkpoint(self, report: hooks.StepReport) -> None:
        self.reports.append(report)


def test_with_two_ranks_each_step_makes_one_collective_for_the_loss_and_the_stop_decision() -> None:
    judge = Judge()
    loop = bare_trainer(2, [judge], "--straggler_every", "1")
    report = loop.step()
    assert report.trained and report.stop is None and judge.losses == [3.0]
    assert len(loop.consensus.calls) == 1 and loop.consensus.calls[0][:2] == (3.0, [False] * 5)
    # A stop signal is this rank's say in the next step's collective; every rank stops after that step.
    loop.signals._handle(signal.SIGUSR1, None)
    report = loop.step()
    loss, flags, times, _ = loop.consensus.calls[-1]
    assert len(loop.consensus.calls) == 2 and loss == 3.0
    assert flags[1] is True and times is not None  # preempted; the window of the turn before rode along
    assert (report.stop, report.stopped_by) == ("preempted", "SIGUSR1") and judge.reports[-1] is report


def test_without_an_observer_that_judges_the_collective_carries_no_loss() -> None:
    loop = bare_trainer(2)
    loop.step()
    assert loop.consensus.calls[0][0] is None


def test_the_step_collective_carries_the_next_steps_target_count_so_that_step_makes_none_of_its_own() -> None:
    """engines/step_loss.py's divisor rides in the turn before's collective (loop/consensus.py): the first step
    counts its own (targets None: the engine's collective), every following one is handed the sum the ranks
    agreed; after a jump of the data (a rollback) the step counts its own again."""
    loop = bare_trainer(2)
    for _ in range(3):
        assert loop.step().trained
    assert loop.engine.handed == [None, 22, 22]  # 11 on each of the two ranks
    assert [call[3] for call in loop.consensus.calls] == [11, 11, 11]  # one collective a step, carrying them
    assert loop.next_targets == (3, 22) and loop.state.step == 10
    loop.state.position = 9  # type: ignore[assignment]  # a rollback: the agreed count is of a step not run next
    loop.step()
    assert loop.engine.handed[-1] is None and len(loop.consensus.calls) == 4


def test_with_one_rank_the_decision_is_taken_after_the_step_without_a_collective() -> None:
    judge = Judge()
    loop = bare_trainer(1, [judge])
    assert loop.step().trained and judge.losses == [3.0]
    # One local decision after the step (StepConsensus exchanges nothing with one rank), none inside it.
    assert [call[0] for call in loop.consensus.calls] == [None]
    assert loop.engine.handed == [None]


class Evaluates(hooks.Observer):
    def __init__(self) -> None:
        self.evaluated: list[int] = []

    def evaluation_due(self, step: int, last: bool, start: bool = False) -> str | None:
        return watchdog.SAMPLES

    def evaluate(self, step: int) -> None:
        self.evaluated.append(step)
        time.sleep(0.05)


def test_an_evaluation_runs_after_a_trained_step_only_and_its_time_is_not_the_steps() -> None:
    evaluates = Evaluates()
    loop = bare_trainer(1, [evaluates])
    loop.engine.applies = False  # discarded: nothing to evaluate
    report = loop.step()
    assert report.outcome == hooks.DISCARDED and evaluates.evaluated == []
    assert loop.state.step == 7 and loop.state.position == 1  # the data is consumed, the step is retried
    loop.engine.applies = True
    report = loop.step()
    assert report.trained and evaluates.evaluated == [8]
    assert report.seconds < 0.05  # left out of tokens/s and s/step, as validation is


class StopsAt(hooks.Observer):
    def __init__(self, step: int) -> None:
        self.at = step

    def after_step(self, report: hooks.StepReport) -> hooks.Stop | None:
        return hooks.Stop("enough", "seen enough") if report.step == self.at else None


def test_an_observers_stop_lands_after_its_step_with_one_rank_and_after_the_next_with_several() -> None:
    one = bare_trainer(1, [StopsAt(8)])
    assert (one.step().stop, one.state.step) == ("enough", 8)
    two = bare_trainer(2, [StopsAt(8)])
    assert two.step().stop is None  # the others learn of it in the next step's collective
    report = two.step()
    assert (report.stop, report.stopped_by, two.state.step) == ("enough", "seen enough", 9)


def test_the_last_step_stops_nobody_a_signal_there_ends_the_run_done() -> None:
    loop = bare_trainer(1)
    loop.state.step = 99
    loop.signals._handle(signal.SIGUSR1, None)
    report = loop.step()
    assert report.last and report.stop is None


class PassesOver(hooks.Observer):
    def __init__(self, *positions: int) -> None:
        self.positions = positions

    def takes(self, position) -> bool:  # type: ignore[no-untyped-def]
        return position not in self.positions


def test_data_an_observer_rules_out_is_passed_over_untrained() -> None:
    seen: list[int] = []
    loop = bare_trainer(1, [PassesOver(0, 1)])
    loop.batches.at = lambda position: seen.append(position) or [SimpleNamespace(targets=11)]
    assert loop.step().trained
    assert seen == [2] and loop.state.position == 3 and loop.state.step == 8
