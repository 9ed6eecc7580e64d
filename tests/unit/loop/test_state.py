"""The loop's progress a resume restores: through the checkpoint's JSON-safe client state and back, and a
checkpoint of an older kit with the keys added since left out."""

from __future__ import annotations

import json

from model_utils.data.sampler import DataPosition
from model_utils.loop.state import TrainState


def test_train_state_round_trips_through_json() -> None:
    state = TrainState(
        step=12,
        tokens_seen=12 * 4096,
        position=DataPosition(epoch=1, consumed=40),
        run_id="tiny_qwen3-20261126-031500",
        tracker_state={"mlflow_run_id": "abc"},
        skipped_steps=2,
        guard={"losses": [7.1, 7.0]},
    )
    again = TrainState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state


def test_a_checkpoint_of_an_older_kit_resumes_with_the_defaults() -> None:
    """The keys added after the first release (run id, tracker, skipped steps, guard) may be absent."""
    old = {"step": 5, "tokens_seen": 640, "position": DataPosition(epoch=0, consumed=10).to_dict()}
    state = TrainState.from_dict(old)
    assert (state.step, state.tokens_seen, state.position.consumed) == (5, 640, 10)
    assert (state.run_id, state.tracker_state, state.skipped_steps, state.guard) == ("", {}, 0, {})
