"""The memory model's shared part (engines/memory.py): the decoder layers' activations against a traced forward
and backward (with each activation checkpointing level), Liger's smaller activations and loss. Each engine's model
states: tests/unit/engines/test_deepspeed_engine.py (against DeepSpeed's own estimators), test_fsdp_engine.py; a
resolved run's estimate: tests/unit/resolve/test_memory.py.

Models are counted on the meta device or traced with fake tensors: nothing is downloaded, nothing is allocated.
"""

from __future__ import annotations

import dataclasses

import pytest

from model_utils.config.presets import PRESETS
from model_utils.engines import memory
from model_utils.engines.memory import GiB
from model_utils.model import activation_checkpointing as ac
from support.estimates import checkpointing_layout, layout
from support.traced_memory import traced_activation_peak

LEVELS = ("none", "full", "every_2")  # activation checkpointing


def test_activations_match_a_traced_forward_and_backward(shapes) -> None:
    config = PRESETS["qwen3-0.6b"].build_config()
    config.num_hidden_layers = 2  # the real layer, fewer of them: the trace stays a few seconds
    shape = dataclasses.replace(shapes["qwen3-0.6b"], num_layers=2)
    lay = layout(2, "none", micro_batch_size=2, seq_length=256)
    mine = memory.estimate(shape, lay)
    traced = traced_activation_peak(config, batch=2, seq=256)
    assert mine.activations + mine.logits == pytest.approx(traced, rel=0.01)
    # The logits are most of it at this size: 12 bytes per token and vocabulary entry, not the bf16 2.
    assert mine.logits == 2 * 256 * (2 * 1024 + 12 * 151936)


def test_liger_kernels_keep_fewer_activations(shapes) -> None:
    """Liger's kernels are Triton GPU kernels: counted from their save_for_backward calls, not traced here."""
    shape = shapes["qwen3-0.6b"]
    eager = memory.estimate(shape, layout(2, "none"))
    liger = memory.estimate(shape, layout(2, "none", liger=True))
    # Per layer: norms keep their bf16 input and a fp32 1/rms, SwiGLU recomputes the SiLU.
    assert memory.layer_bytes_per_token(shape, 2, liger=True) == 45_224
    assert memory.layer_bytes_per_token(shape, 2, liger=False) == 71_744
    # The fused linear cross-entropy never materialises the 2048 x 151936 logits: one 16-row chunk.
    assert memory.flce_chunk_rows(2048, shape) == 16
    assert liger.logits == 2048 * (2 * 1024 + 4) + 16 * 151936 * 2
    assert liger.device_bytes_per_rank < eager.device_bytes_per_rank - 4 * GiB
    # Under ZeRO-3 the kit turns the fused loss off (lm_head.weight is a shard); torch.compile keeps at most
    # what eager keeps.
    zero3 = memory.estimate(shape, layout(3, "none", liger=True))
    assert zero3.logits == memory.estimate(shape, layout(3, "none")).logits
    assert zero3.activations == liger.activations
    compiled = memory.estimate(shape, layout(2, "none", liger=True, compile=True))
    assert compiled.activations == eager.activations and compiled.logits == liger.logits


def activations(shape: memory.ModelShape, value: str, **kw) -> int:
    return memory.estimate(shape, checkpointing_layout(activation_checkpointing=value, **kw)).activations


@pytest.mark.parametrize("preset", ["tiny-qwen3", "qwen3-0.6b"])
@pytest.mark.parametrize("micro_batch", [1, 8])
def test_estimate_activation_memory_per_level(shapes, preset: str, micro_batch: int) -> None:
    shape = shapes[preset]
    got = {v: activations(shape, v, micro_batch_size=micro_batch) for v in LEVELS}
    assert got["full"] < got["every_2"] < got["none"]
    tokens, b, h = micro_batch * 2048, 2, shape.hidden_size
    per_layer, final_norm = memory.layer_bytes_per_token(shape, b), (4 + b) * h
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
    mine = memory.estimate(
        shape, checkpointing_layout(micro_batch_size=2, seq_length=256, activation_checkpointing=value)
    )
    assert mine.activations + mine.logits == pytest.approx(traced_peak(config, value, 2, 256), rel=0.05)
