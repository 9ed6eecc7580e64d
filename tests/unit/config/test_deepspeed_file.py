"""The DeepSpeed-format config as given (config/deepspeed_file.py): its explicit keys train when no flag is given,
a flag that disagrees with one is refused (one that agrees is fine), a flag for a section the file lacks is refused,
and a missing file is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.resolve import train_settings
from support.deepspeed_files import ds_dict, resolve_ds, write_ds


def _explicit_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-5}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
        "zero_optimization": {"stage": 2},
    }


def test_explicit_keys_win_when_no_flag_is_given(tmp_path: Path) -> None:
    cfg = parse_args(["--deepspeed_config", write_ds(tmp_path, _explicit_config()), "--model", "org/m"])
    settings = train_settings.resolve(cfg)
    # The file's explicit keys are what trains (micro batch 2, not the flag's default 1), reported back...
    assert (settings.micro_batch_size, settings.gradient_accumulation_steps) == (2, 1)
    assert (settings.optim.lr, settings.schedule.warmup_steps) == (5e-5, 10)
    # ...and handed to DeepSpeed.
    ds = ds_dict(cfg, total_steps=100)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 1
    assert ds["optimizer"]["params"]["lr"] == 5e-5
    # The key the file leaves out is filled from its flag (--min_lr_ratio), as every absent key is.
    assert ds["scheduler"]["params"] == {"warmup_num_steps": 10, "total_num_steps": 100, "cos_min_ratio": 0.1}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--micro_batch_size", "4"],
            "--micro_batch_size 4 disagrees with train_micro_batch_size_per_gpu = 2",
        ),
        (["--lr", "1e-3"], "--lr 0.001 disagrees with optimizer.params.lr = 5e-05"),
        (["--warmup_steps", "3"], "--warmup_steps 3 disagrees with scheduler.params.warmup_num_steps = 10"),
        (["--max_steps", "50"], "total_num_steps = 100"),
    ],
)
def test_flag_and_explicit_key_disagreeing_is_an_error(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match="disagrees") as err:
        ds_dict(parse_args(["--deepspeed_config", write_ds(tmp_path, _explicit_config()), *flags]))
    assert message in str(err.value)


def test_agreeing_flag_and_key_is_fine(tmp_path: Path) -> None:
    cfg = parse_args(
        ["--deepspeed_config", write_ds(tmp_path, _explicit_config()), "--micro_batch_size", "2"]
    )
    assert train_settings.resolve(cfg).micro_batch_size == 2
    assert ds_dict(cfg, total_steps=100)["train_micro_batch_size_per_gpu"] == 2


def test_override_without_its_section_is_an_error(tmp_path: Path) -> None:
    path = write_ds(tmp_path, {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW"}})
    resolve_ds(["--deepspeed_config", path])  # no scheduler and no flag: fine
    with pytest.raises(ConfigError, match=r"--warmup_steps given but .* has no .scheduler. section"):
        resolve_ds(["--deepspeed_config", path, "--warmup_steps", "5"])


def test_missing_deepspeed_config() -> None:
    with pytest.raises(ConfigError, match="not found"):
        resolve_ds(["--deepspeed_config", "/nonexistent/ds.json"])
