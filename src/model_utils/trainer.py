"""The training loop, split into named steps, over explicit checkpointable state.

Steps are optimizer steps (accumulation boundaries), never micro-batches: `max_steps`, logging, validation and
checkpoint frequencies all count them.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_utils import batches, checkpoint, kernels, launch_record, metrics, startup, trackers, walltime
from model_utils.arguments import TrainConfig, resolve_deepspeed_config
from model_utils.concat_dataset import BlockSampler, DataPosition, validation_indices
from model_utils.distributed import DistInfo, all_reduce_mean, any_rank, decide_on_main, mean_and_max
from model_utils.errors import ConfigError
from model_utils.log import end_progress0, print0, progress0, warn0
from model_utils.models import build_model, training_dtype
from model_utils.preemption import StopRequest, slurm_restart_count
from model_utils.preflight import PreparedRun

LOG_FILE_ENV = "DSKIT_LOG_FILE"  # set by the launchers: the run's log, for the metrics file next to it
STOP_REASON_ENV = "DSKIT_STOP_REASON_FILE"  # set by train.sbatch: why the ranks stopped early (it requeues)


@dataclass
class TrainState:
    """Everything about progress that a resume must restore (model/optimizer/scheduler live in DeepSpeed)."""

    step: int = 0
    tokens_seen: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    run_id: str = ""  # names the run in metrics files and trackers; a resume continues it
    tracker_state: dict[str, Any] = field(default_factory=dict)  # e.g. the MLflow run id
    skipped_steps: int = 0  # optimizer steps DeepSpeed skipped (fp16 overflow), over the whole run

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "position": self.position.to_dict(),
            "run_id": self.run_id,
            "tracker_state": self.tracker_state,
            "skipped_steps": self.skipped_steps,
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
        )


def new_run_id(short_name: str) -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return f"{short_name}-{time.strftime('%Y%m%d-%H%M%S')}" + (f"-job{job}" if job else "")


def metrics_path(setting: str, report_dir: str, run_id: str) -> Path | None:
    """'auto': next to the launcher's log (logs/X.out -> logs/X.metrics.jsonl), else <report_dir>/<run id>."""
    if setting == "none":
        return None
    if setting != "auto":
        return Path(setting)
    log = os.environ.get(LOG_FILE_ENV)
    if log:
        return Path(log).with_suffix(".metrics.jsonl")
    return Path(report_dir) / f"{run_id}.metrics.jsonl"


