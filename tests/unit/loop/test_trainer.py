"""The training loop's pieces that need no run: the id a fresh start gets, and the per-step collective (one with
two ranks) over a stand-in consensus. The progress a resume restores: tests/unit/loop/test_state.py. The loop
itself, for real: tests/e2e (test_trainer.py and test_hooks.py in-process; test_training_runs.py,
test_guarded_runs.py through torchrun)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from model_utils.config.arguments import parse_args
from model_utils.loop import trainer


class ScheduleOnly:
    """The one thing a fresh start asks of the engine: its lr schedule at step 0."""

    def __init__(self) -> None:
        self.started_at: list[int] = []

    def start_schedule_at(self, step: int) -> None:
        self.started_at.append(step)


def fresh_state(gloo_rank, *flags: str):
    loop = SimpleNamespace(
        run=SimpleNamespace(resume=None), cfg=parse_args(list(flags)), engine=ScheduleOnly(), dist=gloo_rank
    )
    state = trainer.Trainer._resume_or_start(loop)
    assert loop.engine.started_at == [0] and state.step == 0
    return state


def test_a_fresh_start_is_named_after_what_runs_or_its_run_name(gloo_rank, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert re.fullmatch(
        r"tiny_qwen3-fsdp-lora-\d{8}-\d{6}",
        fresh_state(gloo_rank, "--backend", "fsdp", "--lora_r", "4").run_id,
    )
    assert fresh_state(gloo_rank, "--run_name", "warmup-sweep.3").run_id == "warmup-sweep.3"


def test_a_checkpoint_missing_on_a_ranks_host_is_one_line_not_the_engines_assertion(
    gloo_rank, tmp_path
) -> None:
    """SageMaker restores each instance's checkpoints/ on its own: rank 0's host may hold a tag another lacks."""
    from model_utils.checkpoint.protocol import ResumeTarget
    from model_utils.errors import ConfigError

    this = SimpleNamespace(dist=gloo_rank)
    target = ResumeTarget(tmp_path, "model-8steps")
    with pytest.raises(
        ConfigError, match=r"checkpoint model-8steps is not on the host of ranks \[0\] .*restore"
    ):
        trainer.Trainer._check_every_host_has(this, target)
    (tmp_path / "model-8steps").mkdir()
    (tmp_path / "model-8steps" / "dskit_manifest.json").write_text("{}")
    trainer.Trainer._check_every_host_has(this, target)  # here: nothing to say


class CountingConsensus:
    """The per-step collective, counted: what every rank would agree given this rank's say."""

    def __init__(self) -> None:
        self.calls: list[tuple[float | None, list[bool], object]] = []

    def agree(self, loss, flags, times=None, targets=None):  # type: ignore[no-untyped-def]
        from model_utils.loop.consensus import Agreement

        self.calls.append((None if loss is None else float(loss), list(flags), times, targets))
        rank_times = None if times is None else (times, times)
        summed = None if targets is None else 2 * targets  # the other rank gave as many
        return Agreement(None if loss is None else float(loss), tuple(flags), rank_times, 0.001, summed)


def two_rank_loop(*flags: str) -> SimpleNamespace:
    """A Trainer's state with two ranks and no engine: what _keep, _agree and after_step read."""
    import torch

    from model_utils.launch.distributed import DistInfo
    from model_utils.launch.preemption import StopRequest
    from model_utils.loop import hooks, spike_guard, stragglers
    from model_utils.loop.state import TrainState

    cfg = parse_args(["--max_steps", "100", *flags])
    loop = SimpleNamespace(
        cfg=cfg,
        dist=DistInfo(0, 0, 2, torch.device("cpu")),
        consensus=CountingConsensus(),
        agreement=None,
        step_times=stragglers.StepTimes(),
        guard=spike_guard.SpikeGuard(cfg.guard, "skip"),
        hooks=hooks.Hooks(),
        stop=StopRequest(),
        last_save_time=0.0,
        walltime=None,
        state=TrainState(step=7),
        max_steps=100,
        val_plan=None,
        reporter=SimpleNamespace(
            exclude=lambda seconds: None, data_waited=lambda seconds: None, step_done=lambda *args: None
        ),
        saved=[],
        # Positions as numbers: each step's is the one before + 1; each holds 11 targets on this rank.
        sampler=SimpleNamespace(advance=lambda position: position + 1),
        batches=SimpleNamespace(
            targets_at=lambda position: 11, at=lambda position: [SimpleNamespace(targets=11)]
        ),
        next_targets=None,
        data_wait_s=0.0,
        fault=None,
        run=SimpleNamespace(tokens_per_step=64),
    )
    loop.state.position = 0
    loop.save_checkpoint = lambda: loop.saved.append(loop.state.step)
    for name in (
        "train_step",
        "_waited_for",
        "_keep",
        "_agree",
        "_decision_flags",
        "_walltime_plan",
        "after_step",
    ):
        setattr(loop, name, getattr(trainer.Trainer, name).__get__(loop))
    return loop


