"""What an observer is built from (observers.build hands it to each observer's `from_loop`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model_utils.engines.base import Engine
    from model_utils.launch.distributed import DistInfo
    from model_utils.observe.reporter import Reporter
    from model_utils.resolve.resolver import ResolvedRun


@dataclass(frozen=True)
class LoopContext:
    """What an observer may be built from: the resolved run, this rank, the engine (the model an evaluator
    runs), the reporter (the run's log line, metrics file and tracker, and the step clock), and the step the loop
    starts at (0, or where it resumed)."""

    run: ResolvedRun
    dist: DistInfo
    engine: Engine
    reporter: Reporter
    start_step: int
