"""The DeepSpeed config: the JSON file with the training flags merged in, checked by DeepSpeed itself.

The one owner of every decision about DeepSpeed's dict. Each flag of DS_OVERRIDES fills an "auto" key; an
explicit key the user did not override by flag is adopted (and reported back as the value that trains); an
explicit key that disagrees with an explicit flag is an error. Keys DeepSpeed would silently ignore are
refused. The two values known only later (the micro batch, when probed, and the total steps, when --epochs
depends on the data) are filled by `DeepSpeedSettings.build`, which returns a fresh dict each time.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils.config.arguments import AUTO, TrainConfig
from model_utils.config.presets import default_lr
from model_utils.errors import ConfigError
from model_utils.optim import schedules
from model_utils.repo import REPO_ROOT

# (flag, path of the DeepSpeed key). Each flag fills an "auto" key; an explicit key must agree with the flag.
DS_OVERRIDES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("micro_batch_size", ("train_micro_batch_size_per_gpu",)),
    ("gradient_accumulation_steps", ("gradient_accumulation_steps",)),
    ("lr", ("optimizer", "params", "lr")),
    ("warmup_steps", ("scheduler", "params", "warmup_num_steps")),
)
MICRO_BATCH_KEY = ("train_micro_batch_size_per_gpu",)
WARMUP_KEY = ("scheduler", "params", "warmup_num_steps")
TOTAL_STEPS_KEY = ("scheduler", "params", "total_num_steps")
PRECISIONS = ("bf16", "fp16")
# --backend fsdp without --deepspeed_config (or a run file's deepspeed section): the kit's config without ZeRO.
FSDP_CONFIG = "deepspeed/fsdp.json"
# The default on CUDA ranks where the memory estimate says it fits (preflight): ZeRO-2 without CPU offload.
GPU_CONFIG = "deepspeed/ds_config_gpu.json"
# What the FSDP engine reads of a DeepSpeed-format config; anything else there is DeepSpeed-only and refused.
FSDP_KEYS = {
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "gradient_clipping": None,
    "optimizer": None,
    "scheduler": None,
    "bf16": {"enabled"},
    "steps_per_print": None,  # DeepSpeed's logging cadence: nothing to honour, harmless
}
FSDP_OPTIMIZERS = ("AdamW", "Adam")  # both run as torch AdamW (DeepSpeed's Adam is AdamW by default too)
FSDP_OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay"}
COSINE_TYPE = "WarmupCosineLR"
COSINE_SECTION = {
    "type": COSINE_TYPE,
    "params": {
        "warmup_min_ratio": schedules.WARMUP_MIN_RATIO,
        "warmup_num_steps": AUTO,
        "cos_min_ratio": AUTO,
        "warmup_type": "linear",
        "total_num_steps": AUTO,
    },
}


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What trains, after the flags and the DeepSpeed file are merged. Never mutated: `build` copies."""

    path: str
    backend: str  # deepspeed or fsdp (--backend): which engine reads this config
    fsdp_cpu_offload: bool  # --backend fsdp: FSDP2's CPUOffloadPolicy (--fsdp_cpu_offload)
    micro_batch_size: int | str  # AUTO until rank 0 probes its GPU (preflight on the ranks)
    gradient_accumulation_steps: int
    lr: float
    warmup_steps: int
    precision: str  # "bf16", "fp16" or "fp32": the dtype weights are built in
    zero_stage: int
    weight_decay: float | None  # optimizer.params.weight_decay; None: the optimizer's default
    schedule: (
        str  # cosine, wsd, linear, constant (schedules.py), a DeepSpeed scheduler type of the file, or none
    )
    warmup_ratio: float | None
    min_lr_ratio: float
    decay_fraction: float
    decay_type: str
    decay_from_step: int | None
    # DeepSpeed throws a step with non-finite gradients away whole (its overflow check): the spike guard's skip.
    discards_nonfinite_steps: bool
    # --global_batch_tokens (or, on CUDA ranks, the default): the ranks derive the accumulation from it.
    global_batch_tokens: int | None
    global_batch_from: str | None  # what asked for global_batch_tokens, for the layout's log line
    batch_given: bool  # the micro batch or accumulation set by a flag or the file: no CUDA batch default
    _checked: dict[str, Any]  # DeepSpeed-validated, with placeholders for the two late values

    @property
    def half_precision(self) -> bool:
        return self.precision != "fp32"

    def torch_dtype(self) -> Any:
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.precision]

    def model_dtype(self) -> Any:
        """The dtype the model is built in: DeepSpeed's training precision (it keeps fp32 masters in its
        optimizer); fp32 under FSDP, whose sharded parameters are the masters (bf16 is its compute policy)."""
        import torch

        return torch.float32 if self.backend == "fsdp" else self.torch_dtype()

    def warmup_steps_for(self, total_steps: int) -> int | None:
        """The schedule's warm-up for a run of total_steps (--warmup_ratio of it, or --warmup_steps): never
        longer than the run (a 3-step smoke test warms up over its 3 steps); None: the schedule has none."""
        if self.schedule not in schedules.CLIENT_SCHEDULES and _get(self._checked, WARMUP_KEY) is None:
            return None
        if self.warmup_ratio is not None:
            return round(self.warmup_ratio * total_steps)
        return min(self.warmup_steps, total_steps)

    def client_schedule(self, total_steps: int) -> schedules.Schedule | None:
        """The schedule the kit runs itself (wsd, linear), None for DeepSpeed's own."""
        if self.schedule not in schedules.CLIENT_SCHEDULES:
            return None
        if self.decay_from_step is not None and self.decay_from_step > total_steps:
            raise ConfigError(
                f"--decay_from_step {self.decay_from_step} is beyond the run's {total_steps} steps: "
                "use a step before --max_steps"
            )
        warmup = self.warmup_steps_for(total_steps)
        assert warmup is not None
        return schedules.client_schedule(
            self.schedule,
            total_steps,
            warmup,
            self.min_lr_ratio,
            self.decay_fraction,
            self.decay_type,
            self.decay_from_step,
        )

    def describe_schedule(self, total_steps: int) -> str:
        client = self.client_schedule(total_steps)
        if client is not None:
            return client.describe()
        warmup = self.warmup_steps_for(total_steps)
        if self.schedule == "cosine":
            return (
                f"lr schedule cosine (DeepSpeed WarmupCosineLR): warm-up {warmup} steps, cosine decay to "
                f"{_get(self._checked, ('scheduler', 'params', 'cos_min_ratio')):g} x peak by step {total_steps}"
            )
        if self.schedule == "constant":
            return f"lr schedule constant (DeepSpeed WarmupLR): warm-up {warmup} steps, then the peak lr"
        if self.schedule == "none":
            return f"lr constant: {self.path} has no scheduler"
        return f"lr schedule: {self.schedule} from {self.path}"

    def lr_at(self, total_steps: int, steps: list[int]) -> list[float]:
        """The lr each optimizer step (1-based) runs at, computed by the scheduler that trains."""
        client = self.client_schedule(total_steps)
        if client is not None:
            return [self.lr * client.ratio(step - 1) for step in steps]
        section = self.build(1, total_steps).get("scheduler")
        if not isinstance(section, dict):
            return [self.lr] * len(steps)
        return schedules.deepspeed_lr_at(section, self.lr, [step - 1 for step in steps])

    def with_batch(self, **changes: Any) -> DeepSpeedSettings:
        """A copy with the batch the ranks decided (the CUDA default, the accumulation of a global batch)."""
        checked = copy.deepcopy(self._checked)
        if "gradient_accumulation_steps" in changes:
            _set(checked, ("gradient_accumulation_steps",), changes["gradient_accumulation_steps"])
        return dataclasses.replace(self, _checked=checked, **changes)

    def build(self, micro_batch_size: int, total_steps: int) -> dict[str, Any]:
        """A fresh dict for deepspeed.initialize with the micro batch and the schedule's total steps."""
        assert isinstance(micro_batch_size, int) and micro_batch_size >= 1, micro_batch_size
        ds = copy.deepcopy(self._checked)
        _set(ds, MICRO_BATCH_KEY, micro_batch_size)
        warmup = self.warmup_steps_for(total_steps)
        if warmup is not None and _get(ds, WARMUP_KEY) is not None:  # DeepSpeed's scheduler warms up
            if warmup < 1:  # DeepSpeed's warm-up schedulers raise on 0 inside deepspeed.initialize
                raise ConfigError(
                    f"a warm-up of {warmup} steps: DeepSpeed's {ds['scheduler'].get('type')} needs at least 1: "
                    "raise --warmup_steps or --warmup_ratio, or use --lr_schedule wsd or linear"
                )
            _set(ds, WARMUP_KEY, warmup)
        scheduler = ds.get("scheduler")
        if isinstance(scheduler, dict) and "total_num_steps" in scheduler.get("params", {}):
            current = scheduler["params"]["total_num_steps"]
            if current not in (AUTO, total_steps):
                raise ConfigError(
                    f"scheduler.params.total_num_steps = {current} in {self.path} disagrees with {total_steps} "
                    'training steps: set it to "auto"'
                )
            scheduler["params"]["total_num_steps"] = total_steps
        return ds


