"""transformers' private parts the kit uses where nothing public does the job."""

from __future__ import annotations

from typing import Any


def attn_implementation(config: Any) -> str:
    """The attention implementation a model was built with: transformers keeps it in the config's private
    `_attn_implementation` (the public `attn_implementation` is the requested one, which may be None)."""
    return str(getattr(config, "_attn_implementation", "") or "")


def no_split_modules(model_config: Any) -> tuple[str, ...]:
    """The class names of a model type's decoder layers (what FSDP shards one by one), without building it: the
    auto class's private `_model_mapping` and the model class's `_no_split_modules`, which accelerate and FSDP's
    own wrapping read."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(model_config)]
    return tuple(getattr(model_class, "_no_split_modules", None) or ())
