"""--liger/--compile, the TORCH_CUDA_ARCH_LIST fix for DeepSpeed's op builder, and --micro_batch_size auto.

Without a GPU: Liger's Triton kernels and the memory probe cannot run, so the CPU tests check the decisions
(which kernels for which device), Liger's real patching (not its kernels), the probe's search and cache with a
fake probe function, and torch.compile through the real Trainer. The tests marked `gpu` check the kernels'
numbers, inductor, the real probe and `dskit bench` on a CUDA GPU (skipped here).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
from pathlib import Path

import pytest
import torch

from dskit import cli
from model_utils.config.arguments import ModelArgs, parse_args
from model_utils.config.presets import PRESETS
from model_utils.errors import ConfigError
from model_utils.model import kernels
from model_utils.resolve import micro_batch_probe, resolver, train_settings
from support.small_trainer import make_trainer

REPO = Path(__file__).resolve().parents[2]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        PRESETS["tiny-qwen3"].build_config(), attn_implementation="sdpa", dtype=dtype
    )


# --- --liger and --compile: what is applied where ------------------------------------------------------------


@pytest.mark.parametrize(
    ("liger", "device", "types", "expected"),
    [
        ("auto", CPU, None, False),
        ("off", CUDA, None, False),
        ("auto", CUDA, "real", True),  # Liger's own table of supported model types
        ("on", CUDA, "real", True),
        ("auto", CUDA, "none", False),  # liger-kernel not installed
        ("auto", CUDA, "other", False),  # a model type Liger has no kernels for
    ],
)
def test_liger_resolves_per_device_and_model(liger: str, device: torch.device, types, expected: bool) -> None:
    supported = {
        None: kernels.liger_model_types,
        "real": kernels.liger_model_types,
        "none": lambda: None,
        "other": lambda: frozenset({"llama"}),
    }[types]
    chosen = kernels.plan(ModelArgs(liger=liger, compile=True), "qwen3", device, supported)
    assert (chosen.liger, chosen.compile) == (expected, True)
    assert "qwen3" in kernels.liger_model_types()


@pytest.mark.parametrize(
    ("device", "types", "message"),
    [
        (CPU, kernels.liger_model_types, "--liger on needs a CUDA GPU"),
        (CUDA, lambda: None, "--liger on: liger-kernel is not installed: use --liger auto or --liger off"),
        (CUDA, lambda: frozenset({"llama"}), "--liger on: Liger has no kernels for model type 'qwen3'"),
    ],
)
def test_liger_on_that_cannot_be_met_is_an_error(device: torch.device, types, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        kernels.plan(ModelArgs(liger="on"), "qwen3", device, types)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_liger_on_on_cpu_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--liger", "on"]) == 2
    assert cli.main(["config", "--liger", "maybe"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --liger on needs a CUDA GPU (Liger's kernels are Triton GPU kernels) but this run is on cpu: "
        "use --liger auto (off without a GPU) or --liger off",
        "error: --liger 'maybe' is not one of auto, on, off",
    ]


def test_liger_patches_on_an_instance_are_undone_for_a_probe_model() -> None:
    """Liger's real patching (its kernels need a GPU): RoPE is swapped module-wide; patches_undone restores it."""
    from transformers.models.qwen3 import modeling_qwen3

    rope, norm, mlp = (
        modeling_qwen3.apply_rotary_pos_emb,
        modeling_qwen3.Qwen3RMSNorm,
        modeling_qwen3.Qwen3MLP,
    )
    model = tiny_model()
    with kernels.patches_undone(model):
        kernels.apply_plan(model, kernels.Plan(liger=True, compile=False))
        assert modeling_qwen3.apply_rotary_pos_emb is not rope and modeling_qwen3.Qwen3RMSNorm is not norm
        assert type(model).__name__ == "Qwen3ForCausalLM" and "forward" in vars(model)
    assert (modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3MLP) == (
        rope,
        norm,
        mlp,
    )
    # With compile on, only the fused loss comes from Liger: nothing module-wide changes.
    model = tiny_model()
    with kernels.patches_undone(model):
        kernels.apply_plan(model, kernels.Plan(liger=True, compile=True), compile_model=False)
        assert modeling_qwen3.apply_rotary_pos_emb is rope and modeling_qwen3.Qwen3RMSNorm is norm
        assert "forward" in vars(model)


