"""The DeepSpeed engine's JSON: the resolved settings written into the config's "auto" keys, and bad configs (not
JSON, unknown or misspelt keys, keys DeepSpeed rejects or the kit derives) refused in one line. The file's explicit
keys against the flags: tests/unit/config/test_deepspeed_file.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from support.deepspeed_files import DEFAULT, ds_dict, resolve_ds, write_ds


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
