"""Learning-rate schedules (--lr_schedule cosine|wsd|linear|constant): their shapes, and how each is run.

cosine and constant are DeepSpeed's own schedulers (WarmupCosineLR, WarmupLR), written into the DeepSpeed config;
DeepSpeed has none for linear decay to a floor or for WSD (warmup-stable-decay), so those two are a torch
LambdaLR over `Schedule.ratio`, handed to deepspeed.initialize. All of them warm up linearly from
WARMUP_MIN_RATIO of the peak (the first step never runs at lr 0), as DeepSpeed's warm-up does. Their state is in
every checkpoint (DeepSpeed saves the scheduler it runs), so a resume continues the exact lr.

WSD trains at the peak lr until the decay starts (`--decay_from_step`, else the last `--decay_fraction` of the
run), then decays to `--min_lr_ratio` of the peak (linear, cosine or sqrt shape). A run still in its stable
phase can be extended by resuming with a larger --max_steps (the decay moves with it), or cooled down from any
checkpoint with --decay_from_step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SCHEDULES = ("cosine", "wsd", "linear", "constant")
DECAY_TYPES = ("linear", "cosine", "sqrt")
CLIENT_SCHEDULES = ("wsd", "linear")  # run as a torch LambdaLR: DeepSpeed has no such scheduler
WARMUP_MIN_RATIO = 0.01


@dataclass(frozen=True)
class Schedule:
    """A schedule the kit runs itself (wsd, linear), as a ratio of the peak lr per optimizer step."""

    kind: str
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float
    decay_start: int  # the first iteration of the decay (linear: the end of the warm-up)
    decay_type: str = "linear"

    def ratio(self, iteration: int) -> float:
        """The lr ratio of the step run after `iteration` completed optimizer steps (0 for step 1)."""
        if iteration < self.warmup_steps:
            return WARMUP_MIN_RATIO + (1 - WARMUP_MIN_RATIO) * iteration / self.warmup_steps
        if iteration < self.decay_start:
            return 1.0
        progress = min(1.0, (iteration - self.decay_start + 1) / max(1, self.total_steps - self.decay_start))
        shape = {
            "linear": progress,
            "cosine": (1 - math.cos(math.pi * progress)) / 2,
            "sqrt": math.sqrt(progress),
        }[self.decay_type]
        return 1.0 - (1.0 - self.min_lr_ratio) * shape

    def describe(self) -> str:
        warmup = f"warm-up {self.warmup_steps} steps, "
        if self.kind == "wsd":
            return (
                f"lr schedule wsd: {warmup}stable to step {self.decay_start}, {self.decay_type} decay to "
                f"{self.min_lr_ratio:g} x peak by step {self.total_steps}"
            )
        return f"lr schedule linear: {warmup}then linear decay to {self.min_lr_ratio:g} x peak by step {self.total_steps}"

    def lambda_lr(self, optimizer: Any) -> Any:
        """The torch scheduler for deepspeed.initialize(lr_scheduler=...): one ratio for every param group."""
        from torch.optim.lr_scheduler import LambdaLR

        return LambdaLR(optimizer, self.ratio)


def client_schedule(
    kind: str,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float,
    decay_fraction: float,
    decay_type: str,
    decay_from_step: int | None,
) -> Schedule:
    assert kind in CLIENT_SCHEDULES, kind
    if kind == "linear":
        decay_start = warmup_steps
    elif decay_from_step is not None:
        decay_start = max(warmup_steps, decay_from_step)
    else:
        decay_start = max(warmup_steps, total_steps - round(decay_fraction * total_steps))
    return Schedule(kind, total_steps, warmup_steps, min_lr_ratio, decay_start, decay_type)


def deepspeed_lr_at(scheduler_section: dict[str, Any], peak_lr: float, iterations: list[int]) -> list[float]:
    """The lr DeepSpeed's own scheduler (a config section with its values filled) gives after each iteration:
    the real class on a one-parameter optimizer, so what is shown is what trains."""
    import torch

    from model_utils.launch import startup

    startup.import_deepspeed()
    from deepspeed.runtime import lr_schedules

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak_lr)
    with startup.schedule_start_unlogged():  # constructed at iteration -1, as in deepspeed.initialize
        scheduler = getattr(lr_schedules, scheduler_section["type"])(optimizer, **scheduler_section["params"])
    out = []
    for iteration in iterations:
        scheduler.step(iteration)
        out.append(float(optimizer.param_groups[0]["lr"]))
    return out


def deepspeed_scheduler(scheduler_section: dict[str, Any], optimizer: Any) -> Any:
    """DeepSpeed's own scheduler class (cosine, constant) on any torch optimizer, constructed at iteration -1 as
    deepspeed.initialize does: what the FSDP engine runs, so both engines train the same lr."""
    from model_utils.launch import startup

    startup.import_deepspeed()
    from deepspeed.runtime import lr_schedules

    with startup.schedule_start_unlogged():
        return getattr(lr_schedules, scheduler_section["type"])(optimizer, **scheduler_section["params"])


def start_at(scheduler: Any, step: int) -> None:
    """Position a scheduler (DeepSpeed's or the kit's LambdaLR) for optimizer step `step + 1`: every engine's
    start_schedule_at (fresh starts and weights-only resumes)."""
    from torch.optim.lr_scheduler import LambdaLR

    # DeepSpeed's warm-up schedulers start at iteration -1, i.e. lr 0 for the first optimizer step; step k
    # should run at iteration k-1 (the warm-up minimum ratio for step 1).
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
        scheduler.step(step)
    elif isinstance(scheduler, LambdaLR) and scheduler.last_epoch != step:
        # A torch scheduler counts completed steps from 0; step k+1 runs at its ratio for k.
        scheduler.last_epoch = step
        lrs = [
            base * ratio(step) for base, ratio in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = lrs
