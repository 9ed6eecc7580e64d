"""The reporter: the step clock, the metrics record, the log line, the metrics file and the tracker, in one
component that the trainer closes on every exit path.

Rank 0 writes; other ranks keep the clock (their numbers enter rank 0's line through one collective) and write
nowhere. The log line is rendered from the record by step_line.py; tools read the records (the metrics file, the
run summary: observe/run_summary.py), never the line.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from model_utils import launch_env
from model_utils.engines.base import TRAIN, Objective
from model_utils.engines.step_loss import TokenMean
from model_utils.launch.distributed import DistInfo, mean_and_max
from model_utils.observe import metrics, run_summary, step_line, trackers
from model_utils.observe.log import end_progress0, print0, progress0, progress_shown


def metrics_path(setting: str, report_dir: str, run_id: str) -> Path | None:
    """'auto': next to the launcher's log (logs/X.out -> logs/X.metrics.jsonl), else <report_dir>/<run id>."""
    if setting == "none":
        return None
    if setting != "auto":
        return Path(setting)
    log = os.environ.get(launch_env.LOG_FILE)
    if log:
        return Path(log).with_suffix(".metrics.jsonl")
    return Path(report_dir) / f"{run_id}.metrics.jsonl"


def validation_record(validation: metrics.Validation) -> dict[str, Any]:
    """A validation's metrics record (without its step): the overall score, what it covered and what it took,
    and a mixture's score of each source (step_line.SOURCE_KEYS)."""
    score = validation.score
    if validation.preference is not None:  # a mean over pairs: no perplexity, no bits per byte
        return {
            "val_loss": score.loss,
            **{f"val_{key}": value for key, value in validation.preference.items()},
            "val_pairs": validation.blocks,
            "val_total_blocks": validation.total_blocks,
            "val_s": validation.seconds,
        }
    record: dict[str, Any] = {
        "val_loss": score.loss,
        "val_ppl": score.perplexity,
        "val_bpb": score.bits_per_byte,
        "val_blocks": validation.blocks,
        "val_total_blocks": validation.total_blocks,
        "val_tokens": score.targets,
        "val_s": validation.seconds,
    }
    for name, part in validation.sources:
        values = (part.loss, part.perplexity, part.bits_per_byte, part.targets)
        record.update(
            {f"{key}/{name}": value for key, value in zip(step_line.SOURCE_KEYS, values, strict=True)}
        )
    return record


