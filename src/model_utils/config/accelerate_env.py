"""What an accelerate config asks of the kit, read from the environment `accelerate launch` gives each rank.

`accelerate launch [--config_file X] src/train_deepspeed.py ...` starts the ranks through torch.distributed.run
and hands its config to them only as environment variables (accelerate/utils/launch.py:
prepare_multi_gpu_env, prepare_deepspeed_cmd_env, prepare_simple_launcher_cmd_env). The kit never builds an
`Accelerator` (on a CPU-only box one with DeepSpeed reports a world of 1 while torch.distributed has N), so it
reads those variables itself: `from_environment` turns them into an `AccelerateRequest`, or refuses in one line
what the kit cannot honour; `check_against` gives the training flags it maps onto, and `join` adds them to the
parsed config, refusing one the user gave that disagrees (the first step of resolution, resolve/resolver.py:
parsing reads no environment); `check_deepspeed`, `check_precision` and `check_wrapped_layers` compare it with
what the kit resolves later (resolve/train_settings.py: its DeepSpeed dict or FSDP precision; the model's
decoder layers).

accelerate's defaults are no request: it passes mixed_precision "no", fsdp_offload_params false and
fsdp_activation_checkpointing false whether or not the config says so, so those leave the kit's own settings
(its DeepSpeed config's precision, no offload, no checkpointing) in place. The mapping, per setting, is the
table in docs/launchers.md ("accelerate config mapping").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from model_utils.config import arguments
from model_utils.config.arguments import TrainConfig
from model_utils.config.deepspeed_file import precision_of
from model_utils.errors import ConfigError

# Every launcher accelerate has sets this one (the DeepSpeed launcher sets no dynamo variables, the plain
# multi-GPU one no type variable): its presence is what "started by accelerate launch" means.
MARKER = "ACCELERATE_MIXED_PRECISION"
# The kit's own flags the request sets (names in model_utils.config.arguments; `backend` is --backend
# deepspeed|fsdp, `fsdp_cpu_offload` the FSDP engine's parameter/optimizer offload switch).
BACKEND_FLAG = "backend"
FSDP_OFFLOAD_FLAG = "fsdp_cpu_offload"
PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}  # accelerate's name -> the kit's
# accelerate refuses these DeepSpeed fields beside a deepspeed_config_file (the file must say them); it does so
# only when an Accelerator is built, which the kit never does, so the kit refuses them itself.
_DS_FILE_EXCLUSIVE = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
    "mixed_precision",
)
# The kit's shipped DeepSpeed configs by ZeRO stage (both offload the optimizer to CPU, in bf16).
_SHIPPED_BY_STAGE = {2: "deepspeed/ds_config.json", 3: "deepspeed/ds_config_zero3.json"}
# FSDP1's sharding strategies; only full sharding (FSDP2's reshard_after_forward: true) is the kit's engine.
_FULL_SHARD = {"full_shard", "1"}


@dataclass(frozen=True)
class AccelerateRequest:
    """An accelerate config as the kit reads it. None: the config does not say (or says accelerate's default)."""

    distributed_type: str  # "DEEPSPEED", "FSDP" or "MULTI_GPU" (plain data parallel)
    backend: str | None  # "deepspeed", "fsdp"; None for MULTI_GPU: the kit's default engine trains
    mixed_precision: str  # "no", "bf16" or "fp16"; "no" is also accelerate's default: no constraint
    compile: bool = False  # dynamo_backend INDUCTOR: the kit's --compile
    # DeepSpeed (distributed_type DEEPSPEED)
    deepspeed_config_file: str | None = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None  # "none", "cpu" or "nvme"
    offload_param_device: str | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    # FSDP (distributed_type FSDP)
    fsdp_version: int | None = None  # 1 or 2: both train on the kit's FSDP2 engine (same full sharding)
    fsdp_offload_params: bool = False
    fsdp_activation_checkpointing: bool = False
    fsdp_state_dict_type: str | None = None  # only SHARDED_STATE_DICT gets here
    fsdp_layer_classes: tuple[str, ...] = ()  # fsdp_transformer_layer_cls_to_wrap, when named

    def describe(self) -> str:
        """One line for the log: what accelerate asked for."""
        parts = [f"distributed_type {self.distributed_type}", f"mixed_precision {self.mixed_precision}"]
        for f in dataclasses.fields(self):
            if f.name in ("distributed_type", "mixed_precision"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = ",".join(value)
            if value not in (None, False, ""):
                parts.append(f"{f.name} {value}")
        return "accelerate config: " + ", ".join(parts)


def _flag(env: Mapping[str, str], name: str) -> bool:
    # accelerate writes "true"/"false" for most switches and Python's "True"/"False" for some (dynamo, cpu)
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "y", "on")


def _refuse(what: str, fix: str) -> ConfigError:
    return ConfigError(f"the accelerate config asks for {what}, which dskit does not do: {fix}")


def from_environment(env: Mapping[str, str]) -> AccelerateRequest | None:
    """The accelerate config in a rank's environment; None when `accelerate launch` did not start it."""
    if MARKER not in env:
        return None
    _refuse_unsupported(env)
    precision = env[MARKER].strip().lower()
    if precision == "fp8":
        raise _refuse("mixed_precision fp8", "use bf16, fp16 or no (dskit trains in bf16, fp16 or fp32)")
    if precision not in PRECISIONS:
        raise ConfigError(
            f"{MARKER}={env[MARKER]!r} is not a precision accelerate writes: use bf16, fp16 or no"
        )
    compile_ = _dynamo(env)
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        return _deepspeed(env, precision, compile_)
    if _flag(env, "ACCELERATE_USE_FSDP"):
        return _fsdp(env, precision, compile_)
    return AccelerateRequest("MULTI_GPU", None, precision, compile_)


def _refuse_unsupported(env: Mapping[str, str]) -> None:
    if _flag(env, "ACCELERATE_USE_MEGATRON_LM"):
        raise _refuse(
            "Megatron-LM (distributed_type MEGATRON_LM)", "set distributed_type to DEEPSPEED or FSDP"
        )
    if "XLA_USE_BF16" in env or "XLA_DOWNCAST_BF16" in env:
        raise _refuse("TPU/XLA (distributed_type XLA)", "train on GPUs or CPUs with DEEPSPEED or FSDP")
    if _flag(env, "ACCELERATE_USE_SAGEMAKER"):
        raise _refuse("accelerate's SageMaker launcher", "submit with `dskit sagemaker submit` instead")
    if "ACCELERATE_USE_CPU" in env:
        # Only accelerate's plain launcher sets it: one process without torch.distributed's environment.
        raise ConfigError(
            "accelerate started one plain process (distributed_type NO, or use_cpu / --cpu), without "
            "torch.distributed's environment: launch with --multi_gpu --num_processes N or a DEEPSPEED/FSDP "
            "config (on a node without GPUs dskit trains on CPU over gloo by itself)"
        )
    if _flag(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        sizes = {
            name: env.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")
            for name in ("tp", "cp", "sp", "dp_replicate")
        }
        bigger = [f"{name}_size {size}" for name, size in sizes.items() if size.strip() not in ("", "1")]
        if bigger:
            raise _refuse(
                f"a parallelism_config with {', '.join(bigger)}",
                "dskit shards data parallel only (ZeRO or FSDP over every rank): drop parallelism_config",
            )


def _dynamo(env: Mapping[str, str]) -> bool:
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "NO").strip().upper()
    if backend == "NO":
        return False
    if backend != "INDUCTOR":
        raise _refuse(f"dynamo_backend {backend}", "use INDUCTOR (dskit's --compile) or NO")
    tuned = [
        f"{name.lower()} {env[key]}"
        for name, key, default in (
            ("dynamo_mode", "ACCELERATE_DYNAMO_MODE", "default"),
            ("dynamo_use_fullgraph", "ACCELERATE_DYNAMO_USE_FULLGRAPH", "false"),
            ("dynamo_use_dynamic", "ACCELERATE_DYNAMO_USE_DYNAMIC", "false"),
            ("dynamo_use_regional_compilation", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "false"),
        )
        if env.get(key, default).strip().lower() != default
    ]
    if tuned:
        raise _refuse(
            ", ".join(tuned), "dskit's --compile uses torch.compile's defaults: drop those settings"
        )
    return True


def _int(env: Mapping[str, str], key: str) -> int | None:
    if key not in env:
        return None
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r} from the accelerate config is not an integer") from None


