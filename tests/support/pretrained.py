"""Tiny models without the hub: the tiny-qwen3 preset in memory (seeded, fp32 by default), and saved with its
tokenizer as a "pretrained" model dir (what --model takes as a local dir; LoRA refuses presets, which are random
init)."""

from __future__ import annotations

from pathlib import Path

import torch

from model_utils.assets import TOKENIZER_DIR
from model_utils.config.presets import PRESETS


def save_tiny_qwen3(out: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(PRESETS["tiny-qwen3"].build_config()).save_pretrained(out)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(out)
    return out


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """The tiny-qwen3 preset, randomly initialised from `seed`, with SDPA attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        PRESETS["tiny-qwen3"].build_config(), attn_implementation="sdpa", dtype=dtype
    )


def checkpointed(model) -> list[bool]:
    """For each decoder layer, whether it is activation-checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
