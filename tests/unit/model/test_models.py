"""Presets are the real architectures; model sources resolve or fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.config.presets import PRESETS
from model_utils.errors import ConfigError
from model_utils.model import models


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


def test_short_names_for_checkpoint_tags() -> None:
    assert models.resolve_model_source("Qwen/Qwen3-0.6B").short_name == "qwen3_0_6b"
    assert models.resolve_model_source("tiny-qwen3").short_name == "tiny_qwen3"


def test_local_model_dir_round_trip(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = PRESETS["tiny-qwen3"].build_config()
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    source = models.resolve_model_source(str(tmp_path / "m"))
    assert source.local_dir == tmp_path / "m"
    assert models.load_model_config(source).hidden_size == 64


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tiny-qwen4", "unknown model 'tiny-qwen4': not a preset"),
        ("/no/such/model", "does not exist"),
        ("./relative/missing", "does not exist"),
    ],
)
def test_unknown_models(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        models.resolve_model_source(name)


def test_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        models.resolve_model_source(str(tmp_path))


def test_sequence_length_limits() -> None:
    config = PRESETS["tiny-qwen3"].build_config()
    assert models.resolve_seq_length(None, config) == 256
    assert models.resolve_seq_length(None, PRESETS["qwen3-0.6b"].build_config()) == 2048
    with pytest.raises(ConfigError, match="above the model's maximum positions"):
        models.resolve_seq_length(257, config)


def test_hub_models_fail_fast_and_clearly_offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="could not load model config 'nobody/nothing'"):
        models.load_model_config(models.resolve_model_source("nobody/nothing"))
