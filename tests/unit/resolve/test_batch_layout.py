"""--global_batch_tokens: the accumulation derived from a global batch in tokens, its errors, the run-file key,
the layout's log line and `dskit config`; the embedded default on CPU stays micro batch 1 x accumulation 1; the
default DeepSpeed config on CUDA, GPU-only where the memory estimate fits a given GPU memory size. (The CUDA
batch default on the ranks, against a fake GPU: tests/unit/resolve/test_micro_batch_probe.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_utils.config.arguments import CUDA_GLOBAL_BATCH_TOKENS, parse_args
from model_utils.errors import ConfigError
from model_utils.repo import REPO_ROOT
from model_utils.resolve import batch_layout, resolver, train_settings
from model_utils.resolve.memory_estimate import GiB


@pytest.fixture(scope="module")
def flags(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Shared data cache (the embedded corpus is tokenized once for the module)."""
    root = tmp_path_factory.mktemp("gbt")
    return [
        "--seq_length",
        "32",
        "--data_cache_dir",
        str(root / "cache"),
        "--checkpoint_dir",
        str(root / "ckpt"),
    ]


def test_accumulation_comes_nearest_the_requested_tokens() -> None:
    assert batch_layout.accumulation_for(262_144, 16, 1, 2048) == 8  # the anchor's 16 x 8 x 2048
    assert batch_layout.accumulation_for(262_144, 16, 8, 2048) == 1
    assert (
        batch_layout.accumulation_for(262_144, 16, 64, 2048) == 1
    )  # at least 1, even when one step overshoots
    assert batch_layout.accumulation_for(1000, 3, 1, 100) == 3  # 3.33 rounds down
    assert batch_layout.accumulation_for(1000, 3, 1, 60) == 6  # 5.56 rounds up
    layout = batch_layout.BatchLayout(3, 3, 1, 100, 1000, "--global_batch_tokens")
    assert layout.tokens == 900
    assert layout.describe().endswith("3 x 3 x 1 x 100 = 900; requested 1000 (--global_batch_tokens), -10.0%")
    assert "requested" not in batch_layout.BatchLayout(1, 2, 4, 8, None, None).describe()


