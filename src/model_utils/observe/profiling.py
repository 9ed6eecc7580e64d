"""`--profile_steps A:B`: a torch profiler trace of optimizer steps A to B (both included), on rank 0.

Rank 0 only: one file, written by the rank that also writes the log and talks to the tracker. The other ranks
run unprofiled; they wait for rank 0 at each step's collectives, so steps inside the window run at rank 0's
profiled pace (their tokens/s is not the run's). The trace is a Chrome trace, gzipped (traces of large models
run to hundreds of MB): open it in https://ui.perfetto.dev or chrome://tracing as it is.

A job that stops inside the window (preempted, walltime) writes no trace; the requeued job profiles the rest
of the window, and its file name says which steps it holds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from model_utils.observe.log import print0, warn0

TRACE_SUFFIX = ".pt.trace.json.gz"
# Kineto's own log level (read when the profiler first starts): above its highest (USDT, 5), so its lines stay off
# the log: "USDT: ... profiler_start/profiler_stop" at every start and stop, and on CPU ranks "ERROR: ...
# gpuGetDeviceCount failed" (no GPU, as the run already says). A trace that cannot be written still fails in
# export_chrome_trace. A KINETO_LOG_LEVEL set in the environment wins.
KINETO_LOG_LEVEL = ("KINETO_LOG_LEVEL", "6")


def trace_path(metrics_file: Path, first: int, last: int) -> Path:
    """Next to the metrics file: logs/job_123.metrics.jsonl -> logs/job_123.profile-steps3-4.pt.trace.json.gz."""
    stem = metrics_file.name.removesuffix(".jsonl").removesuffix(".metrics")
    return metrics_file.with_name(f"{stem}.profile-steps{first}-{last}{TRACE_SUFFIX}")


class StepProfiler:
    """Starts the profiler before step `first` and writes the trace after step `last`."""

    def __init__(self, window: tuple[int, int], base: Path, device: torch.device, resumed_at: int) -> None:
        first, self.last = window
        self.first = max(first, resumed_at + 1)  # a resumed job profiles what is left of the window
        self.path = trace_path(base, self.first, self.last)
        self.device = device
        self.profiler: Any = None
        self.step_range: Any = None
        if self.first > self.last:
            print0(f"--profile_steps {first}:{self.last}: the run resumed after them, nothing to profile")

    def step_starting(self, step: int) -> None:
        if step == self.first and self.first <= self.last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.environ.setdefault(*KINETO_LOG_LEVEL)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        if self.profiler is not None:
            # Each optimizer step is one named range on the trace's timeline.
            self.step_range = torch.profiler.record_function(f"optimizer_step_{step}")
            self.step_range.__enter__()

    def step_done(self, step: int) -> Path | None:
        """After the step's loss was read (the device is done): the trace's path once step `last` is in it."""
        if self.profiler is None:
            return None
        self._end_step_range()
        if step < self.last:
            return None
        started = time.perf_counter()
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        print0(
            f"Profiled steps {self.first}-{self.last}: {self.path} "
            f"({self.path.stat().st_size / 2**20:.1f} MiB, written in {time.perf_counter() - started:.1f} s)"
        )
        return self.path

    def _end_step_range(self) -> None:
        step_range, self.step_range = self.step_range, None
        if step_range is not None:
            step_range.__exit__(None, None, None)

    def close(self) -> None:
        """A run that stops inside the window: stop profiling, write nothing (idempotent)."""
        self._end_step_range()
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)
            warn0(
                f"the run stopped before step {self.last}: no profiler trace of steps {self.first}-{self.last}"
            )
