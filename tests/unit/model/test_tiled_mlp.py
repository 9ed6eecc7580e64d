"""--tiled_mlp: DeepSpeed's TiledMLP around each decoder layer's MLP gives the plain model's loss and gradients
(fp32), with activation checkpointing too, computing the MLP one slice of the sequence at a time."""

from __future__ import annotations

import pytest
import torch

from model_utils.config.presets import PRESETS
from model_utils.model import activation_checkpointing, tiled_mlp

SEQ = 512  # 8 slices of the tiny preset's hidden size (64)


def model(checkpointing: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = PRESETS["tiny-qwen3"].build_config()
    config.max_position_embeddings = SEQ
    built = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return activation_checkpointing.apply(built, checkpointing, announce=False).train()


def step(m: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(1))
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_tiled_mlp_trains_as_the_whole_one_a_slice_at_a_time(checkpointing: str) -> None:
    want_loss, want = step(model(checkpointing))
    tiled = model(checkpointing)
    tiled_mlp.apply(tiled)
    rows: list[int] = []
    gate = tiled.model.layers[0].mlp.gate_proj
    gate.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[-2]))
    loss, got = step(tiled)
    assert loss == pytest.approx(want_loss, abs=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # The first layer's MLP saw slices only: 8 of 64 positions of both rows in the forward (and again in the
    # checkpoint's recompute), 8 of the 128 rows x positions in the backward, which recomputes them.
    forwards = 2 if checkpointing == "full" else 1
    assert rows == [SEQ // 8] * 8 * forwards + [2 * SEQ // 8] * 8, rows
