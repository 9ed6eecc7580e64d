"""The presets are the real architectures (transformers' Qwen3, q/k-norm included), trained from random
initialisation with their own tokenizer and learning rate."""

from __future__ import annotations

from pathlib import Path

from model_utils.config.presets import PRESETS, PRETRAINED_LR


def param_count(preset: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(PRESETS[preset].build_config())
    return sum(p.numel() for p in model.parameters())


def test_tiny_preset_is_a_few_hundred_thousand_parameters() -> None:
    assert 100_000 < param_count("tiny-qwen3") < 1_000_000


def test_qwen3_0_6b_preset_is_the_real_architecture() -> None:
    config = PRESETS["qwen3-0.6b"].build_config()
    assert type(config).__name__ == "Qwen3Config"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (1024, 28, 3072)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 8, 128)
    assert config.vocab_size == 151936 and config.tie_word_embeddings
    # Qwen3-0.6B has 596M parameters with tied embeddings (0.44B without them).
    assert 590e6 < param_count("qwen3-0.6b") < 600e6


def test_qwen3_has_qk_norm() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(PRESETS["tiny-qwen3"].build_config())
    names = {n for n, _ in model.named_parameters()}
    assert any("q_norm" in n for n in names) and any("k_norm" in n for n in names)


def test_the_tiny_preset_has_the_embedded_tokenizer_and_its_own_higher_lr() -> None:
    from transformers import AutoTokenizer

    tiny = PRESETS["tiny-qwen3"]
    assert (Path(tiny.tokenizer) / "tokenizer.json").is_file()  # the embedded asset: no hub needed
    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    assert len(tokenizer) <= tiny.build_config().vocab_size  # every token id has an embedding row
    assert tiny.lr > PRETRAINED_LR  # a few hundred thousand parameters from scratch: a high lr
    assert all(p.name == name for name, p in PRESETS.items())
