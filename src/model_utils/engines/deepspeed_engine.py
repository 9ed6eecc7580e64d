"""DeepSpeed behind the engine seam (engine.py): ZeRO stages, offload and precision come from its config."""

from __future__ import annotations

import contextlib
import io
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model_utils.launch import startup
from model_utils.optim import schedules

# DeepSpeed's global timers (deepspeed.utils.timer): summed over the micro-batches of one optimizer step, and
# reset at its accumulation boundary. Its *_microstep timers hold the last micro-batch only.
WALL_CLOCK_TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
# DeepSpeed counts a discarded step in global_steps; the count of them travels with the checkpoint.
DISCARDED_KEY = "dskit_discarded_steps"


class DeepSpeedEngine:
    # A checkpoint of another world size goes through convert_universal first (trainer._load).
    reshards_on_load = False

    def __init__(
        self,
        model: torch.nn.Module,
        ds_config: dict[str, Any],
        param_groups: list[dict[str, Any]] | None = None,
        lr_scheduler: Callable[[Any], Any] | None = None,
    ) -> None:
        """`param_groups`: the optimizer's parameter groups (param_groups.py); default: one group of every
        trainable parameter. `lr_scheduler`: optimizer -> scheduler, for a schedule DeepSpeed has none of (the
        config then has no scheduler section)."""
        deepspeed = startup.import_deepspeed()
        with startup.cpu_info_computed_once(), startup.schedule_start_unlogged():
            self._engine, _, _, _ = deepspeed.initialize(
                model=model,
                model_parameters=param_groups or [p for p in model.parameters() if p.requires_grad],
                config=ds_config,
                lr_scheduler=lr_scheduler,
            )
        self.module = self._engine.module
        self._discarded = 0  # steps discarded at the caller's request (train_step's `keep`)

    def train_step(
        self, micro_batches: list[torch.Tensor], keep: Callable[[torch.Tensor], bool] | None = None
    ) -> tuple[torch.Tensor, bool]:
        losses = []
        applied = True
        skipped_before = self._engine.skipped_steps
        for i, batch in enumerate(micro_batches):
            loss = self._engine(
                input_ids=batch, labels=batch, use_cache=False
            ).loss  # no KV cache in training
            losses.append(loss.detach())
            if (
                keep is not None
                and i == len(micro_batches) - 1
                and not keep(torch.stack(losses).double().mean())
            ):
                # The earlier micro-batches' gradients already sit in ZeRO's buffers (zero_grad() does not clear
                # them) and step() without a backward fails. A non-finite gradient makes DeepSpeed's own
                # overflow check throw the whole step away instead: weights, optimizer state and lr schedule
                # stay exactly as they were (tests/e2e/test_spike_guard.py; preflight allows the guard only
                # where DeepSpeed checks).
                loss = loss * float("nan")
                applied = False
            with contextlib.nullcontext() if applied else startup.overflow_unlogged():
                self._engine.backward(loss)
                self._engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
        if not applied:
            assert self._engine.skipped_steps == skipped_before + 1, "DeepSpeed applied a discarded step"
            self._discarded += 1
        return torch.stack(losses).double().mean(), applied

    def eval_loss(self, batch: torch.Tensor) -> float:
        return self._engine(input_ids=batch, labels=batch, use_cache=False).loss.item()

    def train(self) -> None:
        self._engine.train()

    def eval(self) -> None:
        self._engine.eval()

    def lr(self) -> float:
        return float(self._engine.get_lr()[0])

    def grad_norm(self) -> float | None:
        norm = self._engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def optimizer_steps(self) -> int:
        return int(self._engine.global_steps) - self._discarded

    def skipped_steps(self) -> int:
        return int(getattr(self._engine, "skipped_steps", 0)) - self._discarded

    def wall_clock_ms(self) -> dict[str, float]:
        if not self._engine.wall_clock_breakdown():
            return {}
        # DeepSpeed caches its timers in every engine.step() before it logs and resets the global ones at the
        # boundary: read after the boundary step, the cache holds this optimizer step's totals.
        cache = self._engine.get_wall_clock_timers()
        return {name: float(cache[name]) for name in WALL_CLOCK_TIMERS if name in cache}

    def start_schedule_at(self, step: int) -> None:
        schedules.start_at(self._engine.lr_scheduler, step)

    def save(self, tag_dir: Path, client_state: dict[str, Any]) -> None:
        state = {
            **client_state,
            # Marks the checkpoint as convertible with deepspeed.checkpoint.ds_to_universal (world-size changes).
            "universal_checkpoint_info": {},
            DISCARDED_KEY: self._discarded,
        }
        # DeepSpeed's own `latest` (a plain write before its last barrier) is never used: checkpoint.py owns it.
        self._engine.save_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, client_state=state, save_latest=False
        )

    def load(self, tag_dir: Path, weights_only: bool, universal: bool = False) -> dict[str, Any] | None:
        # `universal`: tag_dir was written by convert_universal. DeepSpeed reads its `checkpoint.load_universal`
        # config flag only while loading (engine.load_universal_checkpoint()), so it is set for this load
        # alone: a same-world-size resume of an ordinary tag must not see it.
        config = self._engine._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = universal
        try:
            path, client_state = self._engine.load_checkpoint(
                str(tag_dir.parent),
                tag=tag_dir.name,
                load_optimizer_states=not weights_only,
                load_lr_scheduler_states=not weights_only,
            )
        finally:
            config.load_universal_checkpoint = before
        if path is None:
            return None
        self._discarded = int(client_state.get(DISCARDED_KEY, 0))  # global_steps came back with them
        return client_state

    @staticmethod
    def convert_universal(source: Path, output: Path) -> str:
        """Rewrite the checkpoint in `source` (saved at any world size) into `output` in DeepSpeed's universal
        layout (one file per parameter and optimizer state, under output/zero/), which load(universal=True)
        reads at any world size. One process, no collectives; returns DeepSpeed's chatter (progress bars)."""
        from deepspeed.checkpoint import ds_to_universal

        args = types.SimpleNamespace(
            input_folder=str(source),
            output_folder=str(output),
            # Serial: a process pool forked from a rank (threads, a process group) is not safe.
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,  # dskit saves universal_checkpoint_info (save above)
        )
        chatter = io.StringIO()
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
        # main() also writes `latest_universal` beside output with a plain open(); dskit never reads it.
        (output.parent / "latest_universal").unlink(missing_ok=True)
        return chatter.getvalue()

    def close(self) -> None:
        self._engine.destroy()
