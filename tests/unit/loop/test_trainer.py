"""The training loop's pieces that need no run: the run id. The progress a resume restores:
tests/unit/loop/test_state.py. The loop itself, for real: tests/e2e (test_trainer.py and test_hooks.py in-process;
test_training_runs.py, test_guarded_runs.py through torchrun)."""

from __future__ import annotations

import re

import pytest

from model_utils.loop import trainer


def test_run_id_names_the_model_the_time_and_the_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert re.fullmatch(r"tiny_qwen3-\d{8}-\d{6}", trainer.new_run_id("tiny_qwen3"))
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert re.fullmatch(r"tiny_qwen3-\d{8}-\d{6}-job4711", trainer.new_run_id("tiny_qwen3"))
