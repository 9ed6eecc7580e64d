"""transformers' private parts the kit uses (compat/transformers_internals.py): an upgrade that removes one fails
here, by name."""

from __future__ import annotations

import transformers
from transformers import AutoModelForCausalLM

from model_utils.compat import transformers_internals
from model_utils.config.presets import PRESETS


def test_the_attention_implementation_a_model_was_built_with() -> None:
    config = PRESETS["tiny-qwen3"].build_config()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert hasattr(model.config, "_attn_implementation"), (
        f"transformers {transformers.__version__} configs have no _attn_implementation: update "
        "src/model_utils/compat/transformers_internals.py"
    )
    assert transformers_internals.attn_implementation(model.config) == "sdpa"
    assert transformers_internals.attn_implementation(object()) == ""


def test_a_model_types_decoder_layers_without_building_it() -> None:
    assert hasattr(AutoModelForCausalLM, "_model_mapping"), (
        f"transformers {transformers.__version__} has no AutoModelForCausalLM._model_mapping: update "
        "src/model_utils/compat/transformers_internals.py (FSDP's per-layer sharding names its layers through it)"
    )
    assert transformers_internals.no_split_modules(PRESETS["tiny-qwen3"].build_config()) == (
        "Qwen3DecoderLayer",
    )
