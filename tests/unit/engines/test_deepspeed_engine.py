"""DeepSpeed behind the seam, what can be checked without building an engine: the timers its wall-clock breakdown
reads are DeepSpeed 0.19's per-optimizer-step totals. The engine training, discarding steps, saving, resuming and
converting to a universal checkpoint: tests/e2e (test_training_runs.py, test_guarded_runs.py, test_checkpoints.py)."""

from __future__ import annotations

from model_utils.engines import deepspeed_engine
from model_utils.launch import startup


def test_the_wall_clock_breakdown_reads_deepspeeds_global_timers() -> None:
    startup.import_deepspeed()
    from deepspeed.runtime import engine

    timers = {name: value for name, value in vars(engine).items() if name.endswith("_TIMER")}
    global_timers = {value for name, value in timers.items() if name.endswith("_GLOBAL_TIMER")}
    # Summed over the micro-batches of one optimizer step; the *_microstep ones hold the last micro-batch only.
    assert set(deepspeed_engine.WALL_CLOCK_TIMERS) == global_timers
    assert not any(name.endswith("_microstep") for name in deepspeed_engine.WALL_CLOCK_TIMERS)