def _deepspeed(env: Mapping[str, str], precision: str, compile_: bool) -> AccelerateRequest:
    if env.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"):
        raise _refuse("DeepSpeed MoE layers (deepspeed_moe_layer_cls_names)", "drop the setting")
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    from_config = {f for f in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if f}
    if config_file is not None:
        beside = sorted(from_config & set(_DS_FILE_EXCLUSIVE))
        if beside:
            raise ConfigError(
                f"the accelerate config sets {', '.join(beside)} beside deepspeed_config_file {config_file}: "
                "set them in that DeepSpeed file instead (accelerate refuses this too)"
            )
    clipping = env.get("ACCELERATE_GRADIENT_CLIPPING")
    try:
        clip = float(clipping) if clipping is not None else None
    except ValueError:
        raise ConfigError(f"ACCELERATE_GRADIENT_CLIPPING={clipping!r} is not a number") from None
    return AccelerateRequest(
        "DEEPSPEED",
        "deepspeed",
        precision,
        compile_,
        deepspeed_config_file=config_file,
        zero_stage=_int(env, "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
        offload_optimizer_device=_device(env, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
        offload_param_device=_device(env, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
        gradient_accumulation_steps=_int(env, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
        gradient_clipping=clip,
    )


def _device(env: Mapping[str, str], key: str) -> str | None:
    value = env.get(key)
    return value.strip().lower() if value else None


def _fsdp(env: Mapping[str, str], precision: str, compile_: bool) -> AccelerateRequest:
    version = _int(env, "FSDP_VERSION") or 1
    if version not in (1, 2):
        raise ConfigError(f"FSDP_VERSION={version} from the accelerate config: use fsdp_version 1 or 2")
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower()
    strategy = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().lower()
    # FSDP1 takes a strategy from either key (`accelerate config` writes reshard_after_forward: SHARD_GRAD_OP),
    # FSDP2 a bool; the kit's engine reshards after forward, i.e. full sharding.
    not_full = (
        [v for v in (strategy, reshard) if v not in _FULL_SHARD | {"true"}]
        if version == 1
        else ([reshard] if reshard not in ("true", "1") else [])
    )
    if not_full:
        raise _refuse(
            f"FSDP sharding {not_full[0].upper()} (fsdp_version {version})",
            "dskit's FSDP2 engine shards fully: use fsdp_reshard_after_forward: true (FULL_SHARD)",
        )
    wrap = env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP").strip().upper()
    if wrap != "TRANSFORMER_BASED_WRAP":
        raise _refuse(
            f"fsdp_auto_wrap_policy {wrap}",
            "dskit wraps each decoder layer, then the model: use TRANSFORMER_BASED_WRAP",
        )
    state_dict = env.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT").strip().upper()
    if state_dict != "SHARDED_STATE_DICT":
        raise _refuse(
            f"fsdp_state_dict_type {state_dict}",
            "dskit's FSDP checkpoints are sharded (Distributed Checkpoint, resumable on any world size) and "
            "`dskit export` writes the full model: use SHARDED_STATE_DICT",
        )
    if _flag(env, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"):
        raise _refuse("activation offload (fsdp_activation_checkpointing_offload)", "drop it")
    if env.get("FSDP_IGNORED_MODULES"):
        raise _refuse("fsdp_ignored_modules", "dskit shards every decoder layer: drop it")
    classes = tuple(c.strip() for c in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if c.strip())
    return AccelerateRequest(
        "FSDP",
        "fsdp",
        precision,
        compile_,
        fsdp_version=version,
        fsdp_offload_params=_flag(env, "FSDP_OFFLOAD_PARAMS"),
        fsdp_activation_checkpointing=_flag(env, "FSDP_ACTIVATION_CHECKPOINTING"),
        fsdp_state_dict_type=state_dict,
        fsdp_layer_classes=classes,
    )


def flag_values(request: AccelerateRequest) -> dict[str, Any]:
    """The training flags (name without --, value) the request sets. Settings left at accelerate's defaults
    set nothing; settings only the kit's resolved config can be compared with are checked by check_deepspeed,
    check_precision and check_wrapped_layers."""
    out: dict[str, Any] = {}
    if request.backend is not None:
        out[BACKEND_FLAG] = request.backend
    if request.deepspeed_config_file is not None:
        out["deepspeed_config"] = request.deepspeed_config_file
    if request.gradient_accumulation_steps is not None:
        out["gradient_accumulation_steps"] = request.gradient_accumulation_steps
    if request.fsdp_offload_params:
        out[FSDP_OFFLOAD_FLAG] = True
    if request.fsdp_activation_checkpointing:
        out["activation_checkpointing"] = "full"
    if request.compile:
        out["compile"] = True
    return out


def _same(flag: str, given: Any, wanted: Any) -> bool:
    if flag == "deepspeed_config":
        return os.path.realpath(str(given)) == os.path.realpath(str(wanted))
    return given == wanted


def check_against(
    request: AccelerateRequest,
    given: Mapping[str, Any],
    setting: Callable[[str], str] = "--{}".format,
    key: Callable[[str], str] = "--{}".format,
) -> dict[str, Any]:
    """The flag values to train with (flag_values), or a ConfigError naming the first flag the user gave
    explicitly (`given`: flag name -> value, e.g. TrainConfig.explicit's values) that the request contradicts
    (`setting`, `key`: a flag as the message names it, with and without where its value came from:
    TrainConfig.setting and TrainConfig.key)."""
    wanted = flag_values(request)
    for flag, value in wanted.items():
        if flag in given and not _same(flag, given[flag], value):
            raise ConfigError(
                f"{setting(flag)} {given[flag]} disagrees with the accelerate config, which asks for {value} "
                f"({_source(flag, request)}): drop {key(flag)} or change the accelerate config"
            )
    return wanted


def join(cfg: TrainConfig, env: Mapping[str, str]) -> TrainConfig:
    """The parsed config with the settings of the accelerate config in `env` (a rank's environment) joined as
    given flags, and the request itself (TrainConfig.accelerate); `cfg` itself where accelerate did not start
    this process. A ConfigError names what the kit cannot honour or a given flag that disagrees."""
    request = from_environment(env)
    if request is None:
        return cfg
    values = arguments.given_values(cfg)
    asked = check_against(request, values, cfg.setting, cfg.key)
    origins = cfg.origins + tuple(
        (flag, f"the accelerate config's {_source(flag, request)}", f"--{flag}")
        for flag in sorted(asked)
        if flag not in values
    )
    return arguments.assemble(
        values | asked, cfg.deepspeed_inline, accelerate=request, origins=origins, run_file=cfg.run_file
    )


def _source(flag: str, request: AccelerateRequest) -> str:
    return {
        BACKEND_FLAG: f"distributed_type {request.distributed_type}",
        "deepspeed_config": "deepspeed_config_file",
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        FSDP_OFFLOAD_FLAG: "fsdp_offload_params",
        "activation_checkpointing": "fsdp_activation_checkpointing",
        "compile": "dynamo_backend INDUCTOR",
    }[flag]


def check_precision(request: AccelerateRequest, precision: str, where: str) -> None:
    """A ConfigError when accelerate asks for bf16 or fp16 and the kit trains in another precision (`precision`:
    "bf16", "fp16" or "fp32", as `where` says, e.g. "the DeepSpeed config deepspeed/ds_config.json")."""
    if request.mixed_precision == "no":
        return  # accelerate's default: the kit's own precision stands
    wanted = PRECISIONS[request.mixed_precision]
    if wanted != precision:
        raise ConfigError(
            f"the accelerate config asks for mixed_precision {request.mixed_precision}, but {where} trains in "
            f"{precision}: make them agree (the kit's precision is the DeepSpeed config's bf16/fp16 section)"
        )


def check_deepspeed(request: AccelerateRequest, ds: Mapping[str, Any], where: str) -> None:
    """A ConfigError when the DeepSpeed dict the kit trains with (`ds`, from `where`) contradicts what the
    accelerate config asks: ZeRO stage, offload devices, gradient clipping, precision."""
    check_precision(request, precision_of(ds), where)
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), Mapping) else {}
    assert isinstance(zero, Mapping)

    def offload(section: str) -> str:
        value = zero.get(section)
        return str(value.get("device", "none")).lower() if isinstance(value, Mapping) else "none"

    checks = (
        ("zero_stage", request.zero_stage, int(zero.get("stage", 0)), "zero_optimization.stage"),
        (
            "offload_optimizer_device",
            request.offload_optimizer_device,
            offload("offload_optimizer"),
            "zero_optimization.offload_optimizer.device",
        ),
        (
            "offload_param_device",
            request.offload_param_device,
            offload("offload_param"),
            "zero_optimization.offload_param.device",
        ),
        ("gradient_clipping", request.gradient_clipping, ds.get("gradient_clipping"), "gradient_clipping"),
    )
    for name, wanted, have, key in checks:
        if wanted is None or _equal(wanted, have):
            continue
        shipped = _SHIPPED_BY_STAGE.get(wanted) if name == "zero_stage" else None
        hint = f" (or pass --deepspeed_config {shipped})" if shipped else ""
        raise ConfigError(
            f"the accelerate config asks for {name} {wanted}, but {where} has {key} {have}: make them agree, "
            f"or give accelerate that file as deepspeed_config_file{hint}"
        )


def _equal(wanted: Any, have: Any) -> bool:
    if isinstance(wanted, float):
        try:
            return have is not None and float(have) == wanted
        except (TypeError, ValueError):
            return False
    return wanted == have


def check_wrapped_layers(request: AccelerateRequest, layer_classes: Iterable[str]) -> None:
    """A ConfigError when fsdp_transformer_layer_cls_to_wrap names a class the kit does not wrap (the kit wraps
    the model's decoder layers, `layer_classes`, e.g. the model's _no_split_modules)."""
    known = set(layer_classes)
    unknown = [c for c in request.fsdp_layer_classes if c not in known]
    if unknown:
        raise ConfigError(
            f"the accelerate config wraps {', '.join(unknown)} (fsdp_transformer_layer_cls_to_wrap), but dskit "
            f"wraps this model's decoder layers ({', '.join(sorted(known)) or 'none'}): name those or drop the "
            "setting"
        )
