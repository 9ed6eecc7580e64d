"""Learning-rate schedules (--lr_schedule cosine|wsd|linear|constant): their shapes, and how each is run.

cosine and constant are DeepSpeed's own schedulers (WarmupCosineLR, WarmupLR); DeepSpeed has none for linear decay
to a floor or for WSD (warmup-stable-decay), so those two are a torch LambdaLR over `Schedule.ratio`. All of them
warm up linearly from WARMUP_MIN_RATIO of the peak (the first step never runs at lr 0), as DeepSpeed's warm-up
does. Their state is in every checkpoint, so a resume continues the exact lr.

The schedule that trains is a `ScheduleSpec`, resolved once (optim/settings.py) from the flags and the
DeepSpeed-format config; both engines run it as the same scheduler (`ScheduleSpec.torch_scheduler`: DeepSpeed's
class for cosine, constant and a config's own scheduler, the kit's LambdaLR for wsd and linear), the DeepSpeed
engine through its JSON where DeepSpeed has the class (`deepspeed_section`). `dskit config` and `dskit plot` read
the lr from the same spec (`lr_at`).

WSD trains at the peak lr until the decay starts (`--decay_from_step`, else the last `--decay_fraction` of the
run), then decays to `--min_lr_ratio` of the peak (linear, cosine or sqrt shape). A run still in its stable
phase can be extended by resuming with a larger --max_steps (the decay moves with it), or cooled down from any
checkpoint with --decay_from_step.

A resume keeps the warm-up its checkpoint ran (`ScheduleSpec.resumed`; launch.json records it): a --warmup_ratio is
never recomputed from a changed --max_steps. A changed --max_steps reshapes only the decay, to end at the new last
step, and `resume_line` announces it with the lr of the next step before and after the change. A resume with
another --lr_schedule (`switches_from`) runs the new schedule from the loaded step: the optimizer state is kept,
the old scheduler's state is not loaded (another class: it would not load), and `resume_line` says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_utils.config.arguments import AUTO
from model_utils.errors import ConfigError

CLIENT_SCHEDULES = ("wsd", "linear")  # run as a torch LambdaLR: DeepSpeed has no such scheduler
WARMUP_MIN_RATIO = 0.01
NONE = "none"  # a DeepSpeed-format config without a scheduler (and no --lr_schedule): a constant lr
WITHOUT_DECAY = ("constant", NONE)
COSINE_TYPE = "WarmupCosineLR"
# --lr_schedule cosine where the config has no scheduler section: DeepSpeed's WarmupCosineLR, warming up linearly.
COSINE_SECTION = {
    "type": COSINE_TYPE,
    "params": {
        "warmup_min_ratio": WARMUP_MIN_RATIO,
        "warmup_num_steps": AUTO,
        "cos_min_ratio": AUTO,
        "warmup_type": "linear",
        "total_num_steps": AUTO,
    },
}
WARMUP_PARAM, TOTAL_PARAM, COS_MIN_PARAM = "warmup_num_steps", "total_num_steps", "cos_min_ratio"


def constant_section(lr: float) -> dict[str, Any]:
    """--lr_schedule constant: DeepSpeed's WarmupLR from WARMUP_MIN_RATIO of the peak lr to the peak."""
    return {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": lr * WARMUP_MIN_RATIO,
            "warmup_max_lr": lr,
            WARMUP_PARAM: AUTO,
            "warmup_type": "linear",
        },
    }


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


@dataclass(frozen=True)
class RanSchedule:
    """The schedule a checkpoint's run trained (its launch record): what a resume of it keeps."""

    warmup_steps: int | None  # None: it had no warm-up (a DeepSpeed-format config without a scheduler)
    total_steps: int
    kind: str | None = None  # ScheduleSpec.kind; None: not recorded (a kit before it)


