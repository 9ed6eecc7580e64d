"""Where the loop starts: a fresh run (its schedule at step 0, said in one line), and a checkpoint another rank's
host lacks (one line, not the engine's assertion). Resumes and rollbacks for real: tests/e2e (test_checkpoints.py,
test_resume_changes.py, test_guarded_runs.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from model_utils.checkpoint.protocol import ResumeTarget
from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.loop import resume


class ScheduleOnly:
    """The one thing a fresh start asks of the engine: its lr schedule at step 0."""

    def __init__(self) -> None:
        self.started_at: list[int] = []

    def start_schedule_at(self, step: int) -> None:
        self.started_at.append(step)


def fresh_start(gloo_rank, capsys, *flags: str):  # type: ignore[no-untyped-def]
    run = SimpleNamespace(resume=None, config=parse_args(list(flags)), source=SimpleNamespace(name="tiny"))
    engine = ScheduleOnly()
    state, saved = resume.start(run, gloo_rank, engine, [])  # type: ignore[arg-type]
    assert engine.started_at == [0] and state.step == 0 and saved == {}
    return state, capsys.readouterr().out


@pytest.mark.parametrize(("flags", "line"), [((), "fresh"), (("--validation_only", "true"), "validat")])
def test_a_fresh_start_starts_the_schedule_at_zero_and_says_so(gloo_rank, capsys, flags, line) -> None:
    _, out = fresh_start(gloo_rank, capsys, *flags)
    assert line in out.lower()


def test_a_fresh_start_is_named_after_what_runs_or_its_run_name(gloo_rank, capsys, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    state, _ = fresh_start(gloo_rank, capsys, "--backend", "fsdp", "--lora_r", "4")
    assert re.fullmatch(r"tiny_qwen3-fsdp-lora-\d{8}-\d{6}", state.run_id)
    assert fresh_start(gloo_rank, capsys, "--run_name", "warmup-sweep.3")[0].run_id == "warmup-sweep.3"


def test_a_checkpoint_missing_on_a_ranks_host_is_one_line_not_the_engines_assertion(
    gloo_rank, tmp_path
) -> None:
    """SageMaker restores each instance's checkpoints/ on its own: rank 0's host may hold a tag another lacks."""
    target = ResumeTarget(tmp_path, "model-8steps")
    with pytest.raises(
        ConfigError, match=r"checkpoint model-8steps is not on the host of ranks \[0\] .*restore"
    ):
        resume._check_every_host_has(target, gloo_rank)
    (tmp_path / "model-8steps").mkdir()
    (tmp_path / "model-8steps" / "dskit_manifest.json").write_text("{}")
    resume._check_every_host_has(target, gloo_rank)  # here: nothing to say
