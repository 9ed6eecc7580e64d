"""The DeepSpeed config a run trains with: flags filling its "auto" keys, a file's explicit keys winning when no
flag is given and refused when one disagrees, bad configs as one line, and --backend fsdp's own default config."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.resolve import train_settings
from model_utils.resolve.train_settings import TrainSettings
from support.deepspeed_files import DEFAULT, ds_dict, write_ds


def resolve_ds(argv: list[str]) -> TrainSettings:
    return train_settings.resolve(parse_args(argv))


def test_flag_overrides_fill_auto_keys() -> None:
    flags = [
        "--micro_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "3",
        "--lr",
        "1e-4",
        "--warmup_steps",
        "2",
    ]
    cfg = parse_args(["--deepspeed_config", str(DEFAULT), *flags])
    ds = ds_dict(cfg, total_steps=40)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["optimizer"]["params"]["lr"] == 1e-4
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 2
    assert ds["scheduler"]["params"]["total_num_steps"] == 40


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


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"zero_optimisation": {"stage": 2}}', "unknown key 'zero_optimisation'"),
        ('{"gradient_clippin": 1.0}', "did you mean 'gradient_clipping'?"),
        ('{"zero_optimization": {"stage": 2, "offload_optimiser": {}}}', "DeepSpeed rejects"),
        ('{"train_batch_size": 64}', "remove it"),
        # The user's old README documented this key; DeepSpeed's WarmupCosineLR calls it cos_min_ratio.
        (
            '{"scheduler": {"type": "WarmupCosineLR", "params": {"cosine_min_ratio": 0.0}}}',
            "did you mean 'cos_min_ratio'?",
        ),
        ('{"scheduler": {"type": "WarmupCosine"}}', "unknown scheduler type 'WarmupCosine'"),
    ],
)
def test_bad_deepspeed_config(tmp_path: Path, content: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_ds(["--deepspeed_config", write_ds(tmp_path, content)])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_override_without_its_section_is_an_error(tmp_path: Path) -> None:
    path = write_ds(tmp_path, {"zero_optimization": {"stage": 1}})
    resolve_ds(["--deepspeed_config", path])  # no scheduler and no flag: fine
    with pytest.raises(ConfigError, match=r"--warmup_steps given but .* has no .scheduler. section"):
        resolve_ds(["--deepspeed_config", path, "--warmup_steps", "5"])


def test_missing_deepspeed_config() -> None:
    with pytest.raises(ConfigError, match="not found"):
        resolve_ds(["--deepspeed_config", "/nonexistent/ds.json"])


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