@dataclass(frozen=True)
class ScheduleSpec:
    """The lr schedule that trains, as a ratio of the peak lr (OptimSettings.lr), for a run of any length: the
    total steps are known only once the data is (--epochs), so each method takes them."""

    kind: str  # cosine, wsd, linear, constant (--lr_schedule); NONE; else the DeepSpeed config's own scheduler type
    source: str  # the DeepSpeed-format config it was resolved with, for messages
    warmup_steps: int  # --warmup_steps, or the config's scheduler.params.warmup_num_steps
    warmup_ratio: float | None  # --warmup_ratio: the warm-up as a share of the run instead
    min_lr_ratio: float  # the lr the decay ends at, as a share of the peak (cosine: its cos_min_ratio)
    decay_fraction: float  # wsd
    decay_type: str  # wsd
    decay_from_step: int | None  # wsd
    # DeepSpeed's scheduler section (JSON text) for every kind DeepSpeed has a class for (cosine, constant, the
    # config's own), warm-up and total steps still to fill (`deepspeed_section`); None for wsd, linear and NONE.
    section: str | None = None

    def _section(self) -> dict[str, Any] | None:
        return None if self.section is None else json.loads(self.section)

    def warms_up(self) -> bool:
        section = self._section()
        return self.kind in CLIENT_SCHEDULES or (
            section is not None and WARMUP_PARAM in section.get("params", {})
        )

    def warmup_for(self, total_steps: int) -> int | None:
        """The warm-up for a run of total_steps (--warmup_ratio of it, or --warmup_steps): never longer than the
        run (a 3-step smoke test warms up over its 3 steps); None: the schedule has none."""
        if not self.warms_up():
            return None
        if self.warmup_ratio is not None:
            # Hugging Face's rule: rounded up, so any ratio above 0 warms up for at least one step. Rounded to 6
            # places first: 0.07 x 100 is 7.000000000000001 in floating point, a warm-up of 7 steps, not 8.
            return min(math.ceil(round(self.warmup_ratio * total_steps, 6)), total_steps)
        return min(self.warmup_steps, total_steps)

    def client(self, total_steps: int) -> Schedule | None:
        """The schedule the kit runs itself (wsd, linear) for a run of total_steps; None for DeepSpeed's own."""
        if self.kind not in CLIENT_SCHEDULES:
            return None
        if self.decay_from_step is not None and self.decay_from_step > total_steps:
            raise ConfigError(
                f"--decay_from_step {self.decay_from_step} is beyond the run's {total_steps} steps: "
                "use a step before --max_steps"
            )
        warmup = self.warmup_for(total_steps)
        assert warmup is not None
        if self.kind == "linear":
            decay_start = warmup
        elif self.decay_from_step is not None:
            decay_start = max(warmup, self.decay_from_step)
        else:
            decay_start = max(warmup, total_steps - round(self.decay_fraction * total_steps))
        return Schedule(self.kind, total_steps, warmup, self.min_lr_ratio, decay_start, self.decay_type)

    def resumed(self, ran: RanSchedule) -> ScheduleSpec:
        """The schedule a resume of `ran` trains: its warm-up as it ran (a --warmup_ratio of a changed --max_steps,
        or a changed --warmup_steps, would move a warm-up already run); the decay ends at whatever total steps
        each method is given."""
        if ran.warmup_steps is None or not self.warms_up():
            return self
        return dataclasses.replace(self, warmup_steps=ran.warmup_steps, warmup_ratio=None)

    def switches_from(self, ran: RanSchedule) -> bool:
        """Whether a resume of `ran` trains another kind of schedule (its scheduler state is then not loaded)."""
        return ran.kind is not None and ran.kind != self.kind

    def resume_line(self, ran: RanSchedule, peak_lr: float, step: int, total_steps: int) -> str | None:
        """The one line a resume at `step` of a run that trained `ran` prints when its schedule changes: another
        kind (the new one continues from `step`), another --max_steps (the decay reshaped; the lr of step+1
        before and after) or a warm-up the flags now make different (kept). None when nothing changed: the lr
        continues exactly."""
        kept = self.resumed(ran)
        warmup, asked = kept.warmup_for(total_steps), self.warmup_for(total_steps)
        switched = self.switches_from(ran)
        if total_steps == ran.total_steps and warmup == asked and not switched:
            return None
        said = ["lr schedule:"]
        if switched:
            said.append(
                f"--lr_schedule {self.kind} (was {ran.kind}) from step {step + 1} ({ran.kind}'s scheduler state not "
                "loaded);"
            )
        if total_steps != ran.total_steps:
            said.append(f"--max_steps {total_steps} (was {ran.total_steps}):")
        if warmup is not None:
            differs = f" (the flags now give {asked})" if asked != warmup else ""
            said.append(f"warm-up kept at {warmup} steps{differs};")
        if total_steps != ran.total_steps and self.kind not in WITHOUT_DECAY:
            said.append(f"the decay now ends at step {total_steps};")
        (after,) = kept.lr_at(peak_lr, total_steps, [step + 1])
        if switched:  # the old schedule's lr is not this spec's to compute
            said.append(f"lr at step {step + 1} {after:.3g}")
        else:
            before = kept._lr_before(peak_lr, ran.total_steps, step + 1)
            said.append(f"lr at step {step + 1} {before:.3g} -> {after:.3g}")
        return " ".join(said)

    def _lr_before(self, peak_lr: float, total_steps: int, step: int) -> float:
        """The lr `step` would have run at in the run of total_steps that was resumed (a --decay_from_step
        beyond that run's end is new with this resume: that run had none)."""
        if self.decay_from_step is not None and self.decay_from_step > total_steps:
            return dataclasses.replace(self, decay_from_step=None)._lr_before(peak_lr, total_steps, step)
        (lr,) = self.lr_at(peak_lr, total_steps, [step])
        return lr

    def deepspeed_section(self, total_steps: int) -> dict[str, Any] | None:
        """DeepSpeed's scheduler section for a run of total_steps (its warm-up and total filled), a fresh dict;
        None where DeepSpeed runs no scheduler of its own (wsd, linear: the kit's; NONE)."""
        section = self._section()
        if section is None:
            return None
        params = section.setdefault("params", {})
        warmup = self.warmup_for(total_steps)
        if warmup is not None and WARMUP_PARAM in params:  # DeepSpeed's scheduler warms up
            if warmup < 1:  # DeepSpeed's warm-up schedulers raise on 0 inside deepspeed.initialize
                raise ConfigError(
                    f"a warm-up of {warmup} steps: DeepSpeed's {section.get('type')} needs at least 1: "
                    "raise --warmup_steps or --warmup_ratio, or use --lr_schedule wsd or linear"
                )
            params[WARMUP_PARAM] = warmup
        if TOTAL_PARAM in params:
            current = params[TOTAL_PARAM]
            if current not in (AUTO, total_steps):
                raise ConfigError(
                    f"scheduler.params.total_num_steps = {current} in {self.source} disagrees with {total_steps} "
                    'training steps: set it to "auto"'
                )
            params[TOTAL_PARAM] = total_steps
        return section

    def torch_scheduler(self, optimizer: Any, total_steps: int) -> Any:
        """The scheduler of a run of total_steps on a torch optimizer whose lr is the peak: the kit's LambdaLR
        (wsd, linear), DeepSpeed's own class constructed as deepspeed.initialize does (cosine, constant, the
        config's own), or None (NONE: a constant lr). What the FSDP engine steps."""
        client = self.client(total_steps)
        if client is not None:
            return client.lambda_lr(optimizer)
        section = self.deepspeed_section(total_steps)
        return None if section is None else deepspeed_scheduler(section, optimizer)

    def implementation(self, total_steps: int) -> str | None:
        """The scheduler class that runs the schedule (whichever engine steps it); None: a constant lr, none."""
        if self.client(total_steps) is not None:
            return "the kit's LambdaLR"
        section = self._section()
        return None if section is None else f"DeepSpeed's {section.get('type')}"

    def describe(self, total_steps: int, runs: Callable[[str], str]) -> str:
        """The schedule's shape, then what runs it: `runs` is the engine's phrase for a scheduler class
        (Engine.runs_schedule), e.g. "DeepSpeed's WarmupCosineLR over torch AdamW, stepped by the FSDP engine"."""
        implementation = self.implementation(total_steps)
        how = "" if implementation is None else f" ({runs(implementation)})"
        client = self.client(total_steps)
        if client is not None:
            return client.describe() + how
        warmup = self.warmup_for(total_steps)
        if self.kind == "cosine":
            section = self._section()
            assert section is not None
            return (
                f"lr schedule cosine: warm-up {warmup} steps, cosine decay to "
                f"{section['params'][COS_MIN_PARAM]:g} x peak by step {total_steps}{how}"
            )
        if self.kind == "constant":
            return f"lr schedule constant: warm-up {warmup} steps, then the peak lr{how}"
        if self.kind == NONE:
            return f"lr constant: {self.source} has no scheduler"
        return f"lr schedule: {self.kind} from {self.source}{how}"

    def lr_at(self, peak_lr: float, total_steps: int, steps: list[int]) -> list[float]:
        """The lr each optimizer step (1-based) runs at, computed by the scheduler that trains."""
        client = self.client(total_steps)
        if client is not None:
            return [peak_lr * client.ratio(step - 1) for step in steps]
        section = self.deepspeed_section(total_steps)
        if section is None:
            return [peak_lr] * len(steps)
        return deepspeed_lr_at(section, peak_lr, [step - 1 for step in steps])


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
    start_schedule_at (fresh starts, and every resume: a loaded scheduler state positions the schedule it is
    loaded into, but the optimizer's lr loaded beside it is the saved run's)."""
    from torch.optim.lr_scheduler import LambdaLR

    from model_utils.compat import torch_internals

    # DeepSpeed's warm-up schedulers start at iteration -1, i.e. lr 0 for the first optimizer step; step k
    # should run at iteration k-1 (the warm-up minimum ratio for step 1).
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
        scheduler.step(step)
    elif isinstance(scheduler, LambdaLR):
        # A torch scheduler counts completed steps from 0; step k+1 runs at its ratio for k. Set even when a
        # loaded state says `step` already: the optimizer's saved lr is the schedule's that saved it.
        scheduler.last_epoch = step
        lrs = [
            base * ratio(step) for base, ratio in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        torch_internals.set_last_lr(scheduler, lrs)