def test_global_batch_tokens_errors_and_run_file_key(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match="--global_batch_tokens and --gradient_accumulation_steps both given"
    ):
        parse_args(["--global_batch_tokens", "4096", "--gradient_accumulation_steps", "2"])
    with pytest.raises(ConfigError, match="--global_batch_tokens 0 must be at least 1"):
        parse_args(["--global_batch_tokens", "0"])
    run = tmp_path / "run.yaml"
    run.write_text("optim: {global_batch_tokens: 5e5}\n")  # YAML 1.1's string, as a number
    assert parse_args(["--config", str(run)]).optim.global_batch_tokens == 500_000
    run.write_text("optim: {gradient_accumulation_steps: 4}\n")
    over = parse_args(["--config", str(run), "--global_batch_tokens", "4096"])  # the flag replaces the file's
    assert over.optim.global_batch_tokens == 4096 and "gradient_accumulation_steps" not in over.explicit
    run.write_text("optim: {gradient_accumulation_steps: 4, global_batch_tokens: 4096}\n")
    with pytest.raises(ConfigError, match="both given: keep one of them"):
        parse_args(["--config", str(run)])
    fixed = tmp_path / "ds.json"
    ds = json.loads(Path(REPO_ROOT / "deepspeed/ds_config.json").read_text())
    fixed.write_text(json.dumps({**ds, "gradient_accumulation_steps": 4}))
    with pytest.raises(ConfigError, match='sets gradient_accumulation_steps = 4: set it to "auto"'):
        train_settings.resolve(
            parse_args(["--global_batch_tokens", "4096", "--deepspeed_config", str(fixed)])
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU resolution")
def test_ranks_derive_the_accumulation_and_log_the_layout(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = parse_args([*flags, "--global_batch_tokens", "256"])
    run = resolver.prepare(cfg, world_size=2)  # the ranks' view (micro batch auto: 1 on CPU)
    assert (run.micro_batch_size, run.gradient_accumulation_steps, run.tokens_per_step) == (1, 4, 256)
    assert run.deepspeed_config()["gradient_accumulation_steps"] == 4  # what DeepSpeed gets
    assert cfg.optim.gradient_accumulation_steps == 1  # the user's config is not changed
    out = capsys.readouterr().out
    assert "1 x 4 x 2 x 32 = 256; requested 256 (--global_batch_tokens), +0.0%" in out
    assert run.to_dict()["resolved"]["gradient_accumulation_steps"] == 4
    # An explicit micro batch is kept; the nearest accumulation may miss N: the deviation is logged.
    run = resolver.prepare(parse_args([*flags, "--global_batch_tokens", "256", "--micro_batch_size", "3"]), 2)
    assert (run.micro_batch_size, run.gradient_accumulation_steps) == (3, 1)
    assert "3 x 1 x 2 x 32 = 192; requested 256 (--global_batch_tokens), -25.0%" in capsys.readouterr().out
    # `dskit config` (no ranks): the request is shown, the per-rank values stay open.
    resolved = resolver.prepare(cfg).to_dict()
    assert resolved["resolved"]["global_batch_tokens"] == 256
    assert resolved["resolved"]["gradient_accumulation_steps"].startswith("per rank")
    assert resolved["resolved"]["batch_layout"].startswith("per rank")
    assert resolved["deepspeed"].startswith("per rank")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU resolution")
def test_the_cpu_default_is_unchanged(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    run = resolver.prepare(parse_args(flags), world_size=1)
    assert (run.micro_batch_size, run.gradient_accumulation_steps, run.tokens_per_step) == (1, 1, 32)
    out = capsys.readouterr().out
    assert "CUDA batch default" not in out and "1 x 1 x 1 x 32 = 32\n" in out
    resolved = resolver.prepare(parse_args(flags)).to_dict()["resolved"]
    assert resolved["deepspeed_config"].startswith(
        "deepspeed/ds_config.json; on CUDA ranks deepspeed/ds_config_gpu"
    )
    assert (
        resolved["global_batch_tokens"]
        == f"{CUDA_GLOBAL_BATCH_TOKENS} on CUDA ranks (with micro batch auto), else none"
    )


# --- the default DeepSpeed config on CUDA: GPU-only where the memory estimate fits -----------------------------


def test_the_default_config_on_cuda_is_gpu_only_where_the_estimate_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The decision with a GPU memory size given (as the ranks read it from their GPU; none here): Qwen3-0.6B
    at seq 2048, micro batch 1, fits an 80 GiB H100 without offload and not a 16 GiB GPU."""
    cfg = parse_args(["--model", "qwen3-0.6b", "--seq_length", "2048", "--liger", "off"])
    on_h100 = resolver.resolve_settings(cfg, gpu_bytes=80 * GiB, world_size=1)
    assert on_h100.train.path == "deepspeed/ds_config_gpu.json"
    line = capsys.readouterr().out
    used = float(line.split("estimated ")[1].split(" GiB")[0])
    assert 5 < used < 0.9 * 80  # the estimate of GPU-only at micro batch 1, which the offload default is not
    assert (
        f"deepspeed config: {'deepspeed/ds_config_gpu.json'} (GPU-only: estimated {used} GiB of 80 GiB per GPU)"
        in line
    )
    small = resolver.resolve_settings(cfg, gpu_bytes=int(used / 0.9 * GiB) - GiB, world_size=1)
    assert small.train.path == "deepspeed/ds_config.json"
    assert "(CPU optimizer offload: GPU-only needs an estimated" in capsys.readouterr().out
    # Without a GPU (the batch host, CPU ranks) the default stays, and a given config is never replaced.
    assert resolver.resolve_settings(cfg).train.path == "deepspeed/ds_config.json"
    for flags in (["--deepspeed_config", "deepspeed/ds_config.json"], ["--backend", "fsdp"]):
        given = parse_args([*flags, "--seq_length", "32"])
        assert not train_settings.default_in_use(given)
        path = resolver.resolve_settings(given, gpu_bytes=80 * GiB).train.path
        assert path == train_settings.given(given)[0] and "deepspeed config:" not in capsys.readouterr().out
