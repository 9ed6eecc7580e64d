"""Built-in model presets: architectures trained from random initialisation.

Kept free of heavy imports so argument parsing stays fast; transformers is imported only to build a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model_utils.assets import TOKENIZER_DIR

# Learning rate for pretrained models and presets without their own (the user's documented 5e-5).
PRETRAINED_LR = 5e-5


@dataclass(frozen=True)
class Preset:
    name: str
    config: dict[str, Any] = field(repr=False)
    tokenizer: str
    lr: float

    def build_config(self) -> Any:
        from transformers import Qwen3Config

        return Qwen3Config(**self.config)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # A few hundred thousand parameters: trains in seconds on a laptop CPU, so its lr is high.
        Preset(
            name="tiny-qwen3",
            config=dict(
                vocab_size=2048,
                hidden_size=64,
                intermediate_size=192,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=256,
                tie_word_embeddings=True,
                rope_theta=10000.0,
            ),
            tokenizer=str(TOKENIZER_DIR),
            lr=3e-3,
        ),
        # The true Qwen3-0.6B architecture (transformers' Qwen3 with q/k-norm), randomly initialised.
        Preset(
            name="qwen3-0.6b",
            config=dict(
                vocab_size=151936,
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                max_position_embeddings=40960,
                tie_word_embeddings=True,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
            ),
            tokenizer="Qwen/Qwen3-0.6B",
            lr=PRETRAINED_LR,
        ),
    )
}


def default_lr(model: str) -> float:
    """The peak learning rate when --lr is not given: the preset's own, else PRETRAINED_LR."""
    preset = PRESETS.get(model)
    return preset.lr if preset else PRETRAINED_LR