def load_deepspeed_json(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = REPO_ROOT / p  # the kit's own configs work from any working directory
    if not p.is_file():
        raise ConfigError(
            f"DeepSpeed config {path} not found: pass --deepspeed_config PATH (e.g. deepspeed/ds_config.json)"
        )
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"DeepSpeed config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {path} must hold a JSON object, not {type(data).__name__}")
    return data


def precision_of(ds: dict[str, Any]) -> str:
    """The training precision a DeepSpeed dict asks for: its enabled bf16 or fp16 section, else fp32."""
    for name in PRECISIONS:
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled"):
            return name
    return "fp32"


def _discards_nonfinite_steps(ds: dict[str, Any], precision: str, zero_stage: int) -> bool:
    """Whether DeepSpeed's step checks the gradients and skips the whole update when one is not finite: fp16's
    loss scaler always; bf16 unless bf16.check_grad_overflow is off; ZeRO-3 and fp32 ZeRO-1/2 through the
    global norm (ZeRO-1/2 compute it unless zero_optimization.compute_grad_norm is off). Plain fp32 without
    ZeRO hands every gradient to torch's optimizer."""
    if precision == "fp16" or zero_stage == 3:
        return True
    if precision == "bf16":
        return _get(ds, ("bf16", "check_grad_overflow")) is not False
    return zero_stage in (1, 2) and _get(ds, ("zero_optimization", "compute_grad_norm")) is not False