def test_with_two_ranks_each_step_makes_one_collective_for_the_loss_and_the_stop_decision() -> None:
    import signal

    import torch

    loop = two_rank_loop("--straggler_every", "2")
    assert loop._keep(torch.tensor(3.5, dtype=torch.float64)) is True  # the guard's loss: no spike
    assert loop.after_step(trained=False) is None  # the decision was in the step's collective: none added
    assert len(loop.consensus.calls) == 1 and loop.consensus.calls[0][:2] == (3.5, [False] * 6)
    assert loop.global_loss == 3.5
    # A stop signal is this rank's say in the next step's collective; every rank stops after that step.
    loop.stop._handle(signal.SIGUSR1, None)
    for _ in range(2):
        loop.step_times.add(0.01, 0.002, 0.05)
    loop._keep(torch.tensor(3.4, dtype=torch.float64))
    loss, flags, times, _ = loop.consensus.calls[-1]
    assert loss == 3.4
    assert flags[0] is True and times is not None  # a straggler window of 2 turns rode along
    assert loop.after_step(trained=False) == "preempted" and len(loop.consensus.calls) == 2
    assert loop.saved == [7]


class AgreedTargetsEngine:
    """An engine's train_step as the trainer calls it: records the targets it is handed, asks keep."""

    def __init__(self, loop: SimpleNamespace) -> None:
        self.loop, self.handed = loop, []

    def train_step(self, micro_batches, keep, targets=None):  # type: ignore[no-untyped-def]
        import torch

        self.handed.append(targets)
        assert keep(torch.tensor(3.0, dtype=torch.float64))
        return torch.tensor(3.0), True

    def lr(self) -> float:
        return 1e-3

    def optimizer_steps(self) -> int:
        return self.loop.state.step  # as many as the loop counted: every step here is applied

    def skipped_steps(self) -> int:
        return 0

    def wall_clock_ms(self) -> dict:
        return {}


def test_the_step_collective_carries_the_next_steps_target_count_so_that_step_makes_none_of_its_own() -> None:
    """engines/step_loss.py's divisor rides in the turn before's collective (loop/consensus.py): the first step
    counts its own (targets None: the engine's collective), every following one is handed the sum the ranks
    agreed; after a jump of the data (a rollback, the guard's skip) the step counts its own again."""
    loop = two_rank_loop()
    loop.hooks = SimpleNamespace(before_step=lambda step: None, on_phase=lambda phase, step: None, stop=None)
    loop.guard = SimpleNamespace(active=False, step_starting=lambda position: None)
    loop.engine = AgreedTargetsEngine(loop)
    for _ in range(3):
        assert loop.train_step()[0] == trainer.APPLIED
    assert loop.engine.handed == [None, 22, 22]  # 11 on each of the two ranks
    assert [call[3] for call in loop.consensus.calls] == [11, 11, 11]  # one collective a step, carrying them
    assert loop.next_targets == (3, 22)
    loop.state.position = 9  # a rollback: the agreed count is of a step that will not run next
    loop.train_step()
    assert loop.engine.handed[-1] is None and len(loop.consensus.calls) == 4


def test_with_one_rank_the_decision_is_taken_after_the_step_without_a_collective() -> None:
    import torch

    from model_utils.launch.distributed import DistInfo

    loop = two_rank_loop()
    loop.dist = DistInfo(0, 0, 1, torch.device("cpu"))
    assert loop._keep(torch.tensor(2.0, dtype=torch.float64)) is True
    assert loop.consensus.calls == []  # the loss is this rank's own
    assert loop.after_step(trained=False) is None
    assert len(loop.consensus.calls) == 1  # a local decision (StepConsensus exchanges nothing with one rank)


def test_an_evaluation_runs_after_a_trained_step_only_and_its_time_is_not_training() -> None:
    import time

    from model_utils.loop import hooks
    from model_utils.observe import watchdog

    evaluated: list[int] = []

    class Slow(hooks.Observer):
        def evaluation_due(self, step: int, last: bool) -> str | None:
            return watchdog.SAMPLES

        def evaluate(self, step: int) -> None:
            evaluated.append(step)
            time.sleep(0.05)

    excluded: list[float] = []
    loop = two_rank_loop()
    loop.val_plans = None
    loop.hooks = hooks.Hooks([Slow()])
    loop.reporter = SimpleNamespace(exclude=excluded.append)
    assert loop.after_step(trained=False) is None
    assert evaluated == [] and excluded[-1] < 0.05
    assert loop.after_step(trained=True) is None
    assert evaluated == [7] and excluded[-1] >= 0.05  # left out of tokens/s and s/step, as validation is
