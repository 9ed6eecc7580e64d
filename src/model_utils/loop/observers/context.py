"""What an observer is built from (observers.build hands it to each observer's `from_loop`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model_utils.engines.base import Engine
    from model_utils.launch.distributed import DistInfo
    from model_utils.loop.hooks import Hooks
    from model_utils.loop.reporter import Reporter
    from model_utils.loop.state import TrainState
    from model_utils.resolve.resolver import ResolvedRun


@dataclass(frozen=True)
class LoopContext:
    """What an observer may be built from: the resolved run, this rank, the engine (the model an evaluator runs),
    the reporter (the run's log line, metrics file and tracker), the loop's hooks (for an observer that tells the
    others, as the checkpointer and the validation do), the state the loop starts at, and what each observer
    saved in the checkpoint it resumes (by name: an observer restores its own from it)."""

    run: ResolvedRun
    dist: DistInfo
    engine: Engine
    reporter: Reporter
    hooks: Hooks
    state: TrainState
    saved: dict[str, dict[str, Any]] = field(default_factory=dict)
    optimizer_groups: list[list[int]] = field(
        default_factory=list
    )  # the decay groups' layout (launch record)
    flatten: bool = False  # the batches hold documents in one flattened row (varlen attention)

    @property
    def start_step(self) -> int:
        return self.state.step