class Trainer:
    def __init__(self, cfg: TrainConfig, run: PreparedRun, dist: DistInfo) -> None:
        deepspeed = startup.import_deepspeed()

        self.cfg = cfg
        self.run = run
        self.dist = dist
        optim, loop = cfg.optim, cfg.loop
        self.sampler = BlockSampler(
            len(run.train_blocks),
            optim.micro_batch_size,
            optim.gradient_accumulation_steps,
            dist.rank,
            dist.world_size,
            loop.seed,
        )
        if self.sampler.steps_per_epoch == 0:
            raise ConfigError(
                f"train data has {len(run.train_blocks)} blocks, fewer than one global batch of {self.sampler.global_batch} "
                f"(micro batch {optim.micro_batch_size} x accumulation {optim.gradient_accumulation_steps} x "
                f"{dist.world_size} ranks): use more data, fewer ranks or a smaller batch"
            )
        if loop.epochs is not None:
            loop.max_steps = loop.epochs * self.sampler.steps_per_epoch
        self.val_idx = self._validation_indices()
        self.ds_config = resolve_deepspeed_config(cfg, total_steps=loop.max_steps)
        # Weights are identical on every rank (one seed); data order and dropout differ per rank.
        model = build_model(run.source, run.model_config, loop.seed, training_dtype(self.ds_config))
        model = kernels.optimize_model(model, cfg.model, dist.device)
        self.flops_per_token = metrics.flops_per_token(
            run.model_config, cfg.data.seq_length, metrics.matmul_parameters(model)
        )
        self.peak_tflops = metrics.peak_tflops(metrics.device_name(dist.device), cfg.report.peak_tflops)
        torch.manual_seed(loop.seed + dist.rank)
        with startup.cpu_info_computed_once():
            self.engine, _, _, _ = deepspeed.initialize(
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=self.ds_config,
            )
        self.tokens_per_step = self.sampler.global_batch * cfg.data.seq_length
        self.batches = batches.StepBatches(run.train_blocks, self.sampler, dist.device)
        self.launch = launch_record.collect(cfg.to_dict(), self.ds_config, dist.world_size)
        self.state = self._resume_or_start()
        self.s3 = self._s3_tier()
        self.stop = StopRequest()
        self.last_save_time = time.monotonic()
        self.clock = metrics.StepClock()
        self.recent_step_s = 0.0  # seconds per step over the last logged interval
        self.metrics_overhead_s = 0.0
        self.walltime = walltime.WalltimePlanner() if dist.is_main else None
        self.metrics, self.tracker = self._open_reporting()

    # --- set-up steps ---

    def _validation_indices(self) -> np.ndarray | None:
        blocks = self.run.val_blocks
        if blocks is None:
            return None
        mb = self.cfg.optim.micro_batch_size
        idx = validation_indices(
            len(blocks), self.cfg.loop.validation_batches, mb, self.dist.rank, self.dist.world_size
        )
        if len(idx) == 0:
            raise ConfigError(
                f"validation data has {len(blocks)} blocks, fewer than micro batch {mb} x {self.dist.world_size} ranks: "
                "raise --validation_fraction or set it to 0"
            )
        return idx

    def _resume_or_start(self) -> TrainState:
        target = self.run.resume
        if target is None:
            print0(f"No verified checkpoint in {self.cfg.checkpoint.checkpoint_dir}: starting fresh")
            self._start_schedule_at(0)
            return TrainState(
                run_id=decide_on_main(lambda: new_run_id(self.run.source.short_name), self.dist)
            )
        weights_only = launch_record.check_resume(
            target.path, self.run.model_config, self.cfg.data.seq_length, self.dist.world_size
        )
        state = TrainState.from_dict(checkpoint.load(self.engine, target, self.dist.rank, weights_only))
        if weights_only:
            saved = launch_record.read(target.path) or {}
            warn0(
                f"world size changed from {saved.get('world_size')} to {self.dist.world_size}: loaded the weights "
                "only (optimizer state starts fresh; the lr schedule and data position continue)"
            )
            self._start_schedule_at(state.step)
        assert self.engine.global_steps == state.step, (self.engine.global_steps, state.step)
        state.run_id = state.run_id or new_run_id(self.run.source.short_name)  # checkpoints of older kits
        pos = state.position
        print0(
            f"Resumed from {target.path} at step {state.step} "
            f"(epoch {pos.epoch}, block {pos.consumed}, lr {self._lr():.2e})"
        )
        return state

    def _open_reporting(self) -> tuple[metrics.MetricsFile, trackers.Tracker]:
        """Rank 0's metrics file and tracker; a resumed run appends to the same file and continues its run."""
        if not self.dist.is_main:
            return metrics.MetricsFile(None), trackers.NoTracker()
        report = self.cfg.report
        path = metrics_path(report.metrics_file, report.report_dir, self.state.run_id)
        tracker, self.state.tracker_state = trackers.open_tracker(
            report.report_to,
            run_id=self.state.run_id,
            log_dir=Path(report.report_dir),
            config=self.cfg.to_dict(),
            tracking_uri=report.tracking_uri,
            resume_state=self.state.tracker_state or None,
            resume_step=self.state.step if self.run.resume is not None else None,
        )
        print0(
            f"Run {self.state.run_id}: metrics to {path or 'nowhere (--metrics_file none)'}"
            + ("" if report.report_to == "none" else f", {report.report_to} under {report.report_dir}")
        )
        return metrics.MetricsFile(path), tracker

    def _s3_tier(self) -> Any:
        uri = self.cfg.checkpoint.s3_checkpoint_uri
        if uri is None or not self.dist.is_main:
            return None
        from model_utils.s3_tier import S3Tier

        return S3Tier(uri)  # access was checked in preflight, before the first step

    def _start_schedule_at(self, iteration: int) -> None:
        """DeepSpeed's warm-up schedulers start at iteration -1, i.e. lr 0 for the first optimizer step; step
        k should run at iteration k-1 (the warm-up minimum ratio for step 1)."""
        scheduler = self.engine.lr_scheduler
        if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
            scheduler.step(iteration)

    # --- the loop ---

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def train_step(self) -> float:
        """One optimizer step: forward/backward over every micro-batch, DeepSpeed steps at the boundary."""
        self.step_lr = self._lr()  # the lr this step runs at (DeepSpeed advances it after the step)
        fetch_started = time.perf_counter()
        micro_batches = self.batches.at(self.state.position)
        self.clock.data_wait_s += time.perf_counter() - fetch_started
        losses = []
        for batch in micro_batches:
            loss = self.engine(input_ids=batch, labels=batch).loss
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach())
        self.state.step += 1
        assert self.engine.global_steps == self.state.step, (self.engine.global_steps, self.state.step)
        self.state.tokens_seen += self.tokens_per_step
        self.state.position = self.sampler.advance(self.state.position)
        self.state.skipped_steps = int(getattr(self.engine, "skipped_steps", 0))
        # One wait for the device per step, not one per micro-batch.
        loss = torch.stack(losses).double().mean().item()
        self.clock.loss_sum += loss
        self.clock.steps += 1
        return loss

    @torch.no_grad()
    def validate(self) -> float:
        assert self.val_idx is not None
        self.engine.eval()
        total = sum(
            self.engine(input_ids=b, labels=b).loss.item() for b in map(self._val_batch, self.val_idx)
        )
        self.engine.train()
        return all_reduce_mean(total / len(self.val_idx), self.dist.device)

    def _val_batch(self, indices: np.ndarray) -> torch.Tensor:
        assert self.run.val_blocks is not None
        return batches.gather(self.run.val_blocks, indices, pin=False).to(self.dist.device)

    def log_step(self) -> None:
        """The log line, the metrics record and the tracker, for the steps since the previous log line."""
        collect_started = time.perf_counter()
        clock, s, loop = self.clock, self.state, self.cfg.loop
        elapsed = clock.elapsed()
        step_time = clock.step_time()
        alloc, peak, rss = metrics.memory_gib(self.dist.device)
        (loss, data_wait), (alloc, peak, rss) = mean_and_max(
            [clock.loss_sum / clock.steps, clock.data_wait_s / elapsed],
            [alloc or 0.0, peak or 0.0, rss],
            self.dist.device,
        )
        on_gpu = self.dist.device.type == "cuda"
        rate = metrics.throughput(
            self.tokens_per_step * clock.steps,
            elapsed,
            self.dist.world_size,
            self.flops_per_token,
            self.peak_tflops,
        )
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        eta = (loop.max_steps - s.step) * step_time
        record = {
            "step": s.step,
            "loss": loss,
            "lr": self.step_lr,
            "grad_norm": grad_norm,
            "tokens_per_s": rate.tokens_per_s,
            "tokens_per_s_per_device": rate.tokens_per_s_per_device,
            "tflops_per_device": rate.tflops_per_device,
            "mfu": rate.mfu,
            "device_mem_alloc_gib": alloc if on_gpu else None,
            "device_mem_peak_gib": peak if on_gpu else None,
            "host_rss_gib": rss,
            "data_wait_frac": data_wait,
            "step_time_s": step_time,
            "skipped_steps": s.skipped_steps,
            "tokens_seen": s.tokens_seen,
            "epoch": s.position.epoch,
            "consumed": s.position.consumed,
            "eta_s": eta,
        }
        parts = [
            f"Step {s.step}/{loop.max_steps}",
            f"Loss {loss:.4f}",
            f"lr {self.step_lr:.2e}",
            f"grad_norm {grad_norm:.2f}",
            f"tokens/s {rate.tokens_per_s:.0f} ({rate.tokens_per_s_per_device:.0f}/device)",
            f"TFLOPs/device {rate.tflops_per_device:.3g}",
        ]
        if rate.mfu is not None:
            parts.append(f"MFU {100 * rate.mfu:.1f}%")
        if on_gpu:
            parts.append(f"mem {alloc:.1f}/{peak:.1f} GiB")
        parts += [f"RSS {rss:.1f} GiB", f"data {100 * data_wait:.1f}%", f"s/step {step_time:.3f}"]
        if s.skipped_steps:
            parts.append(f"skipped {s.skipped_steps}")
        parts.append(f"ETA {metrics.format_duration(eta)}" + self._time_left())
        print0(" | ".join(parts))
        self.metrics.write(record)
        self.tracker.log_metrics(s.step, record)
        self.clock = metrics.StepClock()
        self.recent_step_s = step_time
        # The log line's own cost, which the next interval's clock does not include.
        self.metrics_overhead_s += time.perf_counter() - collect_started

    def _time_left(self) -> str:
        remaining = self.walltime.remaining() if self.walltime is not None else None
        return "" if remaining is None else f" (job time left {metrics.format_duration(remaining)})"

    def show_progress(self, loss: float) -> None:
        clock, step, total = self.clock, self.state.step, self.cfg.loop.max_steps
        eta = (total - step) * clock.step_time() if clock.steps else float("nan")
        eta_text = metrics.format_duration(eta) if math.isfinite(eta) else "?"
        progress0(step, total, f"loss {loss:.4f} | ETA {eta_text}")

    def log_validation(self) -> None:
        val_loss = self.validate()
        ppl = math.exp(min(val_loss, 50.0))
        print0(
            f"Step {self.state.step}/{self.cfg.loop.max_steps} | Validation Loss {val_loss:.4f} | Perplexity {ppl:.2f}"
        )
        self.metrics.write({"step": self.state.step, "val_loss": val_loss, "val_ppl": ppl})
        self.tracker.log_metrics(self.state.step, {"val_loss": val_loss, "val_ppl": ppl})

    def save_checkpoint(self) -> None:
        started = time.perf_counter()
        tag = checkpoint.checkpoint_tag(self.run.source.short_name, self.state.step)
        request = checkpoint.SaveRequest(
            checkpoint_dir=self.cfg.checkpoint.checkpoint_dir,
            tag=tag,
            step=self.state.step,
            train_state=self.state.to_dict(),
            config=self.cfg.to_dict(),
            launch=self.launch,
        )
        final = checkpoint.save(
            self.engine, request, self.dist.rank, self.run.model_config, self.run.tokenizer
        )
        if final is not None:
            if self.s3 is not None:
                self.s3.upload_async(final)  # in the background: training does not wait
            protect = {self.run.resume.tag} if self.run.resume else set()
            protect |= set(self.s3.pending()) if self.s3 is not None else set()
            checkpoint.rotate(final.parent, self.cfg.checkpoint.keep_checkpoints, protect)
        seconds = time.perf_counter() - started
        if self.walltime is not None:
            self.walltime.record_save(seconds)
        self.metrics.write({"event": "checkpoint", "step": self.state.step, "tag": tag, "save_s": seconds})
        self.last_save_time = time.monotonic()

    def fit(self) -> TrainState:
        loop = self.cfg.loop
        print0(
            f"Training {self.run.source.name} for {loop.max_steps} steps: {self.dist.world_size} ranks x micro batch "
            f"{self.cfg.optim.micro_batch_size} x accumulation {self.cfg.optim.gradient_accumulation_steps} x "
            f"{self.cfg.data.seq_length} tokens = {self.tokens_per_step} tokens/step, "
            f"{self.sampler.steps_per_epoch} steps/epoch"
        )
        self._announce_start()
        self.engine.train()
        if self.state.step >= loop.max_steps:
            print0(f"Nothing to train: already at step {self.state.step} of {loop.max_steps}")
        train_started = time.perf_counter()
        self.clock = metrics.StepClock()
        reason = None
        while self.state.step < loop.max_steps and reason is None:
            loss = self.train_step()
            if self.state.step % loop.logging_freq == 0 or self.state.step == loop.max_steps:
                self.log_step()
            else:
                self.show_progress(loss)
            reason = self.after_step()
        end_progress0()
        self.batches.close()
        self.finish_uploads()
        self._announce_end(reason or "done", time.perf_counter() - train_started)
        self.tracker.close()
        return self.state

    def _announce_start(self) -> None:
        restarts = slurm_restart_count()
        if restarts is not None:
            print0(f"SLURM job {os.environ['SLURM_JOB_ID']}, SLURM_RESTART_COUNT={restarts}")
        resumed = self.run.resume.tag if self.run.resume is not None else None
        self.metrics.write(
            {
                "event": "start",
                "step": self.state.step,
                "run_id": self.state.run_id,
                "resumed_from": resumed,
                "world_size": self.dist.world_size,
                "max_steps": self.cfg.loop.max_steps,
            }
        )
        peak = "unknown: pass --peak_tflops for MFU" if self.peak_tflops is None else f"{self.peak_tflops:g}"
        print0(
            f"FLOPs/token {self.flops_per_token / 1e9:.3g} G (6N + attention); "
            f"{metrics.device_name(self.dist.device)} peak bf16 TFLOP/s {peak}"
        )
        remaining = self.walltime.remaining() if self.walltime is not None else None
        if remaining is not None:
            print0(
                f"Job time limit: {metrics.format_duration(remaining)} left; checkpoints are planned around it"
            )

    def _announce_end(self, reason: str, train_s: float) -> None:
        s = self.state
        self.metrics.write({"event": "end", "step": s.step, "reason": reason})
        if reason == "preempted":
            who = self.stop.signal_name or "another rank"
            print0(f"Preempted: stop requested by {who}; saved at step {s.step}")
        elif reason == "walltime":
            print0(
                f"Stopped at step {s.step} before the job's time limit; saved (a requeued job resumes here)"
            )
        else:
            print0(f"Done: step {s.step}/{self.cfg.loop.max_steps}, {s.tokens_seen} tokens seen")
        if reason != "done" and self.dist.is_main and os.environ.get(STOP_REASON_ENV):
            reason_file = Path(os.environ[STOP_REASON_ENV])
            reason_file.parent.mkdir(parents=True, exist_ok=True)
            reason_file.write_text(reason + "\n")
        if train_s > 0:
            print0(
                f"Metrics overhead: {self.metrics_overhead_s:.3f} s of {train_s:.1f} s training "
                f"({100 * self.metrics_overhead_s / train_s:.2f}%)"
            )

    def after_step(self) -> str | None:
        """Validate and checkpoint when due. Returns why the ranks agreed to stop after this step, or None."""
        paused = time.perf_counter()
        loop, ckpt, step = self.cfg.loop, self.cfg.checkpoint, self.state.step
        last = step == loop.max_steps
        if self.val_idx is not None and (step % loop.validation_freq == 0 or last):
            self.log_validation()
        minutes = (time.monotonic() - self.last_save_time) / 60
        time_due = (
            ckpt.checkpoint_interval_minutes is not None and minutes >= ckpt.checkpoint_interval_minutes
        )
        plan = self._walltime_plan()
        # One collective for every decision: a rank was signalled, its clock says a save is due, or rank 0's
        # walltime plan says save (or save and stop) now.
        stop, time_due, walltime_save, walltime_stop = any_rank(
            [self.stop.signal_name is not None, time_due, plan.save_now, plan.stop_now], self.dist.device
        )
        if step % ckpt.checkpoint_freq == 0 or last or stop or time_due or walltime_save or walltime_stop:
            if walltime_save and not (stop or walltime_stop):
                print0(
                    f"Saving early at step {step}: the next checkpoint would land too close to the time limit"
                )
            self.save_checkpoint()
        self.clock.excluded_s += time.perf_counter() - paused
        if last:
            return None
        if stop:
            return "preempted"
        return "walltime" if walltime_stop else None

    def _walltime_plan(self) -> walltime.Decision:
        if self.walltime is None:
            return walltime.Decision()
        clock = self.clock
        step_time = clock.step_time() if clock.steps else self.recent_step_s
        ckpt, step = self.cfg.checkpoint, self.state.step
        next_save = min(self.cfg.loop.max_steps, (step // ckpt.checkpoint_freq + 1) * ckpt.checkpoint_freq)
        return self.walltime.decide(step, step_time, next_save)

    def finish_uploads(self) -> None:
        if self.s3 is not None and self.s3.pending():
            print0("Waiting for checkpoint uploads to S3 to finish")
            self.s3.wait()  # warns about any tag that failed; the local copy stays