def test_liger_loss_falls_back_to_the_model_forward_under_zero3() -> None:
    """Under ZeRO-3 lm_head.weight is an empty shard that Liger would read; the model's own forward runs then.
    The Liger forward is a stand-in here (its Triton kernel cannot run on CPU); `ds_id` is DeepSpeed's tag."""
    model, reference = tiny_model(), tiny_model()
    calls = []

    def liger_forward(**kwargs):
        calls.append(kwargs)
        return "liger"

    forward = kernels._flce_unless_zero3(model, liger_forward)
    ids = torch.randint(0, 2048, (2, 16))
    assert forward(input_ids=ids, labels=ids) == "liger" and len(calls) == 1
    model.lm_head.weight.ds_id = 0  # what ZeRO-3 sets on the parameters it partitions
    loss = forward(input_ids=ids, labels=ids).loss
    assert len(calls) == 1 and torch.allclose(loss, reference(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_compile_trains_like_eager_through_each_engine(
    backend: str, tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compile true through the real Trainer (ZeRO-2 with CPU Adam; FSDP2, compiled before sharding): the same
    losses as eager, the same state_dict keys. Dynamo and AOTAutograd run for real; the backend is aot_eager
    because inductor's cold C++ build takes ~90 s on 2 cores (inductor runs in the GPU test below)."""
    losses = {}
    for compiled in (False, True):
        if compiled:
            aot_eager = functools.partialmethod(torch.nn.Module.compile, backend="aot_eager")
            monkeypatch.setattr(torch.nn.Module, "compile", aot_eager)
        trainer = make_trainer(
            tmp_path / f"{backend}-{compiled}",
            single_rank,
            "--compile",
            str(compiled).lower(),
            "--backend",
            backend,
        )
        module = trainer.engine.module
        assert kernels.compiled_in_place(module) is compiled
        assert not any(key.startswith("_orig_mod") for key in module.state_dict())
        trainer.engine.train()
        losses[compiled] = [trainer.step()[1] for _ in range(3)]
        trainer.close()
    # Steps 2 and 3 ran after optimizer updates: the compiled module trained exactly as the eager one did.
    assert losses[True] == pytest.approx(losses[False], abs=2e-3)
    assert len(set(losses[True])) == 3


# --- TORCH_CUDA_ARCH_LIST and DeepSpeed's op builder --------------------------------------------------------


def _deepspeed_capability_args(arch_list: str, jit: bool, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """DeepSpeed 0.19.8's own parse of TORCH_CUDA_ARCH_LIST (CUDAOpBuilder.compute_capability_args), as
    jit_load (jit=True) or a pre-build (jit=False) runs it; an explicit arch list needs no GPU."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv(kernels.ARCH_LIST_ENV, arch_list)  # the builder rewrites it; monkeypatch restores it
    builder = FusedAdamBuilder()
    builder.jit_mode = jit
    builder._jit_arch_list = arch_list if jit else None  # what jit_load captures from the environment
    return builder.compute_capability_args()


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("8.0;9.0a", "8.0;9.0"),
        ("9.0a+PTX", "9.0+PTX"),
        ("8.0 9.0 10.0f", "8.0;9.0;10.0"),
        ("9.0;9.0a", "9.0"),
    ],
)
@pytest.mark.parametrize("jit", [True, False])
def test_arch_suffixes_break_deepspeed_and_normalising_fixes_it(
    raw: str, normal: str, jit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"invalid literal for int\(\) with base 10: '0[af]'"):
        _deepspeed_capability_args(raw, jit, monkeypatch)
    assert kernels.normalize_cuda_arch_list(raw) == normal
    args = _deepspeed_capability_args(normal, jit, monkeypatch)
    if not jit:
        assert "-gencode=arch=compute_90,code=sm_90" in args


def test_prepare_jit_env_rewrites_only_what_deepspeed_cannot_parse(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {kernels.ARCH_LIST_ENV: "8.0;9.0a"}
    kernels.prepare_jit_env(env)
    assert env == {
        kernels.ARCH_LIST_ENV: "8.0;9.0",
        kernels.EXTENSIONS_DIR_ENV: str(REPO / ".cache" / "torch_extensions"),  # one build per checkout
    }
    assert "TORCH_CUDA_ARCH_LIST='8.0;9.0a' -> '8.0;9.0'" in capsys.readouterr().out
    env = {kernels.ARCH_LIST_ENV: "8.0 9.0+PTX", kernels.EXTENSIONS_DIR_ENV: "/shared/ext"}
    kernels.prepare_jit_env(env)
    assert env == {kernels.ARCH_LIST_ENV: "8.0 9.0+PTX", kernels.EXTENSIONS_DIR_ENV: "/shared/ext"}
    assert capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match="'Hopper', which DeepSpeed's op builder cannot parse: use numeric"):
        kernels.prepare_jit_env({kernels.ARCH_LIST_ENV: "Hopper"})


def test_training_and_the_warm_step_share_the_jit_env_setup() -> None:
    makefile = (REPO / "Makefile").read_text()
    warm = makefile[makefile.index("\nwarm:") :].split("\n\n")[0]
    assert "kernels.warm_deepspeed_ops(" in warm
    assert "kernels.optimize_model(" in (REPO / "src" / "model_utils" / "trainer.py").read_text()


# --- --micro_batch_size auto ------------------------------------------------------------------------------


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
    assert printed["resolved"]["micro_batch_size"] == "auto"  # probed by the ranks when they start
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
    tmp_path: Path, single_rank, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--micro_batch_size", "auto", "--seq_length", "32", "--data_cache_dir", str(tmp_path / "cache")]
    cfg = parse_args([*flags, "--checkpoint_dir", str(tmp_path / "ckpt")])
    run = resolver.prepare(cfg, world_size=single_rank.world_size)  # a training rank, on CPU
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
@pytest.mark.parametrize("compiled", [False, True])
def test_liger_matches_eager_on_gpu(compiled: bool) -> None:
    """Liger's kernels (all four; with compile only the fused loss, beside inductor) against plain eager."""
    eager = tiny_model().to("cuda")
    fast = copy.deepcopy(eager)
    ids = torch.randint(0, 2048, (4, 128), device="cuda")
    loss_eager = eager(input_ids=ids, labels=ids).loss
    loss_eager.backward()
    with torch.no_grad():
        logits_eager = eager.eval()(input_ids=ids).logits
    with kernels.patches_undone(fast):  # computed before: Liger swaps RoPE module-wide
        kernels.optimize_model(fast, ModelArgs(liger="on", compile=compiled), CUDA)
        assert kernels.compiled_in_place(fast.model) is compiled
        out = fast.train()(input_ids=ids, labels=ids)
        assert out.logits is None  # training: Liger's fused loss never materialises the logits
        out.loss.backward()
        assert out.loss.item() == pytest.approx(loss_eager.item(), rel=1e-4)
        for (name, a), b in zip(eager.named_parameters(), fast.parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-3), name
        with torch.no_grad():
            logits = fast.eval()(input_ids=ids).logits
        assert torch.allclose(logits, logits_eager, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_inductor_compile_matches_eager_on_gpu() -> None:
    eager = tiny_model().to("cuda")
    fast = copy.deepcopy(eager)
    kernels.optimize_model(fast, ModelArgs(liger="off", compile=True), CUDA)
    ids = torch.randint(0, 2048, (4, 128), device="cuda")
    losses = [m(input_ids=ids, labels=ids).loss for m in (eager, fast)]
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-4)


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
    probe = micro_batch_probe._GpuProbe(model_config, torch.bfloat16, kernels.Plan(True, False), 256, 0)
    with kernels.patches_undone(tiny_model()):  # Liger's module-wide patches must not reach later tests
        assert probe(found)
    probe.close()


@pytest.mark.gpu
def test_bench_on_gpu(tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped configs (offload, GPU-only, ZeRO-3 with Liger's fallback) through the kit on a GPU."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    configs = ["deepspeed/ds_config.json", "deepspeed/ds_config_gpu.json", "deepspeed/ds_config_zero3.json"]
    argv = ["bench", "--model", "tiny-qwen3", "--seq_length", "256", "--micro_batch_size", "auto"]
    with kernels.patches_undone(tiny_model()):  # the kit's rows patch transformers' Qwen3 module with Liger
        assert cli.main([*argv, "--steps", "3", "--deepspeed_config", *configs, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["reference", "dskit", "dskit", "dskit"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 and all(map(math.isfinite, r["losses"]))
        assert abs(r["losses"][0] - math.log(2048)) < 0.3
    assert os.environ.get("TORCH_EXTENSIONS_DIR")  # set for DeepSpeed's JIT builds
