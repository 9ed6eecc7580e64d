"""`--micro_batch_size auto`: the memory probe, run on CPU wherever a real mechanism exists (issue #17, item 4).

micro_batch_probe.resolve and its real _GpuProbe against a fake GPU whose memory is the real bytes of the
probe's CPU tensors (tests/support/fake_gpu.py; only the GPU is faked); the search, the cache and the reserve
with a fake probe function; the flag through the config and the ranks; and, marked `gpu`, the real probe.
"""

from __future__ import annotations

import gc
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from dskit import cli
from model_utils.compat import liger_internals
from model_utils.config.arguments import CUDA_GLOBAL_BATCH_TOKENS, parse_args
from model_utils.errors import ConfigError
from model_utils.launch import startup
from model_utils.model import kernels
from model_utils.resolve import micro_batch_probe, resolver, train_settings
from support.fake_gpu import FakeGpuMemory
from support.pretrained import tiny_model

REPO = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")
_PLAIN = kernels.Plan(liger=False, compile=False)  # Liger needs Triton on a GPU (or the interpreter above)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpuMemory:
    """A fake GPU for autobatch: DeepSpeed's accelerator says cuda, torch.cuda's memory queries read the fake,
    and the probe's model lives on the CPU (its tensors are the fake GPU's memory). The capacity is set by the
    test. Everything else, the probe's forward and backward, its ballast, search, cache and cap, is real."""
    memory = FakeGpuMemory(total_memory=2**62)
    memory.install(monkeypatch)
    memory.builds = 0
    frozen_at_probe: list[int] = []  # how many objects were out of the collector at each probe
    memory.frozen_at_probe = frozen_at_probe
    startup.import_deepspeed()
    import deepspeed.accelerator

    monkeypatch.setattr(
        deepspeed.accelerator, "get_accelerator", lambda: types.SimpleNamespace(device_name=lambda: "cuda")
    )

    class OnFakeGpu(micro_batch_probe._GpuProbe):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)  # the limit from the fake's total memory
            self.device = CPU

        def _build(self) -> Any:
            memory.builds += 1
            return super()._build()

        def __call__(self, batch: int) -> bool:
            frozen_at_probe.append(gc.get_freeze_count())
            with memory:
                return super().__call__(batch)

    monkeypatch.setattr(micro_batch_probe, "_GpuProbe", OnFakeGpu)
    return memory


