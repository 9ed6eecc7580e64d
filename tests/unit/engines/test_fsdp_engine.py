"""FSDP2 behind the seam, on one real gloo rank in this process: sharding a tiny Qwen3 (each decoder layer, then
the root; bf16 compute with fp32 reduction). Training, discarded steps, DCP checkpoints resharded on 2 -> 1 -> 2
ranks, CPU offload: tests/e2e/test_fsdp.py. Its memory model (estimate_fsdp): every model state sharded."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from model_utils.engines import fsdp_engine
from support.estimates import layout
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


def test_fsdp_shards_every_model_state_and_offload_moves_them_to_the_host(shapes) -> None:
    """--backend fsdp: 16 bytes per parameter / N (fp32 master, gradient, Adam m and v) plus two gathered layers
    and one unsharded fp32 layer gradient; --fsdp_cpu_offload leaves only the gathered layers on the GPU."""
    shape = shapes["qwen3-0.6b"]
    P, L = shape.total_params, shape.largest_layer_params
    for gpus in (8, 16):
        lay = layout(0, "none", nodes=1, ranks_per_node=gpus, backend="fsdp")
        e = fsdp_engine.estimate_fsdp(shape, lay)
        shard = -(-P // gpus)
        assert (e.parameters, e.gradients, e.optimizer_states) == (
            4 * shard + 4 * L,
            4 * shard + 4 * L,
            8 * shard,
        )
        assert e.buffers == 0 and lay.describe() == "FSDP2, no offload, micro batch 1"
    off = fsdp_engine.estimate_fsdp(shape, layout(0, "optimizer", nodes=1, ranks_per_node=8, backend="fsdp"))
    assert (off.parameters, off.gradients, off.optimizer_states) == (4 * L, 4 * L, 0)
    assert off.host_offload == 8 * 16 * -(-P // 8)
    accumulated = fsdp_engine.estimate_fsdp(
        shape, layout(0, "none", nodes=1, ranks_per_node=8, backend="fsdp", gradient_accumulation_steps=4)
    )
    assert (
        accumulated.gradients == 4 * -(-P // 8) + 4 * L + 2 * P
    )  # the unsharded bf16 gradients between micro-batches
