"""The DeepSpeed engine's JSON: the run's DeepSpeed-format config with the resolved settings written in, and
DeepSpeed's own checks of it.

The settings are resolved once (resolve/train_settings.py: the batch and precision; optim/settings.py: the
optimizer and schedule); `deepspeed_json` writes them into a copy of the config as given (its micro batch,
accumulation, optimizer lr and scheduler section), leaving every other key (ZeRO, offload, precision, ...) as the
user wrote it. `check` runs DeepSpeed's config class over the result: keys DeepSpeed would silently ignore are
refused. Both engines' configs are checked (one format); only the DeepSpeed engine is built from the JSON.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Mapping
from typing import Any

from model_utils.config.arguments import AUTO
from model_utils.config.deepspeed_file import get
from model_utils.errors import ConfigError
from model_utils.optim.schedules import TOTAL_PARAM, ScheduleSpec
from model_utils.optim.settings import LR_KEY, SCHEDULER, OptimSettings

MICRO_BATCH_KEY = "train_micro_batch_size_per_gpu"
ACCUMULATION_KEY = "gradient_accumulation_steps"


def refuse_train_batch_size(ds: Mapping[str, Any], path: str) -> None:
    if "train_batch_size" in ds and ds["train_batch_size"] != AUTO:
        raise ConfigError(
            f"{path} sets train_batch_size: remove it (DeepSpeed derives it from micro batch x accumulation x ranks)"
        )


def deepspeed_json(
    given: Mapping[str, Any],
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    optim: OptimSettings,
    scheduler: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """A fresh dict for deepspeed.initialize: the config as given with the resolved batch, lr and scheduler section
    (ScheduleSpec.deepspeed_section; None: no scheduler of DeepSpeed's, e.g. the kit's LambdaLR)."""
    ds = copy.deepcopy(dict(given))
    ds.pop("train_batch_size", None)  # "auto" (anything else is refused): DeepSpeed derives it
    ds[MICRO_BATCH_KEY] = micro_batch_size
    ds[ACCUMULATION_KEY] = gradient_accumulation_steps
    if isinstance(ds.get("optimizer"), dict):  # without one, DeepSpeed has no optimizer to give the lr to
        ds["optimizer"].setdefault("params", {})[LR_KEY[-1]] = optim.lr
    if scheduler is None:
        ds.pop(SCHEDULER, None)
    else:
        ds[SCHEDULER] = copy.deepcopy(dict(scheduler))
    return ds


def check(
    given: Mapping[str, Any],
    path: str,
    micro_batch_size: int | str,
    gradient_accumulation_steps: int,
    optim: OptimSettings,
    schedule: ScheduleSpec,
    placeholder_steps: int,
) -> dict[str, Any]:
    """The DeepSpeed JSON of these settings, checked by DeepSpeed, with placeholders for the two values known only
    later: the micro batch when "auto" (probed on the GPU: 1 here) and the schedule's total steps."""
    section = None if schedule.section is None else json.loads(schedule.section)
    if section is not None and TOTAL_PARAM in section.get("params", {}):
        section["params"][TOTAL_PARAM] = placeholder_steps
    micro_batch = 1 if micro_batch_size == AUTO else int(micro_batch_size)
    ds = deepspeed_json(given, micro_batch, gradient_accumulation_steps, optim, section)
    if get(ds, ("checkpoint", "load_universal")):
        raise ConfigError(
            f"checkpoint.load_universal in {path}: remove it; the kit converts a checkpoint to DeepSpeed's universal "
            "layout and loads it that way itself when the world size changed"
        )
    _check_deepspeed_keys(ds, path)
    if not isinstance(ds.get("optimizer"), dict):  # DeepSpeed accepts it, then fails at the first step
        raise ConfigError(
            f"{path} has no optimizer section: the run trains with the optimizer configured there: add "
            '"optimizer": {"type": "AdamW", "params": {"lr": "auto"}} (as deepspeed/ds_config.json has)'
        )
    return ds


def zero_stage_of(ds: Mapping[str, Any]) -> int:
    zero = ds.get("zero_optimization")
    return int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0


def discards_nonfinite_steps(ds: Mapping[str, Any], precision: str) -> bool:
    """Whether DeepSpeed's step checks the gradients and skips the whole update when one is not finite: fp16's
    loss scaler always; bf16 unless bf16.check_grad_overflow is off; ZeRO-3 and fp32 ZeRO-1/2 through the
    global norm (ZeRO-1/2 compute it unless zero_optimization.compute_grad_norm is off). Plain fp32 without
    ZeRO hands every gradient to torch's optimizer."""
    zero_stage = zero_stage_of(ds)
    if precision == "fp16" or zero_stage == 3:
        return True
    if precision == "bf16":
        return get(ds, ("bf16", "check_grad_overflow")) is not False
    return zero_stage in (1, 2) and get(ds, ("zero_optimization", "compute_grad_norm")) is not False


class _RecordingDict(dict):
    """A dict that records which keys were read, to find keys DeepSpeed would silently ignore."""

    def __init__(self, *args: Any, seen: set[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[str] = set() if seen is None else seen

    def __getitem__(self, key: str) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.seen.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)


def _check_deepspeed_keys(ds: dict[str, Any], path: str) -> None:
    from model_utils.launch import startup

    startup.import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    recording = _RecordingDict(json.loads(json.dumps(ds)))
    try:
        DeepSpeedConfig(recording)
    except (
        Exception
    ) as e:  # DeepSpeed raises many types (pydantic, assert, ValueError); report them as one line
        first = str(e).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:3])
        raise ConfigError(f"DeepSpeed rejects {path}: {detail}") from None
    _check_scheduler_params(ds, path)
    unknown = sorted(set(ds) - recording.seen)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(recording.seen), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else "remove it"
        raise ConfigError(
            f"unknown key {key!r} in DeepSpeed config {path}: DeepSpeed would ignore it; {hint}"
        )


def _check_scheduler_params(ds: dict[str, Any], path: str) -> None:
    """DeepSpeed passes scheduler params as keyword arguments unchecked: a misspelt one crashes initialize()."""
    import inspect

    from deepspeed.runtime import lr_schedules

    scheduler = ds.get("scheduler")
    if not isinstance(scheduler, dict):
        return
    cls = getattr(lr_schedules, str(scheduler.get("type")), None)
    if cls is None:
        raise ConfigError(
            f"unknown scheduler type {scheduler.get('type')!r} in {path}: e.g. WarmupCosineLR, WarmupLR"
        )
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer"}
    for key in scheduler.get("params", {}):
        if key not in accepted:
            close = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(accepted))}"
            raise ConfigError(f"unknown {cls.__name__} parameter {key!r} in {path}: {hint}")
