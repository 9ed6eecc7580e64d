"""The training loop's pieces that need no run: the progress a resume restores (round-tripped through the
checkpoint's JSON-safe client state) and the run id. The loop itself, for real: tests/e2e (test_trainer.py
in-process; test_training_runs.py, test_guarded_runs.py through torchrun)."""

from __future__ import annotations

import json
import re

import pytest

from model_utils.data.sampler import DataPosition
from model_utils.loop import trainer


def test_train_state_round_trips_through_json() -> None:
    state = trainer.TrainState(
        step=12,
        tokens_seen=12 * 4096,
        position=DataPosition(epoch=1, consumed=40),
        run_id="tiny_qwen3-20261126-031500",
        tracker_state={"mlflow_run_id": "abc"},
        skipped_steps=2,
        guard={"losses": [7.1, 7.0]},
    )
    again = trainer.TrainState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state


def test_a_checkpoint_of_an_older_kit_resumes_with_the_defaults() -> None:
    """The keys added after the first release (run id, tracker, skipped steps, guard) may be absent."""
    old = {"step": 5, "tokens_seen": 640, "position": DataPosition(epoch=0, consumed=10).to_dict()}
    state = trainer.TrainState.from_dict(old)
    assert (state.step, state.tokens_seen, state.position.consumed) == (5, 640, 10)
    assert (state.run_id, state.tracker_state, state.skipped_steps, state.guard) == ("", {}, 0, {})


def test_run_id_names_the_model_the_time_and_the_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert re.fullmatch(r"tiny_qwen3-\d{8}-\d{6}", trainer.new_run_id("tiny_qwen3"))
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert re.fullmatch(r"tiny_qwen3-\d{8}-\d{6}-job4711", trainer.new_run_id("tiny_qwen3"))
