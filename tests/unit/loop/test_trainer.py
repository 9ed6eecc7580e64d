"""The training loop's pieces that need no run: the id a fresh start gets. The progress a resume restores:
tests/unit/loop/test_state.py. The loop itself, for real: tests/e2e (test_trainer.py and test_hooks.py in-process;
test_training_runs.py, test_guarded_runs.py through torchrun)."""

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
