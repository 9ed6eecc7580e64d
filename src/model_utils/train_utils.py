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

from model_utils import checkpoint
from model_utils.arguments import TrainConfig, resolve_deepspeed_config
from model_utils.concat_dataset import BlockSampler, DataPosition, validation_indices
from model_utils.distributed import DistInfo, all_reduce_mean
from model_utils.errors import ConfigError
from model_utils.log import print0
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
        self.state = self._resume_or_start()
        self.stop = StopRequest()

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
            print0(f"No checkpoint in {self.cfg.checkpoint.checkpoint_dir}: starting fresh")
            return TrainState()
        state = TrainState.from_dict(checkpoint.load(self.engine, target, self.dist.rank))
        assert self.engine.global_steps == state.step, (self.engine.global_steps, state.step)
        pos = state.position
        print0(
            f"Resumed from {target.load_dir / target.tag} at step {state.step} "
            f"(epoch {pos.epoch}, block {pos.consumed}, lr {self._lr():.2e})"
        )
        return state

    # --- the loop ---

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def _batch(self, blocks: np.ndarray, indices: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(blocks[indices], dtype=np.int64), device=self.dist.device)

    def train_step(self) -> float:
        """One optimizer step: forward/backward over every micro-batch, DeepSpeed steps at the boundary."""
        micro_batches = self.sampler.step_indices(self.state.position)
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
        lr = self._lr()
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
        checkpoint.save(
            self.engine,
            self.cfg.checkpoint.checkpoint_dir,
            tag,
            self.state.to_dict(),
            self.cfg.to_dict(),
            self.dist.rank,
        )

    def fit(self) -> TrainState:
        loop, ckpt = self.cfg.loop, self.cfg.checkpoint
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
        while self.state.step < loop.max_steps:
            interval.loss_sum += self.train_step()
            interval.steps += 1
            step = self.state.step
            if step % loop.logging_freq == 0 or step == loop.max_steps:
                self.log_step(interval)
                interval = Interval()
            if self.val_idx is not None and (step % loop.validation_freq == 0 or step == loop.max_steps):
                self.log_validation()
            saving = step % ckpt.checkpoint_freq == 0 or step == loop.max_steps
            if saving:
                self.save_checkpoint()
            if step < loop.max_steps and self.stop.agreed(self.dist.device):
                if not saving:
                    self.save_checkpoint()
                print0(
                    f"Preempted: stop requested by {self.stop.signal_name or 'another rank'}; saved at step {step}"
                )
                return self.state
        print0(f"Done: step {self.state.step}/{loop.max_steps}, {self.state.tokens_seen} tokens seen")
        return self.state
