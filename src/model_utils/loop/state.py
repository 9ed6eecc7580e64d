"""The loop's progress that a resume must restore; the model, optimizer and scheduler live in the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model_utils.data.sampler import DataPosition


@dataclass
class TrainState:
    """Everything about progress that a resume must restore (model/optimizer/scheduler live in the engine)."""

    step: int = 0
    tokens_seen: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    run_id: str = ""  # names the run in metrics files and trackers; a resume continues it
    tracker_state: dict[str, Any] = field(default_factory=dict)  # e.g. the MLflow run id
    skipped_steps: int = 0  # optimizer steps the engine skipped (fp16 overflow), over the whole run
    guard: dict[str, Any] = field(default_factory=dict)  # the spike guard's windows and counters

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "position": self.position.to_dict(),
            "run_id": self.run_id,
            "tracker_state": self.tracker_state,
            "skipped_steps": self.skipped_steps,
            "guard": self.guard,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        return cls(
            step=int(d["step"]),
            tokens_seen=int(d["tokens_seen"]),
            position=DataPosition.from_dict(d["position"]),
            run_id=str(d.get("run_id", "")),
            tracker_state=dict(d.get("tracker_state", {})),
            skipped_steps=int(d.get("skipped_steps", 0)),
            guard=dict(d.get("guard", {})),
        )
