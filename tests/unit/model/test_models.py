"""Model sources (a preset, a local directory, a hub id) resolve or fail clearly. The presets themselves:
tests/unit/config/test_presets.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.config.presets import PRESETS
from model_utils.errors import ConfigError
from model_utils.model import models


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
