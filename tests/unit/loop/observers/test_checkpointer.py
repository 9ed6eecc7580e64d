"""When the checkpointer saves (due, asked, stopping, on its clock) and the stop reason it leaves the launcher; the
save itself, crash-safe, with every observer's state by name: tests/e2e/test_checkpoints.py, test_hooks.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from model_utils import launch_env
from model_utils.config.arguments import parse_args
from model_utils.loop.hooks import DISCARDED, SAVE, TRAINED, StepReport
from model_utils.loop.observers import checkpointer
from model_utils.loop.state import TrainState


def saver(rank: int = 0, *flags: str) -> tuple[checkpointer.Checkpointer, list[int]]:
    """A checkpointer (every 4 steps unless flags say otherwise) whose saves are recorded, not written."""
    saved: list[int] = []
    c = object.__new__(checkpointer.Checkpointer)
    c.args, c.rank = parse_args(list(flags)).checkpoint, rank
    c.last_save = checkpointer.time.monotonic()
    c.save = lambda state: saved.append(state.step)  # type: ignore[method-assign]
    return c, saved


def report(step: int, outcome: str = TRAINED, **kw) -> StepReport:  # type: ignore[no-untyped-def]
    return StepReport(step, outcome, 1.0, 1e-3, None, 0.0, 1.0, TrainState(step=step), **kw)


def test_a_save_is_due_every_checkpoint_freq_trained_steps_and_after_the_last() -> None:
    c, saved = saver(0, "--checkpoint_freq", "4")
    for step in range(1, 9):
        c.at_checkpoint(report(step))
    c.at_checkpoint(report(8, DISCARDED))  # a discarded turn at a due step saves nothing again
    c.at_checkpoint(report(9, last=True))
    assert saved == [4, 8, 9]


def test_an_agreed_save_or_stop_saves_now_and_a_stop_tells_the_launcher_why(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(launch_env.STOP_REASON_FILE, str(tmp_path / "run" / "stop_reason"))
    c, saved = saver(0, "--checkpoint_freq", "100")
    c.at_checkpoint(report(3, requests=frozenset({SAVE})))
    assert saved == [3] and not (tmp_path / "run").exists()
    c.at_checkpoint(report(5, DISCARDED, stop="preempted"))  # a stop saves whatever became of its step
    assert saved == [3, 5] and (tmp_path / "run" / "stop_reason").read_text() == "preempted\n"


def test_only_rank_0_writes_the_stop_reason(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(launch_env.STOP_REASON_FILE, str(tmp_path / "stop_reason"))
    c, saved = saver(1)
    c.at_checkpoint(report(5, stop="walltime"))
    assert saved == [5] and not (tmp_path / "stop_reason").exists()


def test_the_clock_asks_every_rank_for_a_save_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(checkpointer, "time", SimpleNamespace(monotonic=lambda: now[0]))
    c, _ = saver(0, "--checkpoint_interval_minutes", "10")
    assert c.requests(1) == set()
    now[0] += 600.0
    assert c.requests(2) == {SAVE}
    off, _ = saver(0)
    assert off.requests(2) == set()  # no interval: only the steps decide
