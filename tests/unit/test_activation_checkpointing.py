"""--activation_checkpointing none|full|every_N: the same training, fewer saved activations, bad values refused,
the resolved run, the real Trainer (with torch.compile), and `dskit estimate`'s activation memory and
recommendation.

On CPU in fp32 with the tiny preset (2 decoder layers: every_2 checkpoints layer 0 of 2). Liger's kernels need a
GPU and are not run here; the estimate's traces run on fake tensors (nothing is allocated).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from dskit import cli
from dskit import estimate as est
from dskit.estimate import GiB, ZeroLayout
from model_utils.config.arguments import CHECKPOINTING_FORMS, parse_args
from model_utils.config.presets import PRESETS
from model_utils.errors import ConfigError
from model_utils.model import activation_checkpointing as ac
from model_utils.model import kernels
from support.small_trainer import make_trainer
from support.traced_memory import traced_activation_peak

LEVELS = ("none", "full", "every_2")


def tiny_model(seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        PRESETS["tiny-qwen3"].build_config(), attn_implementation="sdpa", dtype=torch.float32
    )


def checkpointed(model) -> list[bool]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


# --- the model: what is checkpointed, and the same training --------------------------------------------------


def test_levels_pick_decoder_layers_as_transformers_does(capsys: pytest.CaptureFixture[str]) -> None:
    picks = {}
    for value in LEVELS:
        model = ac.apply(tiny_model(), value)
        picks[value] = checkpointed(model)
    assert picks == {"none": [False, False], "full": [True, True], "every_2": [True, False]}
    out = capsys.readouterr().out
    assert "Activation checkpointing: 2 of 2 decoder layers (full)" in out
    assert "Activation checkpointing: 1 of 2 decoder layers (every_2)" in out
    assert out.count("Activation checkpointing") == 2  # nothing logged for none
    assert (ac.checkpointed_layers(28, "every_2"), ac.checkpointed_layers(28, "every_3")) == (14, 10)
    assert (
        ac.describe("every_2", 28) == "14 of 28 decoder layers (every_2)"
        and ac.describe("none", 28) == "none"
    )


def test_same_losses_and_gradients_as_without_checkpointing() -> None:
    """fp32 on CPU, three AdamW steps from the same weights and batches: the recompute is exact."""
    base = tiny_model()
    torch.manual_seed(1)
    batches = [torch.randint(0, 2048, (2, 64)) for _ in range(3)]
    losses, grads = {}, {}
    for value in LEVELS:
        model = ac.apply(copy.deepcopy(base), value, announce=False).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[value] = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if len(losses[value]) == 0:
                grads[value] = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            losses[value].append(loss.item())
    for value in ("full", "every_2"):
        assert losses[value] == pytest.approx(losses["none"], abs=1e-5)
        for a, b in zip(grads[value], grads["none"], strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert len(set(losses["none"])) == 3  # the steps trained


def saved_for_backward(model, ids: torch.Tensor) -> tuple[int, int]:
    """(count, bytes) of the tensors autograd saves for backward in one forward, outside checkpointed regions
    (the checkpoint's own hooks take the ones inside: they are recomputed, not kept)."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    return len(sizes), sum(sizes)


def test_checkpointing_saves_fewer_activations() -> None:
    base = tiny_model()
    ids = torch.randint(0, 2048, (2, 64))
    saved = {
        v: saved_for_backward(ac.apply(copy.deepcopy(base), v, announce=False).train(), ids) for v in LEVELS
    }
    assert saved["full"][0] < saved["every_2"][0] < saved["none"][0]
    assert saved["full"][1] < saved["every_2"][1] < saved["none"][1]
    # In eval (validation) nothing is checkpointed: transformers checkpoints only in training mode.
    model = ac.apply(copy.deepcopy(base), "full", announce=False).eval()
    assert saved_for_backward(model, ids) == saved_for_backward(copy.deepcopy(base).eval(), ids)


# --- bad values ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["partial", "Full", "every_0", "every_", "every_two", "every_-2", "every 2"]
)
def test_bad_values_are_one_line_naming_the_forms(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--activation_checkpointing", value])
    message = str(err.value)
    assert "\n" not in message
    assert message == f"--activation_checkpointing {value!r} is not one of {CHECKPOINTING_FORMS}"
    assert cli.main(["config", "--activation_checkpointing", value]) == 2
    assert cli.main(["estimate", "--activation_checkpointing", value]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines == [f"error: {message}"] * 2


def test_models_without_checkpointing_are_refused() -> None:
    class NoCheckpointing(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(ConfigError, match="no activation checkpointing for NoCheckpointing: use"):
        ac.apply(NoCheckpointing(), "full")


# --- the resolved run and the Trainer ---------------------------------------------------------------------------


def test_resolved_run_says_what_is_checkpointed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for value, resolved in (("none", "none"), ("every_2", "1 of 2 decoder layers (every_2)")):
        argv = ["config", "--activation_checkpointing", value, "--data_cache_dir", str(tmp_path / "cache")]
        assert cli.main(argv) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["config"]["model"]["activation_checkpointing"] == value  # as given
        assert printed["resolved"]["activation_checkpointing"] == resolved


def test_trainer_checkpoints_under_deepspeed_and_compile(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the real Trainer (ZeRO-2, CPU Adam): every_2 with torch.compile trains as eager without
    checkpointing. Dynamo and AOTAutograd trace the checkpointed layer for real; the backend is aot_eager, as in
    test_kernels.py (inductor's cold C++ build takes minutes on 2 cores)."""
    losses = {}
    for value, compiled in (("none", False), ("every_2", True)):
        if compiled:
            aot_eager = functools.partialmethod(torch.nn.Module.compile, backend="aot_eager")
            monkeypatch.setattr(torch.nn.Module, "compile", aot_eager)
        trainer = make_trainer(
            tmp_path, single_rank, "--activation_checkpointing", value, "--compile", str(compiled).lower()
        )
        module = trainer.engine.module
        assert checkpointed(module) == ([True, False] if value == "every_2" else [False, False])
        assert kernels.compiled_in_place(module) is compiled
        trainer.engine.train()
        losses[value] = [trainer.step()[1] for _ in range(3)]
        trainer.close()
    assert "Activation checkpointing: 1 of 2 decoder layers (every_2)" in capsys.readouterr().out
    # bf16 training: the compiled graph may fuse differently, as in test_kernels' compile test.
    assert losses["every_2"] == pytest.approx(losses["none"], abs=2e-3)


# --- dskit estimate -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shapes() -> dict[str, est.ModelShape]:
    return {name: est.model_shape(PRESETS[name].build_config(), name, True) for name in PRESETS}


def layout(micro_batch_size: int = 1, seq_length: int = 2048, **kw) -> ZeroLayout:
    values = dict(
        stage=2,
        offload_optimizer=False,
        offload_params=False,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        nodes=1,
        ranks_per_node=8,
    )
    return ZeroLayout(**{**values, **kw})


def activations(shape: est.ModelShape, value: str, **kw) -> int:
    return est.estimate(shape, layout(activation_checkpointing=value, **kw)).activations


@pytest.mark.parametrize("preset", ["tiny-qwen3", "qwen3-0.6b"])
@pytest.mark.parametrize("micro_batch", [1, 8])
def test_estimate_activation_memory_per_level(shapes, preset: str, micro_batch: int) -> None:
    shape = shapes[preset]
    got = {v: activations(shape, v, micro_batch_size=micro_batch) for v in LEVELS}
    assert got["full"] < got["every_2"] < got["none"]
    tokens, b, h = micro_batch * 2048, 2, shape.hidden_size
    per_layer, final_norm = est.layer_bytes_per_token(shape, b), (4 + b) * h
    assert got["none"] == tokens * (shape.num_layers * per_layer + final_norm)
    # full: each layer's input is kept; with the eager loss the logits are the peak, not the top recompute.
    assert got["full"] == tokens * (shape.num_layers * b * h + final_norm)
    # every_2: half the layers keep everything, the other half their input.
    half = shape.num_layers // 2
    assert got["every_2"] == tokens * (half * per_layer + half * b * h + final_norm)


def test_estimate_figures_for_qwen3(shapes) -> None:
    """The figures docs/estimate-and-doctor.md quotes: seq 2048, bf16, eager and Liger."""
    shape = shapes["qwen3-0.6b"]
    gib = {
        (v, mb, liger): round(activations(shape, v, micro_batch_size=mb, liger=liger) / GiB, 2)
        for v in LEVELS
        for mb in (1, 8)
        for liger in (False, True)
    }
    assert gib == {
        ("none", 1, False): 3.84, ("none", 8, False): 30.75,
        ("every_2", 1, False): 1.98, ("every_2", 8, False): 15.86,
        ("full", 1, False): 0.12, ("full", 8, False): 0.97,
        # Liger's small fused loss: the top layer's backward (its recompute with full) is the peak.
        ("none", 1, True): 2.42, ("none", 8, True): 19.35,
        ("every_2", 1, True): 1.31, ("every_2", 8, True): 10.50,
        ("full", 1, True): 0.25, ("full", 8, True): 1.97,
    }  # fmt: skip


def traced_peak(config, value: str, batch: int, seq: int) -> int:
    """The traced peak with checkpointing `value`, and the parameters' gradients dropped as they are produced
    (DeepSpeed moves them into its buckets, which the estimate counts apart)."""

    def prepare(model) -> None:
        ac.apply(model.train(), value, announce=False)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))

    return traced_activation_peak(config, batch, seq, prepare)


# MemTracker notes the parameters' gradients the hooks set to None.
@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass:UserWarning")
@pytest.mark.parametrize("vocab", [151936, 1024])
@pytest.mark.parametrize("value", ["full", "every_2", "every_3"])
def test_estimate_matches_a_traced_forward_and_backward(shapes, vocab: int, value: str) -> None:
    """Qwen3-0.6B's layers, 4 of them: every_2 leaves the top layer alone, every_3 and full recompute it. With
    its real vocabulary the logits are the peak; with a small one the top layer's backward is."""
    config = PRESETS["qwen3-0.6b"].build_config()
    config.num_hidden_layers, config.vocab_size = 4, vocab
    shape = dataclasses.replace(shapes["qwen3-0.6b"], num_layers=4, vocab_size=vocab)
    mine = est.estimate(shape, layout(micro_batch_size=2, seq_length=256, activation_checkpointing=value))
    assert mine.activations + mine.logits == pytest.approx(traced_peak(config, value, 2, 256), rel=0.05)


def test_recommendation_adds_checkpointing_only_when_that_makes_it_fit(shapes, capsys) -> None:
    shape = shapes["qwen3-0.6b"]
    cap = est.Capacity(24 * GiB, "--gpu_memory_gib", 512 * GiB, "--host_memory_gib")
    # seq 2048 fits without it: nothing is recomputed.
    rec = est.recommend(shape, layout(micro_batch_size=4), cap)
    assert rec.estimate is not None and rec.estimate.layout.activation_checkpointing == "none"
    # seq 8192 (eager loss): not even ZeRO-3 with everything offloaded fits at micro batch 1 without it;
    # ZeRO-1 with full checkpointing does, before any offload.
    at_8k = layout(micro_batch_size=4, seq_length=8192)
    without = [
        est.estimate(shape, dataclasses.replace(at_8k, stage=s, micro_batch_size=1, **off))
        for s, off in [(1, {}), (3, {"offload_optimizer": True, "offload_params": True})]
    ]
    assert not any(est.fits(e, cap) for e in without)
    rec = est.recommend(shape, at_8k, cap)
    assert rec.estimate is not None
    chosen = rec.estimate.layout
    assert (chosen.stage, chosen.offload, chosen.activation_checkpointing) == (1, "none", "full")
    assert (
        "activation checkpointing full is what makes it fit (without it ZeRO-1 with no offload needs"
        in rec.reason
    )
    assert chosen.describe_recommended().endswith(", --activation_checkpointing full")
    # The command says so too.
    argv = [
        "estimate",
        "--model",
        "qwen3-0.6b",
        "--seq_length",
        "8192",
        "--liger",
        "off",
        "--zero_stage",
        "2",
    ]
    assert (
        cli.main([*argv, "--gpus_per_node", "8", "--gpu_memory_gib", "24", "--host_memory_gib", "512"]) == 0
    )
    out = capsys.readouterr().out
    assert "recommend: ZeRO-1, no offload, micro batch 1, --activation_checkpointing full — " in out
    assert cli.main([*argv, "--activation_checkpointing", "every_2", "--gpu_memory_gib", "24"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.endswith("eager (no Liger), activation checkpointing every_2")
