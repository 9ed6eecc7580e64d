"""The loop's progress a resume restores: through the checkpoint's JSON-safe client state and back; the observers'
states by name, a checkpoint of an older kit's (kept beside the step then) included."""

from __future__ import annotations

import json

from model_utils.data.sampler import DataPosition
from model_utils.loop.state import OBSERVERS, REPORTING, TrainState, observer_states, tracker_ids


def test_train_state_round_trips_through_json() -> None:
    state = TrainState(
        step=12,
        tokens_seen=12 * 4096,
        position=DataPosition(epoch=1, consumed=40),
        run_id="tiny_qwen3-20261126",
    )
    again = TrainState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state


def test_a_checkpoint_of_an_older_kit_resumes_with_the_defaults() -> None:
    """The run id came after the first release; the tracker's and the guard's states were kept beside the step
    before each observer kept its own by name."""
    old = {"step": 5, "tokens_seen": 640, "position": DataPosition(epoch=0, consumed=10).to_dict()}
    state = TrainState.from_dict(old)
    assert (state.step, state.tokens_seen, state.position.consumed, state.run_id) == (5, 640, 10, "")
    assert observer_states(old) == {} and tracker_ids(old) == {}
    older = {**old, "tracker_state": {"mlflow_run_id": "abc"}, "guard": {"losses": [7.1]}}
    assert observer_states(older) == {
        REPORTING: {"tracker": {"mlflow_run_id": "abc"}},
        "spike_guard": {"losses": [7.1]},
    }
    assert tracker_ids(older) == {"mlflow_run_id": "abc"}


def test_the_observers_states_by_name_win_over_an_older_kits_keys() -> None:
    saved = {OBSERVERS: {REPORTING: {"tracker": {"wandb_run_id": "w1"}}, "walltime": {"x": 1}}, "guard": {}}
    assert observer_states(saved) == saved[OBSERVERS]
    assert tracker_ids(saved) == {"wandb_run_id": "w1"}