def _ds_config(path: Path, offload: bool) -> Path:
    zero: dict[str, Any] = {
        "stage": 2,
        "overlap_comm": False,
        "reduce_bucket_size": 500_000,
        "allgather_bucket_size": 500_000,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    path.write_text(
        json.dumps(
            {
                "bf16": {"enabled": True},
                "zero_optimization": zero,
                "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            }
        )
    )
    return path


def test_auto_micro_batch_finds_what_fits_beside_deepspeed_on_a_fake_gpu(
    tmp_path: Path, fake_gpu: FakeGpuMemory
) -> None:
    cache_dir = tmp_path / "cache"

    def settings(offload: bool) -> resolver.RunSettings:
        config = _ds_config(tmp_path / f"ds_{offload}.json", offload)
        flags = ["--micro_batch_size", "auto", "--seq_length", "32", "--liger", "off"]
        return resolver.resolve_settings(
            parse_args([*flags, "--deepspeed_config", str(config), "--data_cache_dir", str(cache_dir)])
        )

    offloaded, on_gpu = settings(offload=True), settings(offload=False)
    # What forward and backward take at each size with no ballast (weights, gradients, activations): the
    # probe itself, on the unlimited fake.
    peaks = {}
    dtype = offloaded.train.torch_dtype()
    with micro_batch_probe._GpuProbe(offloaded.model_config, dtype, _PLAIN, 32, 0) as probe:
        for batch in (1, 2, 4, 8):
            assert probe(batch)
            peaks[batch] = fake_gpu.peak
    assert peaks[1] < peaks[2] < peaks[4] < peaks[8]
    n_params = _n_params(offloaded)
    reserve = {
        name: micro_batch_probe.gpu_reserve_bytes(
            s.train.deepspeed_json(micro_batch_size=1, total_steps=1), n_params, 1
        )
        for name, s in (("offloaded", offloaded), ("on_gpu", on_gpu))
    }
    assert reserve["on_gpu"] == reserve["offloaded"] + 16 * n_params  # the optimizer states stay on the GPU
    # A GPU on which micro batch 4 fits beside the offload config's reserve and 8 does not.
    limit = reserve["offloaded"] + (peaks[4] + peaks[8]) // 2
    fake_gpu.total_memory = int(limit / micro_batch_probe.HEADROOM)
    fake_gpu.builds = 0
    fake_gpu.frozen_at_probe.clear()

    assert micro_batch_probe.resolve(offloaded, n_train_blocks=10**6, n_val_blocks=None, world_size=1) == 4
    assert fake_gpu.builds == 1
    # Each probe's gc.collect() walks the probe's own objects only: the older ones are frozen meanwhile, and
    # given back after.
    assert fake_gpu.frozen_at_probe and min(fake_gpu.frozen_at_probe) > 100_000, fake_gpu.frozen_at_probe
    assert gc.get_freeze_count() == 0
    # The optimizer states the GPU-only config keeps there leave room for less.
    expected = max((b for b in peaks if peaks[b] + reserve["on_gpu"] <= limit), default=None)
    assert expected is None or expected < 4, (
        peaks,
        reserve,
        limit,
    )  # the sizes must make the test meaningful
    if expected is None:
        with pytest.raises(ConfigError, match="even micro batch 1 does not fit Fake GPU"):
            micro_batch_probe.resolve(on_gpu, 10**6, None, 1)
    else:
        assert micro_batch_probe.resolve(on_gpu, 10**6, None, 1) == expected

    # Cached per key in --data_cache_dir; a later run (any node sharing it) builds no probe model.
    stored = json.loads((cache_dir / micro_batch_probe.CACHE_FILE).read_text())
    (key,) = [k for k in stored if f"reserve {reserve['offloaded'] // 2**20} MiB" in k]
    assert "Fake GPU" in key and "seq 32" in key and stored[key]["micro_batch_size"] == 4
    builds = fake_gpu.builds
    assert micro_batch_probe.resolve(offloaded, 10**6, None, 1) == 4
    assert (
        micro_batch_probe.resolve(offloaded, n_train_blocks=3, n_val_blocks=None, world_size=1) == 3
    )  # the data caps
    assert micro_batch_probe.resolve(offloaded, 10**6, n_val_blocks=2, world_size=1) == 2
    assert fake_gpu.builds == builds


def test_the_probe_survives_running_out_of_fake_gpu_memory(fake_gpu: FakeGpuMemory) -> None:
    """An allocation past the capacity raises torch.OutOfMemoryError inside forward/backward, as CUDA's
    allocator does: the probe says it does not fit, frees what it held, and the next size can be tried."""
    config = resolver.resolve_settings(parse_args(["--seq_length", "32"])).model_config
    with micro_batch_probe._GpuProbe(config, torch.bfloat16, _PLAIN, 32, 0) as probe:
        assert probe(1)
        one = fake_gpu.peak
        fake_gpu.total_memory = one + 1  # batch 1 and its ballast-free peak fit, batch 4 cannot
        assert not probe(4)
        assert fake_gpu.live < one  # the failed try's activations and gradients are gone
        assert probe(1)  # and the same probe goes on


def test_cuda_ranks_default_to_auto_micro_batch_and_the_global_batch(
    tmp_path: Path, fake_gpu: FakeGpuMemory, capsys: pytest.CaptureFixture[str]
) -> None:
    """On CUDA ranks without a batch flag: micro batch auto (probed on the fake GPU) and the accumulation that
    makes CUDA_GLOBAL_BATCH_TOKENS; a batch flag keeps the embedded default; the ranks choose the default
    DeepSpeed config from their GPU's memory."""
    flags = ["--seq_length", "32", "--liger", "off", "--data_cache_dir", str(tmp_path / "cache")]
    flags += ["--checkpoint_dir", str(tmp_path / "ckpt")]
    settings = resolver.resolve_settings(parse_args(flags))
    reserve = micro_batch_probe.gpu_reserve_bytes(settings.train.deepspeed_json(1, 1), _n_params(settings), 1)
    fake_gpu.total_memory = reserve + 2**24  # 16 MiB beside DeepSpeed's reserve: a few sequences of 32 fit
    run = resolver.prepare(settings.config, world_size=1, settings=settings)
    micro = run.micro_batch_size
    assert isinstance(micro, int) and 1 < micro < micro_batch_probe.MAX_MICRO_BATCH  # probed, not the CPU's 1
    assert run.gradient_accumulation_steps == round(CUDA_GLOBAL_BATCH_TOKENS / (micro * 32))
    out = capsys.readouterr().out
    assert f"--global_batch_tokens {CUDA_GLOBAL_BATCH_TOKENS}" in out
    assert f"requested {CUDA_GLOBAL_BATCH_TOKENS} (the CUDA default), +0.0%" in out
    # The ranks resolve the settings themselves: on a GPU this roomy the default config is the GPU-only one.
    given = resolver.prepare(parse_args([*flags, "--micro_batch_size", "2"]), world_size=1)
    assert (given.micro_batch_size, given.gradient_accumulation_steps) == (2, 1)
    assert given.settings.train.path == "deepspeed/ds_config_gpu.json"
    out = capsys.readouterr().out
    assert (
        "CUDA batch default" not in out and "deepspeed config: deepspeed/ds_config_gpu.json (GPU-only" in out
    )


def _n_params(s: resolver.RunSettings) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(s.model_config).parameters())


# --- the search, the cache and the reserve, with a fake probe function --------------------------------------


def test_search_finds_the_largest_power_of_two_that_fits() -> None:
    """A fake probe (the real one needs a CUDA GPU): sizes up to 12 'fit'."""
    tried = []

    def fits(size: int) -> bool:
        tried.append(size)
        return size <= 12

    assert micro_batch_probe.search_micro_batch(fits) == 8 and tried == [1, 2, 4, 8, 16]
    assert micro_batch_probe.search_micro_batch(lambda b: True, max_size=64) == 64
    assert micro_batch_probe.search_micro_batch(lambda b: False) is None


def test_probe_result_is_cached_per_key(tmp_path: Path) -> None:
    """A fake probe function stands in for the GPU forward/backward; the cache file is real."""
    path = tmp_path / "cache" / micro_batch_probe.CACHE_FILE
    cache = micro_batch_probe.ProbeCache(path)
    calls = []

    def fits(size: int) -> bool:
        calls.append(size)
        return size <= 4

    assert micro_batch_probe.cached_search(cache, "qwen3|H100|seq 2048", fits, {"gpu": "H100"}, "H100") == (
        4,
        False,
    )
    assert micro_batch_probe.cached_search(cache, "qwen3|H100|seq 2048", fits, {}, "H100") == (4, True)
    assert calls == [1, 2, 4, 8]  # probed once
    assert micro_batch_probe.cached_search(cache, "qwen3|H100|seq 4096", fits, {}, "H100") == (4, False)
    assert len(calls) == 8  # another key probes again
    stored = json.loads(path.read_text())
    assert stored["qwen3|H100|seq 2048"] == {"micro_batch_size": 4, "gpu": "H100"}
    path.write_text("{torn")  # a damaged cache is probed again, never trusted
    assert micro_batch_probe.cached_search(cache, "qwen3|H100|seq 2048", fits, {}, "H100") == (4, False)
    assert [p.name for p in path.parent.iterdir()] == [
        micro_batch_probe.CACHE_FILE
    ]  # no temp files left behind
    with pytest.raises(ConfigError, match="even micro batch 1 does not fit H100 at --seq_length 8192"):
        micro_batch_probe.cached_search(cache, "huge", lambda b: False, {}, "H100 at --seq_length 8192")
    assert "huge" not in json.loads(path.read_text())


def test_reserve_follows_the_deepspeed_config() -> None:
    from model_utils.config.deepspeed_file import load_deepspeed_json

    n = 600_000_000
    offload = load_deepspeed_json("deepspeed/ds_config.json")
    on_gpu = load_deepspeed_json("deepspeed/ds_config_gpu.json")
    buckets = int(2 * 4.5 * 400_000_000)  # overlap_comm keeps 4.5x the two 2e8-element buckets
    assert (
        micro_batch_probe.gpu_reserve_bytes(offload, n, world_size=8) == buckets
    )  # optimizer states on the CPU
    assert micro_batch_probe.gpu_reserve_bytes(on_gpu, n, world_size=1) == 16 * n + buckets
    assert micro_batch_probe.gpu_reserve_bytes(on_gpu, n, world_size=8) == 16 * n // 8 + buckets
    assert (
        micro_batch_probe.gpu_reserve_bytes({"bf16": {"enabled": True}}, n, world_size=8) == 16 * n
    )  # no ZeRO


def test_auto_micro_batch_flag_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_args(["--micro_batch_size", "auto"])
    assert cfg.optim.micro_batch_size == "auto"
    assert train_settings.resolve(cfg).micro_batch_size == "auto"  # DeepSpeed checked it with 1
    assert (
        cli.main(["config", "--micro_batch_size", "auto", "--data_cache_dir", str(tmp_path / "cache")]) == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["optim"]["micro_batch_size"] == "auto"
    assert printed["resolved"]["micro_batch_size"] == 1  # this machine's ranks: CPU ones, which take 1
    planned = ["--gpus_per_node", "8", "--gpu_memory_gib", "80"]
    assert (
        cli.main(["config", *planned, "--micro_batch_size", "auto", "--data_cache_dir", str(tmp_path / "c")])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["resolved"]["micro_batch_size"] == "auto"  # probed at launch
    explicit = tmp_path / "ds.json"
    explicit.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}))
    with pytest.raises(
        ConfigError, match="--micro_batch_size auto disagrees with train_micro_batch_size_per_gpu"
    ):
        train_settings.resolve(
            parse_args(["--micro_batch_size", "auto", "--deepspeed_config", str(explicit)])
        )
    with pytest.raises(ConfigError, match="expected an integer or 'auto', got 'big'"):
        parse_args(["--micro_batch_size", "big"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU resolution")
def test_auto_micro_batch_resolves_on_the_ranks_only(
    tmp_path: Path, gloo_rank, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--micro_batch_size", "auto", "--seq_length", "32", "--data_cache_dir", str(tmp_path / "cache")]
    cfg = parse_args([*flags, "--checkpoint_dir", str(tmp_path / "ckpt")])
    run = resolver.prepare(cfg, world_size=gloo_rank.world_size)  # a training rank, on CPU
    assert (
        run.micro_batch_size == 1 and run.global_batch == 1 and run.steps_per_epoch == len(run.train_blocks)
    )
    assert cfg.optim.micro_batch_size == "auto"  # the user's config is not changed
    assert "--micro_batch_size auto: 1 (no CUDA GPU; the memory probe needs one)" in capsys.readouterr().out
    # `dskit prepare` (one process, no ranks): it leaves the probe to the ranks.
    run = resolver.prepare(cfg)
    assert run.micro_batch_size == "auto" and run.steps_per_epoch is None
    assert "probed on the GPU by the training ranks" in capsys.readouterr().out


# --- on a GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_real_probe_on_gpu(tmp_path: Path) -> None:
    cfg = parse_args(
        [
            "--micro_batch_size",
            "auto",
            "--seq_length",
            "256",
            "--data_cache_dir",
            str(tmp_path),
            "--liger",
            "on",
        ]
    )
    settings = resolver.resolve_settings(cfg)
    model_config = settings.model_config
    found = micro_batch_probe.resolve(settings, n_train_blocks=10**6, n_val_blocks=None, world_size=1)
    assert found >= 1 and found & (found - 1) == 0
    (entry,) = json.loads((tmp_path / micro_batch_probe.CACHE_FILE).read_text()).values()
    assert entry["micro_batch_size"] == found and entry["seq_length"] == 256
    assert micro_batch_probe.resolve(settings, 3, None, 1) == min(found, 3)  # cached, capped by the data
    # What was found trains: forward and backward at that size fit beside the ballast.
    with (
        micro_batch_probe._GpuProbe(model_config, torch.bfloat16, kernels.Plan(True, False), 256, 0) as probe,
        liger_internals.patches_undone(
            tiny_model()
        ),  # Liger's module-wide patches must not reach later tests
    ):
        assert probe(found)
