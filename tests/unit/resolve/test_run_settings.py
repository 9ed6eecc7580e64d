"""What the config and the model decide before any data work (resolver.resolve_settings): a frozen RunSettings,
and its record in every checkpoint's launch.json (to_dict), here for the tiny preset with the kit's defaults."""

from __future__ import annotations

import dataclasses

import pytest

from model_utils.config.arguments import parse_args
from model_utils.resolve import resolver
from model_utils.resolve.run_settings import RunSettings


def test_the_settings_of_the_defaults_and_their_record() -> None:
    settings = resolver.resolve_settings(
        parse_args(["--seq_length", "64", "--activation_checkpointing", "every_2"])
    )
    assert isinstance(settings, RunSettings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seq_length = 128  # type: ignore[misc]
    assert settings.to_dict() == {
        "model": "tiny-qwen3",  # a preset: no hub commit pinned
        "seq_length": 64,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "lr": 3e-3,  # the tiny preset's own
        "warmup_steps": settings.train.schedule.warmup_steps,
        "backend": "deepspeed",
        "precision": "bf16",
        "zero_stage": 2,
        "spike_guard": "skip",  # ZeRO-2 discards a step DeepSpeed finds non-finite: the default guard runs
        "activation_checkpointing": "1 of 2 decoder layers (every_2)",
    }