class Reporter:
    def __init__(
        self,
        config: Any,
        dist: DistInfo,
        max_steps: int,
        tokens_per_step: int,
        flops_per_token: float,
        peak_tflops: float | None,
        objective: Objective | None = None,
    ) -> None:
        self.config, self.dist, self.max_steps = config, dist, max_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.clock = metrics.StepClock()
        self.recent_step_s = 0.0  # seconds per step over the last logged interval
        self.overhead_s = 0.0  # the log lines' own cost, which the clock does not include
        self.metrics = metrics.MetricsFile(None)
        self.tracker: trackers.Tracker = trackers.NoTracker()
        self.output_base: Path | None = None  # rank 0: where the run's files go (the metrics file's path)
        # The engine's objective: its own metrics (a preference objective's rewards) in each line.
        self.objective: Objective = objective or TokenMean()

    def open(self, run_id: str, tracker_state: dict[str, Any], resume_step: int | None) -> dict[str, Any]:
        """Rank 0's metrics file and tracker; a resumed run appends to the same file and continues its tracker
        run. Returns the tracker's state, for the checkpoint."""
        if not self.dist.is_main:
            return tracker_state
        report = self.config.report
        path = metrics_path(report.metrics_file, report.report_dir, run_id)
        self.tracker, tracker_state = trackers.open_tracker(
            report.report_to,
            run_id=run_id,
            log_dir=Path(report.report_dir),
            config=self.config.to_dict(),
            tracking_uri=report.tracking_uri,
            resume_state=tracker_state or None,
            resume_step=resume_step,
            parent_run_id=report.mlflow_parent_run_id,
            wandb_project=report.wandb_project,
        )
        self.metrics = metrics.MetricsFile(path)
        # A profiler trace goes next to the metrics file, or where the file would be when it is off.
        self.output_base = path or metrics_path("auto", report.report_dir, run_id)
        print0(step_line.run_line(run_id, path, report.report_to, report.report_dir))
        mlflow = tracker_state.get("mlflow", {})
        self._summarize(
            {
                "run_id": run_id,
                "metrics_file": None if path is None else str(path.resolve()),
                "mlflow_run_id": mlflow.get("run_id"),
                "max_steps": self.max_steps,
            }
        )
        return tracker_state

    # --- the clock ---

    def restart_clock(self) -> None:
        self.clock = metrics.StepClock()

    def step_clocked(self, report: Any) -> None:
        """A step (loop/hooks.py's StepReport): its seconds and data wait, and a trained one's loss (this rank's
        share: the mean over ranks is the step's loss), targets and the engine's wall-clock breakdown."""
        clock = self.clock
        clock.busy_s += report.seconds
        clock.data_wait_s += report.data_wait_s
        if report.trained:
            clock.loss_sum += report.loss
            clock.trained_tokens += report.trained_tokens
            clock.steps += 1
            for name, ms in report.phase_ms.items():
                clock.phase_ms[name] = clock.phase_ms.get(name, 0.0) + ms

    def step_time(self) -> float:
        """Seconds per step: this interval's, else the last logged interval's."""
        return self.clock.step_time() if self.clock.steps else self.recent_step_s

    # --- output ---

    def log_step(
        self, report: Any, time_left: float | None, data_shares: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """The log line, the metrics record and the tracker, for the steps since the previous log line, at the
        step `report` (loop/hooks.py's StepReport). `data_shares`: a mixture's realised token share of each source
        over the data read so far."""
        started = time.perf_counter()
        state, lr, grad_norm = report.state, report.lr, report.grad_norm
        clock = self.clock
        elapsed = clock.busy_s
        step_time = clock.step_time()
        alloc, peak, rss = metrics.memory_gib(self.dist.device)
        # The objective's metric sums since the last line (the same pairs on every rank under a preference objective:
        # the ratio of the ranks' means is that of their sums).
        objective_sums = self.objective.take(TRAIN)
        (loss, data_wait, trained_tokens, *objective_sums), (alloc, peak, rss) = mean_and_max(
            [
                clock.loss_sum / clock.steps,
                clock.data_wait_s / elapsed,
                float(clock.trained_tokens),
                *objective_sums,
            ],
            [alloc or 0.0, peak or 0.0, rss],
            self.dist.device,
        )
        on_gpu = self.dist.device.type == "cuda"
        rate = metrics.throughput(
            self.tokens_per_step * clock.steps,
            trained_tokens * self.dist.world_size,  # the ranks' mean, times the ranks
            elapsed,
            self.dist.world_size,
            self.flops_per_token,
            self.peak_tflops,
        )
        record = {
            "step": state.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": float("nan") if grad_norm is None else grad_norm,
            "tokens_per_s": rate.tokens_per_s,
            "tokens_per_s_per_device": rate.tokens_per_s_per_device,
            "trained_tokens_per_s": rate.trained_tokens_per_s,
            "tflops_per_device": rate.tflops_per_device,
            "mfu": rate.mfu,
            "device_mem_alloc_gib": alloc if on_gpu else None,
            "device_mem_peak_gib": peak if on_gpu else None,
            "host_rss_gib": rss,
            "data_wait_frac": data_wait,
            "step_time_s": step_time,
            "skipped_steps": report.skipped_steps,
            "tokens_seen": state.tokens_seen,
            "epoch": state.position.epoch,
            "consumed": state.position.consumed,
            "eta_s": (self.max_steps - state.step) * step_time,
            # Of the interval's mean loss, as val_ppl is of val_loss; none of a mean over pairs.
            "ppl": None if objective_sums else metrics.perplexity(loss),
        }
        record.update(self.objective.means(objective_sums))
        record.update({f"{step_line.SHARE}{name}": share for name, share in (data_shares or {}).items()})
        # DeepSpeed's wall-clock breakdown (rank 0's), per optimizer step: e.g. ds_fwd_ms, ds_step_ms.
        record.update({f"ds_{name}_ms": ms / clock.steps for name, ms in clock.phase_ms.items()})
        print0(step_line.step_line(record, self.max_steps, time_left))
        self.metrics.write(record)
        self._summarize({"step": state.step, "train_loss": loss})
        self.tracker.log_metrics(state.step, record)
        self.clock = metrics.StepClock()
        self.recent_step_s = step_time
        self.overhead_s += time.perf_counter() - started
        return record

    def progress(self, step: int, loss: float) -> None:
        if not progress_shown():  # every step: its ETA text alone took 0.04 ms on a 2-core VM
            return
        clock = self.clock
        eta = (self.max_steps - step) * clock.step_time() if clock.steps else float("nan")
        eta_text = step_line.format_duration(eta) if math.isfinite(eta) else "?"
        progress0(step, self.max_steps, f"loss {loss:.4f} | ETA {eta_text}")

    def log_validation(self, step: int, validation: metrics.Validation) -> None:
        record = {"step": step, **validation_record(validation)}
        print0(step_line.validation_line(record, self.max_steps))
        self.metrics.write(record)
        self._summarize({"validation_step": step, "validation_loss": record["val_loss"]})
        self.tracker.log_metrics(step, {k: v for k, v in record.items() if k != "step"})

    def log_samples(self, step: int, samples: list[tuple[str, str]], seconds: float) -> None:
        """Generations from --sample_prompts: (prompt, text) each. Briefly in the log; whole in the metrics file
        (a `samples` event) and the trackers' text."""
        for line in step_line.samples_lines(step, samples, seconds):
            print0(line)
        listed = [{"prompt": prompt, "text": text} for prompt, text in samples]
        self.metrics.write({"event": "samples", "step": step, "sample_s": seconds, "samples": listed})
        self.tracker.log_samples(step, samples)
        self.tracker.log_metrics(step, {"sample_s": seconds})

    def event(self, record: dict[str, Any]) -> None:
        """A record in the metrics file (start, end, checkpoint); a checkpoint and the end in the run summary."""
        self.metrics.write(record)
        if record["event"] == "checkpoint":
            tag_dir = Path(self.config.checkpoint.checkpoint_dir) / record["tag"]
            self._summarize({"checkpoint": str(tag_dir.resolve())})
        elif record["event"] == "end":
            self._summarize({"end": record["reason"], "end_step": record["step"]})

    def _summarize(self, fields: dict[str, Any]) -> None:
        if self.dist.is_main:
            run_summary.update(fields)

    def measured(self, record: dict[str, Any], tracked: dict[str, float]) -> None:
        """An observer's record in the metrics file (a straggler report, a spike guard skip or rollback) and its
        points on the tracker (the report's shares, the guard's counters) at the record's step."""
        self.metrics.write(record)
        self.tracker.log_metrics(int(record["step"]), tracked)

    def artifact(self, path: Path, folder: str) -> None:
        """A file the run wrote (the profiler trace), kept with the tracker's run when it keeps files."""
        self.tracker.log_artifact(path, folder)

    def close(self) -> None:
        """Idempotent; runs on every exit path (the tracker's run is ended, the progress bar cleared)."""
        end_progress0()
        self.metrics.close()
        tracker, self.tracker = self.tracker, trackers.NoTracker()
        tracker.close()