def _weight_decay(ds: dict[str, Any]) -> float | None:
    value = _get(ds, ("optimizer", "params", "weight_decay"))
    return None if value is None else float(value)


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _set(d: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        d = d.setdefault(key, {})
    d[path[-1]] = value


def default_in_use(cfg: TrainConfig) -> bool:
    """Whether the run reads the kit's default DeepSpeed config (no --deepspeed_config, no run-file section,
    --backend deepspeed): on CUDA ranks preflight then picks GPU_CONFIG where the memory estimate says it fits."""
    return (
        cfg.deepspeed_inline is None
        and cfg.optim.backend == "deepspeed"
        and "deepspeed_config" not in cfg.explicit
    )


def given(cfg: TrainConfig, gpu_only: bool = False) -> tuple[str, dict[str, Any]]:
    """The DeepSpeed-format config this run reads, as given (its path, or what names it), before any flag is
    merged in: the run file's section, --deepspeed_config, or the backend's default file (with `gpu_only`,
    preflight's choice on CUDA ranks, the default's GPU-only sibling)."""
    if cfg.deepspeed_inline is not None:
        return "the run file's deepspeed section", json.loads(cfg.deepspeed_inline)
    path = cfg.optim.deepspeed_config
    if cfg.optim.backend == "fsdp" and "deepspeed_config" not in cfg.explicit:
        path = FSDP_CONFIG  # the default ZeRO config is DeepSpeed's; fsdp has its own default
    if gpu_only:
        assert default_in_use(cfg), "an explicit DeepSpeed config is never replaced"
        path = GPU_CONFIG
    return path, load_deepspeed_json(path)


def resolve(cfg: TrainConfig, gpu_only: bool = False) -> DeepSpeedSettings:
    """Merge the flags into the DeepSpeed file and validate the result with DeepSpeed's own config class."""
    fsdp = cfg.optim.backend == "fsdp"
    path, ds = given(cfg, gpu_only)
    if fsdp:
        _check_fsdp_keys(ds, path)
    if "train_batch_size" in ds and ds["train_batch_size"] != AUTO:
        raise ConfigError(
            f"{path} sets train_batch_size: remove it (DeepSpeed derives it from micro batch x accumulation x ranks)"
        )
    ds.pop("train_batch_size", None)
    tokens = cfg.optim.global_batch_tokens
    file_batch = {k: ds.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    if tokens is not None and file_batch["gradient_accumulation_steps"] not in (None, AUTO):
        raise ConfigError(
            f"--global_batch_tokens given but {path} sets gradient_accumulation_steps = "
            f'{file_batch["gradient_accumulation_steps"]}: set it to "auto" or drop --global_batch_tokens'
        )
    flags = {
        # With a global batch in tokens the micro batch is the largest that fits, unless one is given.
        "micro_batch_size": AUTO
        if tokens is not None and "micro_batch_size" not in cfg.explicit
        else cfg.optim.micro_batch_size,
        "gradient_accumulation_steps": cfg.optim.gradient_accumulation_steps,
        "lr": cfg.optim.lr if cfg.optim.lr is not None else default_lr(cfg.model.model),
        "warmup_steps": cfg.optim.warmup_steps,
    }
    schedule = _choose_schedule(cfg, ds, path, float(flags["lr"]))
    overrides = list(DS_OVERRIDES)
    if schedule == "cosine":
        flags["min_lr_ratio"] = cfg.optim.min_lr_ratio
        overrides.append(("min_lr_ratio", ("scheduler", "params", "cos_min_ratio")))
    trains = dict(flags)
    for flag, key_path in overrides:
        flag_value = flags[flag]
        key_value = _get(ds, key_path)
        if key_path[0] == "scheduler" and schedule in schedules.CLIENT_SCHEDULES:
            continue  # the kit's own scheduler reads the flags
        if len(key_path) > 1 and not isinstance(ds.get(key_path[0]), dict):
            # No optimizer/scheduler section: DeepSpeed would not use the value, so the flag cannot apply.
            if flag in cfg.explicit:
                raise ConfigError(
                    f"--{flag} given but {path} has no {key_path[0]!r} section: add one or drop the flag"
                )
            continue
        if key_value is None or key_value == AUTO:
            # --micro_batch_size auto is probed on the GPU later (preflight); validate the config with 1 now.
            _set(ds, key_path, 1 if flag_value == AUTO else flag_value)
        elif flag in cfg.explicit and key_value != flag_value:
            raise ConfigError(
                f"--{flag} {flag_value} disagrees with {'.'.join(key_path)} = {key_value} in {path}: "
                f'drop the flag or set the key to "auto"'
            )
        else:
            trains[flag] = type(flag_value)(key_value) if flag_value != AUTO else int(key_value)
    _check_schedule_flags_apply(cfg, ds, path, schedule)
    file_total = _get(ds, TOTAL_STEPS_KEY)
    if file_total is not None:
        if file_total != AUTO and not (isinstance(file_total, int) and file_total >= 1):
            raise ConfigError(
                f'scheduler.params.total_num_steps = {file_total!r} in {path}: set it to "auto" (the kit fills it)'
            )
        _set(ds, TOTAL_STEPS_KEY, cfg.loop.max_steps)  # a placeholder for DeepSpeed's check
    if _get(ds, ("checkpoint", "load_universal")):
        raise ConfigError(
            f"checkpoint.load_universal in {path}: remove it; the kit converts a checkpoint to DeepSpeed's universal "
            "layout and loads it that way itself when the world size changed"
        )
    _check_deepspeed_keys(ds, path)
    if cfg.accelerate is not None:  # the accelerate config the ranks were launched with must agree
        from model_utils.launch import accelerate_env

        if fsdp:
            accelerate_env.check_precision(cfg.accelerate, precision_of(ds), path)
        else:
            accelerate_env.check_deepspeed(cfg.accelerate, ds, path)
    if file_total is not None:
        _set(ds, TOTAL_STEPS_KEY, file_total)  # the file's own value again: `build` fills or checks it
    zero = ds.get("zero_optimization")
    precision = precision_of(ds)
    zero_stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    return DeepSpeedSettings(
        path=path,
        backend=cfg.optim.backend,
        fsdp_cpu_offload=cfg.optim.fsdp_cpu_offload,
        micro_batch_size=trains["micro_batch_size"],
        gradient_accumulation_steps=int(trains["gradient_accumulation_steps"]),
        lr=float(trains["lr"]),
        warmup_steps=int(trains["warmup_steps"]),
        precision=precision,
        zero_stage=zero_stage,
        weight_decay=_weight_decay(ds),
        schedule=schedule,
        warmup_ratio=cfg.optim.warmup_ratio,
        min_lr_ratio=float(trains.get("min_lr_ratio", cfg.optim.min_lr_ratio)),
        decay_fraction=cfg.optim.decay_fraction,
        decay_type=cfg.optim.decay_type,
        decay_from_step=cfg.optim.decay_from_step,
        # The FSDP engine steps its optimizer itself: it can always leave a step out.
        discards_nonfinite_steps=fsdp or _discards_nonfinite_steps(ds, precision, zero_stage),
        global_batch_tokens=tokens,
        global_batch_from=None if tokens is None else "--global_batch_tokens",
        batch_given=bool({"micro_batch_size", "gradient_accumulation_steps"} & cfg.explicit)
        or any(v not in (None, AUTO) for v in file_batch.values()),
        _checked=ds,
    )


def _check_fsdp_keys(ds: dict[str, Any], path: str) -> None:
    """--backend fsdp reads the optimizer, scheduler, clipping, batch and bf16 of a DeepSpeed-format config; a
    DeepSpeed-only option set there (ZeRO, offload, fp16's loss scaler, ...) would be silently ignored: refused."""
    fix = "remove it or train with --backend deepspeed (docs/fsdp.md lists what fsdp reads)"
    if "zero_optimization" in ds:
        raise ConfigError(
            f"zero_optimization in {path} is DeepSpeed's ZeRO, which --backend fsdp does not run (FSDP2 shards "
            "parameters, gradients and optimizer state itself): remove the section (CPU offload under fsdp: "
            "--fsdp_cpu_offload) or train with --backend deepspeed"
        )
    if isinstance(ds.get("fp16"), dict) and ds["fp16"].get("enabled"):
        raise ConfigError(
            f"fp16 in {path}: --backend fsdp has no loss scaler; use bf16 (a bf16 section) or --backend deepspeed"
        )
    for key, value in ds.items():
        if value is False or (isinstance(value, dict) and value.get("enabled") is False):
            continue  # switched off (e.g. wall_clock_breakdown: false, fp16.enabled: false): nothing to honour
        if key not in FSDP_KEYS:
            raise ConfigError(
                f"{key} in {path} is a DeepSpeed-only option --backend fsdp does not honour: {fix}"
            )
        allowed = FSDP_KEYS[key]
        if allowed is not None and isinstance(value, dict) and set(value) - allowed:
            extra = sorted(set(value) - allowed)[0]
            raise ConfigError(f"{key}.{extra} in {path} is DeepSpeed-only under --backend fsdp: {fix}")
    optimizer = ds.get("optimizer")
    if isinstance(optimizer, dict):
        if optimizer.get("type") not in FSDP_OPTIMIZERS:
            raise ConfigError(
                f"optimizer type {optimizer.get('type')!r} in {path}: --backend fsdp trains with torch AdamW "
                f"(type {' or '.join(FSDP_OPTIMIZERS)}); change the type or train with --backend deepspeed"
            )
        extra = sorted(set(optimizer.get("params", {})) - FSDP_OPTIMIZER_PARAMS)
        if extra:
            raise ConfigError(
                f"optimizer.params.{extra[0]} in {path} is DeepSpeed-only under --backend fsdp (torch AdamW takes "
                f"{', '.join(sorted(FSDP_OPTIMIZER_PARAMS))}): remove it"
            )


def _check_schedule_flags_apply(cfg: TrainConfig, ds: dict[str, Any], path: str, schedule: str) -> None:
    """A schedule flag the chosen schedule would not read is an error, never silently ignored."""
    where = {
        "constant": "--lr_schedule constant",
        "none": f"{path}, which has no scheduler",
    }.get(schedule, f"{path}'s own scheduler {schedule}")
    if "min_lr_ratio" in cfg.explicit and schedule not in ("cosine", *schedules.CLIENT_SCHEDULES):
        raise ConfigError(f"--min_lr_ratio does not apply to {where}: drop it")
    has_warmup = schedule in schedules.CLIENT_SCHEDULES or _get(ds, WARMUP_KEY) is not None
    if "warmup_ratio" in cfg.explicit and not has_warmup:
        raise ConfigError(f"--warmup_ratio does not apply to {where} (no warm-up): drop it")


def _choose_schedule(cfg: TrainConfig, ds: dict[str, Any], path: str, lr: float) -> str:
    """--lr_schedule against the file's scheduler section, which is changed in place to what runs.

    The kit's configs hold its cosine schedule (WarmupCosineLR); another --lr_schedule replaces it. A file with a
    scheduler of its own keeps it, and an explicit --lr_schedule beside it is an error.
    """
    kind, explicit = cfg.optim.lr_schedule, "lr_schedule" in cfg.explicit
    section = ds.get("scheduler")
    file_type = section.get("type") if isinstance(section, dict) else None
    if file_type not in (None, COSINE_TYPE):
        if explicit:
            raise ConfigError(
                f"--lr_schedule {kind} given but {path} has its own scheduler {file_type}: drop the flag or the "
                "scheduler section"
            )
        return str(file_type)
    if kind == "cosine":
        if section is None:
            if not explicit:
                return "none"  # a config without a scheduler trains at a constant lr, as before
            ds["scheduler"] = copy.deepcopy(COSINE_SECTION)
        return "cosine"
    if kind == "constant":
        ds["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": lr * schedules.WARMUP_MIN_RATIO,
                "warmup_max_lr": lr,
                "warmup_num_steps": AUTO,
                "warmup_type": "linear",
            },
        }
        return "constant"
    ds.pop("scheduler", None)  # wsd, linear: a torch scheduler handed to deepspeed.initialize
    return kind


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
