"""What trains, for either engine: the batch, the precision, the optimizer and the lr schedule, resolved once from
the flags, the run file and the DeepSpeed-format config (config/deepspeed_file.py), and never mutated.

The optimizer and schedule are optim/settings.py's; the batch keys follow the same rule (an "auto" or absent key
takes its flag, an explicit key is adopted, an explicit key and flag that disagree are an error). The engine's
own checks of the config run here (the FSDP engine refuses DeepSpeed-only keys), then DeepSpeed's checks of the
JSON the settings make (engines/deepspeed_config.py), for both engines: one format. The two values known only
later (the micro batch, when probed, and the total steps, when --epochs depends on the data) are given to
`deepspeed_json`, which returns a fresh dict each time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from model_utils import engines
from model_utils.config.arguments import AUTO, TrainConfig, engine_only_flags
from model_utils.config.deepspeed_file import adopt, load_deepspeed_json, precision_of
from model_utils.engines import deepspeed_config
from model_utils.errors import ConfigError
from model_utils.optim import settings as optim_settings
from model_utils.optim.schedules import ScheduleSpec
from model_utils.optim.settings import OptimSettings


def default_in_use(cfg: TrainConfig) -> bool:
    """Whether the run reads its engine's default config and that default has a GPU-only sibling (no
    --deepspeed_config, no run-file section): on CUDA ranks resolution then picks the sibling where the memory
    estimate says it fits."""
    return (
        cfg.deepspeed_inline is None
        and "deepspeed_config" not in cfg.explicit
        and gpu_only_config(cfg) is not None
    )


def gpu_only_config(cfg: TrainConfig) -> str | None:
    """The GPU-only sibling of the run's engine's default config (see default_in_use), if it has one."""
    return engines.config_rules(cfg.optim.backend).gpu_only_config


def given(cfg: TrainConfig, gpu_only: bool = False) -> tuple[str, dict[str, Any]]:
    """The DeepSpeed-format config this run reads, as given (its path, or what names it), before any flag is
    merged in: the run file's section, --deepspeed_config, or the engine's default file (with `gpu_only`,
    resolution's choice on CUDA ranks, the default's GPU-only sibling)."""
    if cfg.deepspeed_inline is not None:
        return f"the run file {cfg.run_file}'s deepspeed section", json.loads(cfg.deepspeed_inline)
    engine = engines.config_rules(cfg.optim.backend)
    path = cfg.optim.deepspeed_config if "deepspeed_config" in cfg.explicit else engine.default_config
    if gpu_only:
        assert default_in_use(cfg) and engine.gpu_only_config, (
            "an explicit DeepSpeed config is never replaced"
        )
        path = engine.gpu_only_config
    explicit = "deepspeed_config" in cfg.explicit and not gpu_only
    return path, load_deepspeed_json(
        path, cfg.setting("deepspeed_config") if explicit else "the kit's default"
    )


@dataclass(frozen=True)
class TrainSettings:
    """What trains, after the flags and the DeepSpeed-format config are joined. Never mutated: `with_batch` copies."""

    path: str  # the DeepSpeed-format config read (or what names it)
    backend: str  # deepspeed or fsdp (--backend): which engine trains
    fsdp_cpu_offload: bool  # --backend fsdp: FSDP2's CPUOffloadPolicy (--fsdp_cpu_offload)
    micro_batch_size: int | str  # AUTO until rank 0 probes its GPU (resolution on the ranks)
    gradient_accumulation_steps: int
    optim: OptimSettings
    schedule: ScheduleSpec
    precision: str  # "bf16", "fp16" or "fp32": the dtype weights are built in
    zero_stage: int  # DeepSpeed's ZeRO stage (0 under fsdp)
    # The engine throws a step with non-finite gradients away whole (DeepSpeed's overflow check; FSDP always can):
    # the spike guard's skip.
    discards_nonfinite_steps: bool
    # --global_batch_tokens (or, on CUDA ranks, the default): the ranks derive the accumulation from it.
    global_batch_tokens: int | None
    global_batch_from: str | None  # what asked for global_batch_tokens, for the layout's log line
    batch_given: bool  # the micro batch or accumulation set by a flag or the config: no CUDA batch default
    given_config: (
        str  # the DeepSpeed-format config as given (JSON text): the keys the settings do not own pass through
    )

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

        return torch.float32 if engines.config_rules(self.backend).model_in_fp32 else self.torch_dtype()

    def lr_at(self, total_steps: int, steps: list[int]) -> list[float]:
        """The lr each optimizer step (1-based) of a run of total_steps runs at."""
        return self.schedule.lr_at(self.optim.lr, total_steps, steps)

    def with_batch(self, **changes: Any) -> TrainSettings:
        """A copy with the batch the ranks decided (the CUDA default, the accumulation of a global batch)."""
        return dataclasses.replace(self, **changes)

    def deepspeed_json(self, micro_batch_size: int, total_steps: int) -> dict[str, Any]:
        """A fresh DeepSpeed dict for deepspeed.initialize with the micro batch and the schedule's total steps (what
        a launch records for either engine)."""
        assert isinstance(micro_batch_size, int) and micro_batch_size >= 1, micro_batch_size
        return deepspeed_config.deepspeed_json(
            json.loads(self.given_config),
            micro_batch_size,
            self.gradient_accumulation_steps,
            self.optim,
            self.schedule.deepspeed_section(total_steps),
        )


def resolve(cfg: TrainConfig, gpu_only: bool = False) -> TrainSettings:
    """Join the flags and the DeepSpeed-format config, check the result (the engine's checks, then DeepSpeed's)."""
    backend = cfg.optim.backend
    # Here, not in parsing: an accelerate config may set the backend (accelerate_env.join).
    for flag, f in sorted(engine_only_flags(backend).items()):
        if flag in cfg.explicit:
            raise ConfigError(
                f"{cfg.setting(flag)} applies to --backend {f.metadata['engine']} only, not "
                f"{cfg.setting('backend')} {backend}: {f.metadata['elsewhere']}"
            )
    engine = engines.config_rules(backend)
    path, ds = given(cfg, gpu_only)
    engine.check_config(ds, path)
    deepspeed_config.refuse_train_batch_size(ds, path)
    tokens = cfg.optim.global_batch_tokens
    file_batch = {k: ds.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    if tokens is not None and file_batch["gradient_accumulation_steps"] not in (None, AUTO):
        raise ConfigError(
            f"{cfg.setting('global_batch_tokens')} given but {path} sets gradient_accumulation_steps = "
            f'{file_batch["gradient_accumulation_steps"]}: set it to "auto" or drop {cfg.key("global_batch_tokens")}'
        )
    # With a global batch in tokens the micro batch is the largest that fits, unless one is given.
    micro_flag = (
        AUTO if tokens is not None and "micro_batch_size" not in cfg.explicit else cfg.optim.micro_batch_size
    )
    micro_batch = adopt(cfg, "micro_batch_size", micro_flag, ds, ("train_micro_batch_size_per_gpu",), path)
    accumulation = int(
        adopt(
            cfg,
            "gradient_accumulation_steps",
            cfg.optim.gradient_accumulation_steps,
            ds,
            ("gradient_accumulation_steps",),
            path,
        )
    )
    optim, schedule = optim_settings.resolve(cfg, ds, path)
    checked = deepspeed_config.check(ds, path, micro_batch, accumulation, optim, schedule, cfg.loop.max_steps)
    precision = precision_of(checked)
    return TrainSettings(
        path=path,
        backend=backend,
        fsdp_cpu_offload=cfg.optim.fsdp_cpu_offload,
        micro_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        optim=optim,
        schedule=schedule,
        precision=precision,
        zero_stage=deepspeed_config.zero_stage_of(checked),
        discards_nonfinite_steps=engine.discards_nonfinite_steps(checked, precision),
        global_batch_tokens=tokens,
        global_batch_from=None if tokens is None else "--global_batch_tokens",
        batch_given=bool({"micro_batch_size", "gradient_accumulation_steps"} & cfg.explicit)
        or any(v not in (None, AUTO) for v in file_batch.values()),
        given_config=json.dumps(ds),
    )
