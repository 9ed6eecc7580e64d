"""A resolved run's memory estimate: its model's shape, counted once and kept (model_shape), and its layout from the
DeepSpeed-format config and the flags (resolve_layout); the memory model itself is engines/memory.py's. The
preflight asks whether the GPU-only default config fits a CUDA rank (fits_gpu); `dskit estimate` renders it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from model_utils.engines.memory import GiB as GiB  # the resolver and its tests read it here
from model_utils.engines.memory import MemoryEstimate, ModelShape, ZeroLayout, check_zero, estimate
from model_utils.errors import ConfigError, first_line
from model_utils.launch import startup

OFFLOADS = ("none", "optimizer", "optimizer+params")
# A configuration "fits" with this much of the memory used; the rest is headroom for allocator fragmentation.
FIT_FRACTION = 0.9
MAX_MICRO_BATCH = 64


def model_shape(
    model_config: Any,
    name: str,
    built_from_config: bool,
    dtype_bytes: int = 2,
    cache_dir: Path | None = None,
) -> ModelShape:
    """The model's shape, its parameters counted on the meta device. With `cache_dir` (a run's --data_cache_dir),
    the counts an earlier process made for the same config and transformers version are read from there: the count
    itself is quick, but importing transformers' modeling code for it made the preflight 4.5 s instead of 2.9 s on
    2 cores, at every launch and requeue (docs/speed.md)."""
    counted = _cached_counts(model_config, cache_dir)
    hidden = int(model_config.hidden_size)
    heads = int(model_config.num_attention_heads)
    return ModelShape(
        name=name,
        total_params=counted["total_params"],
        largest_layer_params=counted["largest_layer_params"],
        largest_param=counted["largest_param"],
        num_layers=int(model_config.num_hidden_layers),
        hidden_size=hidden,
        intermediate_size=int(getattr(model_config, "intermediate_size", None) or 4 * hidden),
        num_heads=heads,
        num_kv_heads=int(getattr(model_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(model_config, "head_dim", None) or hidden // heads),
        vocab_size=int(model_config.vocab_size),
        qk_norm=counted["qk_norm"],
        build_bytes_per_param=4 if built_from_config else dtype_bytes,
    )


SHAPE_CACHE = "model-shapes"  # <data_cache_dir>/model-shapes/<key>.json
_COUNTS = ("total_params", "largest_layer_params", "largest_param", "qk_norm")


def _count_on_meta(model_config: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    params = list(model.parameters())  # yields a tied (shared) parameter once
    return {
        "total_params": sum(p.numel() for p in params),
        "largest_layer_params": max(
            sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
        ),
        "largest_param": max(p.numel() for p in params),
        "qk_norm": any(n.endswith(("q_norm", "k_norm")) for n, _ in model.named_modules()),
    }


def _cached_counts(model_config: Any, cache_dir: Path | None) -> dict[str, Any]:
    """The meta-device counts, kept per config and transformers version. A model with its own code (auto_map) is
    always counted: its code can change under the same config. A cache that cannot be read or written costs the
    count, never the launch."""
    if cache_dir is None or getattr(model_config, "auto_map", None):
        return _count_on_meta(model_config)
    import transformers

    key_text = json.dumps([transformers.__version__, model_config.to_dict()], sort_keys=True, default=str)
    path = cache_dir / SHAPE_CACHE / f"{hashlib.sha256(key_text.encode()).hexdigest()[:24]}.json"
    from model_utils.storage.file_manifest import kept_json

    return kept_json(
        path,
        lambda: _count_on_meta(model_config),
        lambda kept: isinstance(kept, dict) and set(kept) == set(_COUNTS),
    )


# --- the DeepSpeed config ---------------------------------------------------------------------------------


def layout_from_deepspeed(
    ds: dict[str, Any],
    path: str,
    *,
    micro_batch_size: int,
    seq_length: int,
    gradient_accumulation_steps: int,
    nodes: int,
    ranks_per_node: int,
    zero_stage: int | None = None,
    offload: str | None = None,
) -> ZeroLayout:
    """The layout a resolved DeepSpeed config describes; zero_stage / offload (flags) replace the file's."""
    startup.import_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = dict(ds.get("zero_optimization") or {})
    if zero_stage is not None:
        check_zero(zero_stage, False, False)  # before DeepSpeed's own, less readable, validation
        zero["stage"] = zero_stage
    if offload is not None:
        for key, wanted in (
            ("offload_optimizer", offload != "none"),
            ("offload_param", offload == "optimizer+params"),
        ):
            section = dict(zero.get(key) or {})
            section["device"] = "cpu" if wanted else "none"
            zero[key] = section
    try:
        z = DeepSpeedZeroConfig(**zero)
    except Exception as e:  # pydantic's ValidationError and DeepSpeed's own asserts
        raise ConfigError(f"DeepSpeed rejects zero_optimization in {path}: {first_line(e)}") from None
    sections = {"offload_optimizer": z.offload_optimizer, "offload_param": z.offload_param}
    devices = {k: (str(getattr(s.device, "value", s.device)) if s else "none") for k, s in sections.items()}
    for key, device in devices.items():
        if device not in ("none", "cpu"):
            raise ConfigError(
                f"zero_optimization.{key}.device {device!r} in {path} is not modelled by dskit estimate: "
                "estimate with --offload optimizer (CPU) instead"
            )
    pins = [s.pin_memory for k, s in sections.items() if s is not None and devices[k] == "cpu"]
    precision = 4 if not (ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled")) else 2
    return ZeroLayout(
        stage=int(z.stage),
        offload_optimizer=devices["offload_optimizer"] == "cpu",
        offload_params=devices["offload_param"] == "cpu",
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dtype_bytes=precision,
        pin_memory=all(pins) if pins else True,
        reduce_bucket_size=int(z.reduce_bucket_size),
        prefetch_bucket_size=int(z.prefetch_bucket_size),
        sub_group_size=int(z.sub_group_size),
        overlap_comm=bool(z.overlap_comm),
        contiguous_gradients=bool(z.contiguous_gradients),
    )


def resolve_liger(choice: str, model_type: str) -> bool:
    """--liger auto|on|off for a GPU run, decided as kernels.plan decides it on a CUDA device."""
    if choice == "off":
        return False
    from model_utils.model.kernels import liger_model_types

    types = liger_model_types()
    if types is not None and model_type in types:
        return True
    if choice == "on":
        reason = (
            "liger-kernel is not installed" if types is None else f"Liger has no kernels for {model_type!r}"
        )
        raise ConfigError(f"--liger on: {reason}: use --liger auto or --liger off")
    return False


def resolve_layout(
    settings: Any,
    nodes: int,
    ranks_per_node: int,
    zero_stage: int | None = None,
    offload: str | None = None,
    on_gpus: bool = True,
) -> tuple[ModelShape, ZeroLayout]:
    """The shape and layout of a resolved run's settings (preflight.RunSettings)."""
    from model_utils.config.arguments import AUTO

    cfg, ts, model_config = settings.config, settings.train, settings.model_config
    # A micro batch of "auto" (probed on the GPU at launch) is estimated at 1, the smallest the probe picks.
    micro_batch = 1 if ts.micro_batch_size == AUTO else int(ts.micro_batch_size)
    layout = layout_from_deepspeed(
        ts.deepspeed_json(micro_batch, total_steps=cfg.loop.max_steps),
        ts.path,
        micro_batch_size=micro_batch,
        seq_length=settings.seq_length,
        gradient_accumulation_steps=ts.gradient_accumulation_steps,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        zero_stage=zero_stage,
        offload=offload,
    )
    layout = dataclasses.replace(
        layout,
        # CPU ranks never use Liger (kernels.plan): no need to import it to find out which models it covers.
        liger=on_gpus and resolve_liger(cfg.model.liger, str(getattr(model_config, "model_type", ""))),
        compile=bool(cfg.model.compile),
        activation_checkpointing=cfg.model.activation_checkpointing,
        sequence_parallel=cfg.optim.sequence_parallel,
        pairs=cfg.objective.preference,
        backend=ts.backend,
        offload_optimizer=layout.offload_optimizer or ts.fsdp_cpu_offload,
    )
    source = settings.source
    shape = model_shape(
        model_config,
        source.name,
        source.preset is not None,
        layout.dtype_bytes,
        cache_dir=Path(cfg.data.data_cache_dir),
    )
    if cfg.lora.enabled:
        shape = with_lora(shape, model_config, cfg.lora)
    return shape, layout


def with_lora(shape: ModelShape, model_config: Any, lora_args: Any) -> ModelShape:
    """The shape of the model with --lora_r's adapters: counted on the meta device with peft, as training
    builds it (lora.apply); its total includes the adapters, and only they (and --lora_modules_to_save) train."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.model import lora

    with torch.device("meta"):
        model = lora.wrap(AutoModelForCausalLM.from_config(model_config), lora_args)
    trainable, total = lora.parameter_counts(model)
    largest = max(p.numel() for p in model.parameters() if p.requires_grad)
    return dataclasses.replace(
        shape, total_params=total, trainable_params=trainable, largest_trainable_param=largest
    )


def estimate_for_config(
    settings: Any, nodes: int, ranks_per_node: int, on_gpus: bool = True
) -> MemoryEstimate:
    """The estimate for a resolved run's settings as it would run on nodes x ranks_per_node ranks.

    The figures are for GPU ranks: with CPU ranks (no GPU) the per-GPU figure lives in host RAM too.
    """
    shape, layout = resolve_layout(settings, nodes, ranks_per_node, on_gpus=on_gpus)
    return estimate(shape, layout)


def fits_gpu(est: MemoryEstimate, gpu_bytes: int) -> bool:
    """The per-GPU estimate within FIT_FRACTION of the GPU's memory (the rest: allocator fragmentation)."""
    return est.device_bytes_per_rank <= FIT_FRACTION * gpu_bytes
