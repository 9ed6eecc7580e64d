"""The optimizer and the lr schedule that train, resolved once from the flags, the run file and the DeepSpeed-format
config, for both engines.

The DeepSpeed-format config keeps its meaning (config/deepspeed_file.py: an "auto" or absent key takes its flag,
an explicit key is adopted, an explicit key and an explicit flag that disagree are an error). `--lr_schedule`
against the config's scheduler section: the kit's configs hold its cosine schedule (WarmupCosineLR), which another
--lr_schedule replaces; a config with a scheduler of its own keeps it, and an explicit --lr_schedule beside it is
an error. A schedule flag the chosen schedule would not read is an error too, never silently ignored.

The DeepSpeed engine gets these values in its JSON (engines/deepspeed_config.py), the FSDP engine as torch objects
(engines/fsdp_engine.py); `dskit config`, `dskit plot` and the trainer's log line read the same ScheduleSpec.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from model_utils.config.arguments import AUTO, TrainConfig
from model_utils.config.deepspeed_file import adopt, get
from model_utils.config.presets import default_lr
from model_utils.errors import ConfigError
from model_utils.optim import schedules
from model_utils.optim.schedules import CLIENT_SCHEDULES, ScheduleSpec

LR_KEY = ("optimizer", "params", "lr")
SCHEDULER = "scheduler"


@dataclass(frozen=True)
class OptimSettings:
    """The optimizer that trains. None: the config does not say, and the optimizer's own default applies."""

    type: str | None  # the config's optimizer.type (e.g. AdamW); None: the config has no optimizer section
    lr: float  # the peak learning rate (--lr, the config's optimizer.params.lr, or the model's default)
    betas: tuple[float, float] | None
    eps: float | None
    weight_decay: float | None
    gradient_clipping: float  # the global gradient norm is clipped to this; 0: no clipping


def resolve(cfg: TrainConfig, ds: Mapping[str, Any], path: str) -> tuple[OptimSettings, ScheduleSpec]:
    """The optimizer and schedule of this config and the DeepSpeed-format dict `ds` it reads (from `path`)."""
    kind, section = _choose_schedule(cfg, ds, path)
    flag_lr = cfg.optim.lr if cfg.optim.lr is not None else default_lr(cfg.model.model)
    lr = float(adopt(cfg, "lr", flag_lr, ds, LR_KEY, path))
    if kind == "constant":
        section = schedules.constant_section(lr)
    warmup, min_lr_ratio = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio
    if kind not in CLIENT_SCHEDULES:  # the kit's own schedulers read the flags alone
        view = {} if section is None else {SCHEDULER: section}
        warmup = int(adopt(cfg, "warmup_steps", warmup, view, _param(schedules.WARMUP_PARAM), path))
        if section is not None:
            _fill(section, schedules.WARMUP_PARAM, warmup)
        if kind == "cosine":
            assert section is not None
            min_lr_ratio = float(
                adopt(cfg, "min_lr_ratio", min_lr_ratio, view, _param(schedules.COS_MIN_PARAM), path)
            )
            _fill(section, schedules.COS_MIN_PARAM, min_lr_ratio)
    spec = ScheduleSpec(
        kind=kind,
        source=path,
        warmup_steps=warmup,
        warmup_ratio=cfg.optim.warmup_ratio,
        min_lr_ratio=min_lr_ratio,
        decay_fraction=cfg.optim.decay_fraction,
        decay_type=cfg.optim.decay_type,
        decay_from_step=cfg.optim.decay_from_step,
        section=None if section is None else json.dumps(section),
    )
    _check_schedule_flags_apply(cfg, spec)
    total = None if section is None else section.get("params", {}).get(schedules.TOTAL_PARAM)
    if total is not None and total != AUTO and not (isinstance(total, int) and total >= 1):
        raise ConfigError(
            f'scheduler.params.total_num_steps = {total!r} in {path}: set it to "auto" (the kit fills it)'
        )
    return _optimizer(ds, lr, path), spec


def _param(name: str) -> tuple[str, ...]:
    return (SCHEDULER, "params", name)


def _fill(section: dict[str, Any], name: str, value: Any) -> None:
    """An "auto" or absent scheduler param takes the value that trains."""
    params = section.setdefault("params", {})
    if params.get(name) in (None, AUTO):
        params[name] = value


def _choose_schedule(cfg: TrainConfig, ds: Mapping[str, Any], path: str) -> tuple[str, dict[str, Any] | None]:
    """--lr_schedule against the config's scheduler section: the kind that trains, and DeepSpeed's section for it
    (a fresh copy: the config's own, or the kit's cosine; constant's is made once the lr is known)."""
    kind, explicit = cfg.optim.lr_schedule, "lr_schedule" in cfg.explicit
    section = ds.get(SCHEDULER)
    file_type = section.get("type") if isinstance(section, Mapping) else None
    if file_type not in (None, schedules.COSINE_TYPE):
        if explicit:
            raise ConfigError(
                f"{cfg.setting('lr_schedule')} {kind} given but {path} has its own scheduler {file_type}: drop "
                f"{cfg.key('lr_schedule')} or the scheduler section"
            )
        return str(file_type), copy.deepcopy(dict(section))
    if kind == "cosine":
        if section is None:
            if not explicit:
                return schedules.NONE, None  # a config without a scheduler trains at a constant lr, as before
            return kind, copy.deepcopy(schedules.COSINE_SECTION)
        return kind, copy.deepcopy(dict(section))
    return kind, None  # constant: its section once the lr is known; wsd, linear: the kit's own LambdaLR


def _check_schedule_flags_apply(cfg: TrainConfig, spec: ScheduleSpec) -> None:
    where = {
        "constant": f"{cfg.setting('lr_schedule')} constant",
        schedules.NONE: f"{spec.source}, which has no scheduler",
    }.get(spec.kind, f"{spec.source}'s own scheduler {spec.kind}")
    if "min_lr_ratio" in cfg.explicit and spec.kind not in ("cosine", *CLIENT_SCHEDULES):
        raise ConfigError(f"{cfg.setting('min_lr_ratio')} does not apply to {where}: drop it")
    if "warmup_ratio" in cfg.explicit and not spec.warms_up():
        raise ConfigError(f"{cfg.setting('warmup_ratio')} does not apply to {where} (no warm-up): drop it")


def _optimizer(ds: Mapping[str, Any], lr: float, path: str) -> OptimSettings:
    section = ds.get("optimizer")
    params = get(ds, ("optimizer", "params")) or {}
    return OptimSettings(
        type=str(section.get("type")) if isinstance(section, Mapping) else None,
        lr=lr,
        betas=None if params.get("betas") is None else _betas(params["betas"], path),
        eps=_number(params, "eps", path),
        weight_decay=_number(params, "weight_decay", path),
        gradient_clipping=_number(ds, "gradient_clipping", path) or 0.0,
    )


def _number(d: Mapping[str, Any], key: str, path: str) -> float | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} = {value!r} in {path} is not a number: e.g. {key}: 0.1")
    return float(value)


def _betas(value: Any, path: str) -> tuple[float, float]:
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    ):
        return float(value[0]), float(value[1])
    raise ConfigError(f"optimizer.params.betas = {value!r} in {path} is not two numbers: e.g. [0.9, 0.95]")
