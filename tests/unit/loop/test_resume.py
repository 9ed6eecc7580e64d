"""Where the loop starts: a fresh run (its schedule at step 0, said in one line), and a checkpoint another rank's
host lacks (one line, not the engine's assertion). Resumes and rollbacks for real: tests/e2e (test_checkpoints.py,
test_resume_changes.py, test_guarded_runs.py)."""

from __future__ import annotations

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


@pytest.mark.parametrize(("flags", "line"), [((), "fresh"), (("--validation_only", "true"), "validat")])
def test_a_fresh_start_starts_the_schedule_at_zero_and_says_so(gloo_rank, capsys, flags, line) -> None:
    run = SimpleNamespace(resume=None, config=parse_args(list(flags)), source=SimpleNamespace(name="tiny"))
    engine = ScheduleOnly()
    assert resume.start(run, gloo_rank, engine, []) is None  # type: ignore[arg-type]
    assert engine.started_at == [0] and line in capsys.readouterr().out.lower()


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
