"""The train settings each backend resolves to: --backend fsdp reads its own default config (no ZeRO) and trains the
same optimizer and schedule as DeepSpeed, and refuses the kit's ZeRO config given explicitly. The optimizer and
schedule themselves: tests/unit/optim/test_settings.py; the file's keys against the flags:
tests/unit/config/test_deepspeed_file.py."""

from __future__ import annotations

import pytest

from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.resolve import train_settings
from support.deepspeed_files import DEFAULT


def test_fsdp_reads_its_own_default_config_and_refuses_zero_in_a_given_one() -> None:
    """--backend fsdp without --deepspeed_config: deepspeed/fsdp.json (the default without ZeRO), bf16, and a step
    FSDP can always discard (the spike guard); the kit's ZeRO config given explicitly is refused."""
    fsdp = train_settings.resolve(parse_args(["--backend", "fsdp"]))
    assert (fsdp.path, fsdp.backend, fsdp.precision, fsdp.zero_stage) == (
        "deepspeed/fsdp.json",
        "fsdp",
        "bf16",
        0,
    )
    assert fsdp.discards_nonfinite_steps and not fsdp.fsdp_cpu_offload
    default = train_settings.resolve(parse_args([]))
    assert default.optim.lr == fsdp.optim.lr and default.optim.weight_decay == fsdp.optim.weight_decay
    assert default.optim == fsdp.optim  # the same training otherwise (betas, eps, clipping too)
    assert fsdp.lr_at(100, [1, 10, 50, 100]) == default.lr_at(100, [1, 10, 50, 100])
    with pytest.raises(ConfigError, match=r"zero_optimization in .*ds_config.json is DeepSpeed's ZeRO"):
        train_settings.resolve(parse_args(["--deepspeed_config", str(DEFAULT), "--backend", "fsdp"]))
