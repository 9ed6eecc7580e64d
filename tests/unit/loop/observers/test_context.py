"""What an observer is built from: a context of a real resolved run (the tiny preset, the embedded corpus) gives
the run's observers in calling order (the watchdog first, the time limit's say before the checkpointer's save,
the reporter's output last), the profiler, the straggler report and the time limit only on the rank that
writes the run's files (S3 uploads: test_s3_uploads.py); the context cannot be changed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from model_utils.config.arguments import parse_args
from model_utils.engines.step_loss import TokenMean
from model_utils.errors import ConfigError
from model_utils.launch.distributed import DistInfo
from model_utils.loop import observers
from model_utils.loop.hooks import Hooks
from model_utils.loop.observers.context import LoopContext
from model_utils.loop.state import TrainState
from model_utils.resolve import resolver


class Reporter:
    def __init__(self, output_base: Path | None) -> None:
        self.output_base = output_base
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def open(self, run_id: str, tracker: dict, resumed_at: int | None) -> dict:
        return tracker


class Engine:
    title = "DeepSpeed"
    objective = TokenMean()


def context(
    run: resolver.ResolvedRun, dist: DistInfo, output_base: Path | None, step: int = 0
) -> LoopContext:
    return LoopContext(run, dist, Engine(), Reporter(output_base), Hooks(), TrainState(step=step))  # type: ignore[arg-type]


def test_the_runs_observers_from_its_context(tmp_path: Path) -> None:
    flags = ["--max_steps", "4", "--seq_length", "32", "--validation_fraction", "0", "--profile_steps", "2:3"]
    flags += ["--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ck")]
    run = resolver.prepare(parse_args(flags), world_size=2)
    main = DistInfo(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    ctx = context(run, main, tmp_path / "run.metrics.jsonl")
    built = observers.build(ctx)
    assert [type(o).__name__ for o in built] == [
        "Watchdog",
        "Profiler",
        "Guard",
        "Stragglers",
        "Ledger",
        "Walltime",
        "Checkpointer",
        "Reporting",
    ]
    other = context(run, dataclasses.replace(main, rank=1), None)
    assert [type(o).__name__ for o in observers.build(other)] == [
        "Watchdog",
        "Guard",
        "Checkpointer",
        "Reporting",
    ]
    quiet = parse_args([*flags, "--hang_timeout", "0", "--straggler_every", "0"])
    off = dataclasses.replace(ctx, run=resolver.prepare(quiet, world_size=2))
    assert [type(o).__name__ for o in observers.build(off)] == [
        "Profiler",
        "Guard",
        "Ledger",
        "Walltime",
        "Checkpointer",
        "Reporting",
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.state = TrainState(step=2)  # type: ignore[misc]


USER_OBSERVERS = """
from model_utils.loop.hooks import Observer


class Mine(Observer):
    def __init__(self, ctx):
        self.start_step = ctx.start_step


def only_on_rank_1(ctx):
    return Mine(ctx) if ctx.dist.rank == 1 else None


def not_an_observer(ctx):
    return object()
"""


def test_the_users_observers_come_after_the_kits_and_before_the_reporters_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_observers.py").write_text(USER_OBSERVERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = ["--max_steps", "4", "--seq_length", "32", "--validation_fraction", "0", "--hang_timeout", "0"]
    flags += ["--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ck")]
    flags += ["--observers", "user_observers:Mine, user_observers:only_on_rank_1"]
    run = resolver.prepare(parse_args(flags), world_size=2)
    main = DistInfo(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    ctx = context(run, main, None, step=3)
    built = observers.build(ctx)
    kits = ["Guard", "Stragglers", "Ledger", "Walltime", "Checkpointer"]
    assert [type(o).__name__ for o in built] == [*kits, "Mine", "Reporting"]
    assert built[len(kits)].start_step == 3  # type: ignore[attr-defined]
    other = dataclasses.replace(ctx, dist=dataclasses.replace(main, rank=1))
    assert [type(o).__name__ for o in observers.build(other)] == [
        "Guard",
        "Checkpointer",
        "Mine",
        "Mine",
        "Reporting",
    ]

    wrong = dataclasses.replace(
        ctx, run=resolver.prepare(parse_args([*flags, "--observers", "user_observers:not_an_observer"]), 2)
    )
    with pytest.raises(ConfigError) as raised:
        observers.build(wrong)
    assert str(raised.value) == (
        "--observers: user_observers:not_an_observer returned a object, not an Observer: subclass "
        "model_utils.loop.hooks.Observer"
    )
    assert wrong.reporter.closed  # what was made before it is closed: the run's files and tracker


def test_observers_that_cannot_be_imported_are_one_line_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_observers_b.py").write_text(USER_OBSERVERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as raised:
        observers.named((("user_observers_b", "Mine"), ("no_such_package.sub", "Mine")))
    assert str(raised.value) == (
        "--observers no_such_package.sub:Mine: no module named 'no_such_package' on this Python's path: install it "
        "or add its directory to PYTHONPATH (on every node)"
    )
    with pytest.raises(ConfigError) as raised:
        observers.named((("user_observers_b", "Yours"),))
    assert str(raised.value) == (
        f"--observers user_observers_b:Yours: user_observers_b ({tmp_path / 'user_observers_b.py'}) has no class or "
        "function 'Yours': fix the name"
    )


def test_a_validation_only_run_is_watched_and_reported_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--validation_only trains and saves nothing: no profile, upload, push, guard, straggler or ledger record (the
    run whose checkpoint it reads keeps its ledger); the user's observers still see it."""
    (tmp_path / "user_observers.py").write_text(USER_OBSERVERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = [
        "--max_steps",
        "4",
        "--seq_length",
        "32",
        "--validation_fraction",
        "0.003",
        "--profile_steps",
        "2:3",
    ]
    flags += ["--push_to_hub", "me/tiny", "--observers", "user_observers:Mine", "--validation_only", "true"]
    flags += ["--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ck")]
    run = resolver.prepare(parse_args(flags), world_size=2)
    main = DistInfo(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    ctx = context(run, main, tmp_path / "run.metrics.jsonl")
    assert [type(o).__name__ for o in observers.build(ctx)] == ["Watchdog", "Validator", "Mine", "Reporting"]
