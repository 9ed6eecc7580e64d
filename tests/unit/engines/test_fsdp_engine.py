"""FSDP2 behind the seam, on one real gloo rank in this process: sharding a tiny Qwen3 (each decoder layer, then
the root; bf16 compute with fp32 reduction). Training, discarded steps, DCP checkpoints resharded on 2 -> 1 -> 2
ranks, CPU offload: tests/e2e/test_fsdp.py."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from model_utils.engines import fsdp_engine
from support.pretrained import tiny_model


def test_shard_wraps_every_decoder_layer_then_the_root(gloo_rank) -> None:
    model = fsdp_engine.shard(tiny_model(), gloo_rank.device, bf16=True, cpu_offload=False)
    layers = [m for m in model.modules() if type(m).__name__.startswith("FSDPQwen3DecoderLayer")]
    assert len(layers) == 2 and all(isinstance(m, FSDPModule) for m in layers)
    assert isinstance(model, FSDPModule)  # the root: embeddings, final norm, head
    assert all(
        isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters()
    )  # fp32 masters
    ids = torch.randint(0, 2048, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
