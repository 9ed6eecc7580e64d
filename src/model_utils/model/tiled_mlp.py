"""--tiled_mlp: each decoder layer's MLP computed over slices of the sequence with DeepSpeed's TiledMLP (the MLP
part of its Arctic Long Sequence Training), so its intermediate activations (3 x the MLP's width per token) exist
for one slice at a time, in the forward and in the backward, which recomputes them. For long sequences, with
activation checkpointing and --sequence_parallel: at 64k tokens the MLP's intermediates of one layer are larger
than everything a checkpointed layer keeps."""

from __future__ import annotations

import math
from typing import Any

from model_utils.observe.log import print0


def apply(model: Any) -> None:
    """Compute the MLP of each decoder layer of `model` (the Hugging Face model) in slices of its hidden size's
    length: as many slices as the sequence is hidden sizes long (ALST's choice), the same on every rank."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    layers = [layer for layer in model.model.layers if hasattr(layer, "mlp")]
    for layer in layers:
        mlp = layer.mlp
        whole = mlp.forward  # Liger's SwiGLU where the kernels swapped it in

        def tiled(x: Any, mlp: Any = mlp, whole: Any = whole) -> Any:
            slices = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
            return TiledMLP.apply(lambda _, h: whole(h), mlp, x, slices, list(mlp.parameters()))

        mlp.forward = tiled
    print0(f"Tiled MLP: {len(layers)} decoder layers compute their MLP in slices of the sequence")
