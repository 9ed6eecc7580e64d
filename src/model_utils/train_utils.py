"""The training loop, split into named steps, over explicit checkpointable state.

Steps are optimizer steps (accumulation boundaries), never micro-batches: `max_steps`, logging, validation and
checkpoint frequencies all count them.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_utils import checkpoint, launch_manifest
from model_utils.arguments import TrainConfig, resolve_deepspeed_config
from model_utils.concat_dataset import BlockSampler, DataPosition, validation_indices
from model_utils.distributed import DistInfo, all_reduce_mean, any_rank
from model_utils.errors import ConfigError
from model_utils.log import print0, warn0
from model_utils.models import build_model
from model_utils.preemption import StopRequest, slurm_restart_count
from model_utils.preflight import PreparedRun


@dataclass
class TrainState:
    """Everything about progress that a resume must restore (model/optimizer/scheduler live in DeepSpeed)."""

    step: int = 0
    tokens_seen: int = 0
    position: DataPosition = field(default_factory=DataPosition)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "position": self.position.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        return cls(
            step=int(d["step"]),
            tokens_seen=int(d["tokens_seen"]),
            position=DataPosition.from_dict(d["position"]),
        )


class MetricsFile:
    """One JSON object per line; rank 0 only. Appends, so a resumed run continues the same file."""

    def __init__(self, path: str | None, is_main: bool) -> None:
        self.path = Path(path) if path and is_main else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def _training_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


@dataclass
class Interval:
    """Accumulates what happened since the last log line."""

    loss_sum: float = 0.0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)


class Trainer:
    def __init__(self, cfg: TrainConfig, run: PreparedRun, dist: DistInfo) -> None:
        import deepspeed

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
        model = build_model(run.source, run.model_config, loop.seed, _training_dtype(self.ds_config))
        torch.manual_seed(loop.seed + dist.rank)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_config,
        )
        self.tokens_per_step = self.sampler.global_batch * cfg.data.seq_length
        self.metrics = MetricsFile(loop.metrics_file, dist.is_main)
        self.launch = launch_manifest.collect(cfg.to_dict(), self.ds_config, dist.world_size)
        self.state = self._resume_or_start()
        self.s3 = self._s3_tier()
        self.stop = StopRequest()
        self.last_save_time = time.monotonic()

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
            return TrainState()
        weights_only = launch_manifest.check_resume(
            target.path, self.run.model_config, self.cfg.data.seq_length, self.dist.world_size
        )
        state = TrainState.from_dict(checkpoint.load(self.engine, target, self.dist.rank, weights_only))
        if weights_only:
            saved = launch_manifest.read(target.path) or {}
            warn0(
                f"world size changed from {saved.get('world_size')} to {self.dist.world_size}: loaded the weights "
                "only (optimizer state starts fresh; the lr schedule and data position continue)"
            )
            self._start_schedule_at(state.step)
        assert self.engine.global_steps == state.step, (self.engine.global_steps, state.step)
        pos = state.position
        print0(
            f"Resumed from {target.path} at step {state.step} "
            f"(epoch {pos.epoch}, block {pos.consumed}, lr {self._lr():.2e})"
        )
        return state

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

    def _batch(self, blocks: np.ndarray, indices: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(blocks[indices], dtype=np.int64), device=self.dist.device)

    def train_step(self) -> float:
        """One optimizer step: forward/backward over every micro-batch, DeepSpeed steps at the boundary."""
        micro_batches = self.sampler.step_indices(self.state.position)
        self.step_lr = self._lr()  # the lr this step runs at (DeepSpeed advances it after the step)
        losses = []
        for indices in micro_batches:
            batch = self._batch(self.run.train_blocks, indices)
            loss = self.engine(input_ids=batch, labels=batch).loss
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.item())
        self.state.step += 1
        assert self.engine.global_steps == self.state.step, (self.engine.global_steps, self.state.step)
        self.state.tokens_seen += self.tokens_per_step
        self.state.position = self.sampler.advance(self.state.position)
        return sum(losses) / len(losses)

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
        return self._batch(self.run.val_blocks, indices)

    def log_step(self, interval: Interval) -> None:
        loss = all_reduce_mean(interval.loss_sum / interval.steps, self.dist.device)
        elapsed = time.perf_counter() - interval.started
        tokens_per_s = self.tokens_per_step * interval.steps / elapsed
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        lr = self.step_lr
        s = self.state
        print0(
            f"Step {s.step}/{self.cfg.loop.max_steps} | Loss {loss:.4f} | lr {lr:.2e} | grad_norm {grad_norm:.2f} "
            f"| tokens/s {tokens_per_s:.0f} | s/step {elapsed / interval.steps:.3f}"
        )
        self.metrics.write(
            {
                "step": s.step,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
                "step_time_s": elapsed / interval.steps,
                "tokens_seen": s.tokens_seen,
                "epoch": s.position.epoch,
                "consumed": s.position.consumed,
            }
        )

    def log_validation(self) -> None:
        val_loss = self.validate()
        ppl = math.exp(min(val_loss, 50.0))
        print0(
            f"Step {self.state.step}/{self.cfg.loop.max_steps} | Validation Loss {val_loss:.4f} | Perplexity {ppl:.2f}"
        )
        self.metrics.write({"step": self.state.step, "val_loss": val_loss, "val_ppl": ppl})

    def save_checkpoint(self) -> None:
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
        self.last_save_time = time.monotonic()

    def fit(self) -> TrainState:
        loop = self.cfg.loop
        print0(
            f"Training {self.run.source.name} for {loop.max_steps} steps: {self.dist.world_size} ranks x micro batch "
            f"{self.cfg.optim.micro_batch_size} x accumulation {self.cfg.optim.gradient_accumulation_steps} x "
            f"{self.cfg.data.seq_length} tokens = {self.tokens_per_step} tokens/step, "
            f"{self.sampler.steps_per_epoch} steps/epoch"
        )
        restarts = slurm_restart_count()
        if restarts is not None:
            print0(f"SLURM job {os.environ['SLURM_JOB_ID']}, SLURM_RESTART_COUNT={restarts}")
        self.engine.train()
        if self.state.step >= loop.max_steps:
            print0(f"Nothing to train: already at step {self.state.step} of {loop.max_steps}")
        interval = Interval()
        stopped = False
        while self.state.step < loop.max_steps and not stopped:
            interval.loss_sum += self.train_step()
            interval.steps += 1
            if self.state.step % loop.logging_freq == 0 or self.state.step == loop.max_steps:
                self.log_step(interval)
                interval = Interval()
            stopped = self.after_step()
        self.finish_uploads()
        if stopped:
            who = self.stop.signal_name or "another rank"
            print0(f"Preempted: stop requested by {who}; saved at step {self.state.step}")
        else:
            print0(f"Done: step {self.state.step}/{loop.max_steps}, {self.state.tokens_seen} tokens seen")
        return self.state

    def after_step(self) -> bool:
        """Validate and checkpoint when due; True when the ranks agreed to stop (preemption) after this step."""
        loop, ckpt, step = self.cfg.loop, self.cfg.checkpoint, self.state.step
        last = step == loop.max_steps
        if self.val_idx is not None and (step % loop.validation_freq == 0 or last):
            self.log_validation()
        minutes = (time.monotonic() - self.last_save_time) / 60
        time_due = (
            ckpt.checkpoint_interval_minutes is not None and minutes >= ckpt.checkpoint_interval_minutes
        )
        # One collective for both: any rank signalled, or any rank's clock says a save is due.
        stop, time_due = any_rank([self.stop.signal_name is not None, time_due], self.dist.device)
        if step % ckpt.checkpoint_freq == 0 or last or stop or time_due:
            self.save_checkpoint()
        return stop and not last

    def finish_uploads(self) -> None:
        if self.s3 is not None and self.s3.pending():
            print0("Waiting for checkpoint uploads to S3 to finish")
            self.s3.wait()  # warns about any tag that failed; the local copy stays
