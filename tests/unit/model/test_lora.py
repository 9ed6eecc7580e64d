"""--lora_r: the flags' validation, the refusals in preflight, what trains (with activation checkpointing), and
the memory `dskit estimate` / `dskit doctor` count for it. Real models (a tiny Qwen3 saved locally), no hub."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from dskit import estimate as est
from model_utils.checkpoint import launch_record
from model_utils.config.arguments import LoraArgs, parse_args
from model_utils.config.presets import PRESETS
from model_utils.errors import ConfigError
from model_utils.model import activation_checkpointing, lora
from model_utils.model.models import build_model
from model_utils.optim import param_groups
from model_utils.resolve import resolver
from support.pretrained import save_tiny_qwen3


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("lora-unit") / "base")


def settings(*flags: str) -> resolver.RunSettings:
    return resolver.resolve_settings(parse_args(list(flags)))


def test_lora_is_off_by_default_and_parses_its_flags() -> None:
    assert not parse_args([]).lora.enabled
    cfg = parse_args(["--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj, v_proj"])
    assert cfg.lora == LoraArgs(lora_r=8, lora_alpha=16, lora_target_modules="q_proj, v_proj")
    config = lora.peft_config(cfg.lora)
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (8, 16, {"q_proj", "v_proj"})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora_r", "0"], "--lora_r 0 must be at least 1"),
        (["--lora_alpha", "0"], "--lora_alpha 0.0 must be positive"),
        (["--lora_dropout", "1"], r"--lora_dropout 1.0 is outside \[0, 1\)"),
        (["--lora_target_modules", " , "], "--lora_target_modules is empty"),
        (["--lora_modules_to_save", ","], "--lora_modules_to_save is empty"),
    ],
)
def test_bad_lora_flags_are_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_args(flags)
    assert "\n" not in str(err.value)


def test_a_preset_is_refused_it_has_no_pretrained_weights() -> None:
    with pytest.raises(
        ConfigError, match="a preset is randomly initialised and LoRA needs pretrained weights"
    ):
        settings("--model", "tiny-qwen3", "--lora_r", "4")


def test_target_modules_the_model_lacks_name_its_linear_layers(base: Path) -> None:
    with pytest.raises(ConfigError) as err:
        settings("--model", str(base), "--lora_r", "4", "--lora_target_modules", "q_proj,query_key_value")
    assert str(err.value) == (
        "--lora_target_modules query_key_value: not a linear layer of qwen3; its linear layers are "
        "down_proj,gate_proj,k_proj,lm_head,o_proj,q_proj,up_proj,v_proj"
    )


def test_modules_to_save_must_name_a_module_and_not_one_of_tied_embeddings(base: Path) -> None:
    with pytest.raises(ConfigError, match="--lora_modules_to_save score: qwen3 has no module of that name"):
        settings("--model", str(base), "--lora_r", "4", "--lora_modules_to_save", "score")
    with pytest.raises(ConfigError, match="ties lm_head and embed_tokens"):
        settings("--model", str(base), "--lora_r", "4", "--lora_modules_to_save", "lm_head")
    settings("--model", str(base), "--lora_r", "4", "--lora_modules_to_save", "input_layernorm")  # fine


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_only_the_adapters_train_and_reach_the_optimizer(
    base: Path, checkpointing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In the trainer's order: checkpointing switch, adapters, decay groups. With the whole base frozen and every
    layer recomputed, gradients still reach the first layer's adapters."""
    run = settings("--model", str(base), "--lora_r", "4", "--lora_modules_to_save", "input_layernorm")
    model = build_model(run.source, run.model_config, 0, torch.float32)
    activation_checkpointing.apply(model, checkpointing)
    model = lora.apply(model, run.config.lora, seed=0)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith(
        "LoRA r=4 alpha=32 on q_proj,k_proj,v_proj,o_proj (+ input_layernorm in full): 3.71K of 233K parameters "
        "train (1.6%)"
    )
    groups = param_groups.split_for_weight_decay(model, no_decay_embeddings=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {id(p) for p in groups.decay + groups.no_decay} == {
        id(p) for n, p in model.named_parameters() if n in trainable
    }
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert len(groups.no_decay) == 2  # the trained copies of the two layers' input_layernorm
    model.train()
    batch = torch.randint(0, 2048, (2, 16))
    model(input_ids=batch, labels=batch).loss.backward()
    # B starts at zero, so A's gradient is zero at the first step; B's is not, in every layer.
    for name, p in model.named_parameters():
        if "lora_B" in name or "modules_to_save" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        if not p.requires_grad:
            assert p.grad is None, name


def test_estimate_counts_gradients_and_optimizer_states_of_the_adapters_only() -> None:
    """Qwen3-0.6B, r=16 on the four attention projections: 28 layers x 16 x (q 1024+2048, k 1024+1024, v 1024+1024,
    o 2048+1024) = 4.59M adapters; the bf16 base stays whole (ZeRO-2) or partitioned (ZeRO-3)."""
    config = PRESETS["qwen3-0.6b"].build_config()
    full = est.model_shape(config, "qwen3-0.6b", built_from_config=False)
    shape = est.with_lora(full, config, LoraArgs(lora_r=16))
    adapters = 28 * 16 * (3072 + 2048 + 2048 + 3072)
    assert shape.trainable_params == adapters == 4_587_520
    assert shape.total_params == full.total_params + adapters
    n = 8

    def layout(stage: int, offload: str) -> est.ZeroLayout:
        return est.ZeroLayout(
            stage=stage,
            offload_optimizer=offload != "none",
            offload_params=offload == "optimizer+params",
            micro_batch_size=1,
            seq_length=2048,
            nodes=1,
            ranks_per_node=n,
        )

    part = math.ceil(adapters / n)
    z2 = est.estimate(shape, layout(2, "none"))
    assert z2.parameters == 2 * shape.total_params  # the frozen base is still on every GPU, in bf16
    assert (z2.gradients, z2.optimizer_states) == (6 * part, 12 * part)
    z2_full = est.estimate(full, layout(2, "none"))
    assert z2.model_states_device_bytes < 0.5 * z2_full.model_states_device_bytes  # the bf16 base is most
    z3 = est.estimate(shape, layout(3, "none"))
    assert z3.parameters == 2 * math.ceil(shape.total_params / n) + 2 * shape.largest_layer_params
    assert z3.optimizer_states == 12 * part
    z3_off = est.estimate(shape, layout(3, "optimizer+params"))
    assert z3_off.optimizer_states == 0 and z3_off.host_offload > 2 * n * math.ceil(shape.total_params / n)
    assert "LoRA: 4.59M train" in est.render(z2)


def test_doctor_and_estimate_read_lora_from_the_training_config(base: Path) -> None:
    with_lora = est.estimate_for_config(settings("--model", str(base), "--lora_r", "4"), 1, 2, on_gpus=False)
    without = est.estimate_for_config(settings("--model", str(base)), 1, 2, on_gpus=False)
    assert with_lora.model.trainable_params == 3584 and without.model.trainable_params is None
    # deepspeed/ds_config.json offloads the optimizer: the adapters' fp32 masters, gradients and Adam states are
    # what the host holds, the bf16 base stays on the device.
    assert with_lora.layout.offload_optimizer and with_lora.optimizer_states == 0
    assert with_lora.host_offload < without.host_offload / 10
    assert with_lora.parameters == 2 * with_lora.model.total_params > without.parameters


def test_a_checkpoint_resumes_only_into_the_same_adapters(tmp_path: Path) -> None:
    """Another rank, other modules, or LoRA on or off change the parameters' names and shapes: refused in one
    line before anything is built (preflight), not a DeepSpeed load error after it."""
    tag = tmp_path / "base-4steps"
    tag.mkdir()
    section = dataclasses.asdict(LoraArgs(lora_r=4))
    (tag / "launch.json").write_text(json.dumps({"config": {"lora": section}}))
    lora.check_resume(
        tag, launch_record.read(tag), LoraArgs(lora_r=4, lora_alpha=8, lora_dropout=0.1)
    )  # scaling and dropout may change
    with pytest.raises(ConfigError) as err:
        lora.check_resume(tag, launch_record.read(tag), LoraArgs())
    assert str(err.value) == (
        f"checkpoint {tag} was trained with --lora_r 4 --lora_target_modules q_proj,k_proj,v_proj,o_proj, not "
        "without LoRA: resume with its LoRA flags, or use a new --checkpoint_dir"
    )
    with pytest.raises(ConfigError, match="not with --lora_r 8 --lora_target_modules q_proj,v_proj"):
        lora.check_resume(
            tag, launch_record.read(tag), LoraArgs(lora_r=8, lora_target_modules="q_proj,v_proj")
        )
    (tag / "launch.json").write_text(json.dumps({"config": {"lora": dataclasses.asdict(LoraArgs())}}))
    lora.check_resume(tag, launch_record.read(tag), LoraArgs())
    with pytest.raises(ConfigError, match="was trained without LoRA, not with --lora_r 4"):
        lora.check_resume(tag, launch_record.read(tag), LoraArgs(lora_r=4))


def test_the_adapters_init_comes_from_the_seed_not_from_what_ran_before(base: Path) -> None:
    """Every rank (and every ZeRO stage) starts from the same adapters: ZeRO-3 would otherwise assemble each
    parameter from the ranks' different random inits."""
    run = settings("--model", str(base), "--lora_r", "4")

    def adapters(rng_draws: int) -> dict[str, torch.Tensor]:
        model = build_model(run.source, run.model_config, 0, torch.float32)
        torch.rand(rng_draws)  # whatever else consumed the global RNG on this rank
        model = lora.apply(model, run.config.lora, seed=7, announce=False)
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    first, second = adapters(1), adapters(1000)
    assert first.keys() == second.keys() and len(first) == 16
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert any(first[n].abs().sum() > 0 for n in first if "lora_A" in n)
