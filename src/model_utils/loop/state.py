"""The loop's progress that a resume must restore; the model, optimizer and scheduler live in the engine, and what
an observer keeps (a tracker's run, the spike guard's windows) is its own state, saved by its name beside this
(loop/hooks.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model_utils.data.sampler import DataPosition

OBSERVERS = "observers"  # the checkpoint's train state: the observers' states, by name
REPORTING = "reporting"  # the reporting observer's name: its state holds the tracker's run ids ("tracker")


@dataclass
class TrainState:
    """The step, the tokens seen and the data position, and the run's id, which names it in every record."""

    step: int = 0
    tokens_seen: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    run_id: str = ""  # names the run in metrics files and trackers; a resume continues it

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "position": self.position.to_dict(),
            "run_id": self.run_id,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        return cls(
            step=int(d["step"]),
            tokens_seen=int(d["tokens_seen"]),
            position=DataPosition.from_dict(d["position"]),
            run_id=str(d.get("run_id", "")),
        )


def observer_states(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The observers' states a checkpoint's train state holds, by name; a checkpoint of a kit before they were
    kept by name held the tracker's and the spike guard's beside the step."""
    states = dict(d.get(OBSERVERS) or {})
    if "tracker_state" in d:
        states.setdefault(REPORTING, {"tracker": d["tracker_state"]})
    if d.get("guard"):
        states.setdefault("spike_guard", d["guard"])
    return states


def tracker_ids(d: dict[str, Any]) -> dict[str, Any]:
    """The tracker runs (their ids) a checkpoint's train state continues: what `dskit eval` records into."""
    return dict(observer_states(d).get(REPORTING, {}).get("tracker") or {})
