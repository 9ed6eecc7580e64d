"""--activation_checkpointing: recompute decoder layers in the backward pass instead of keeping their activations.

- `none`: every decoder layer keeps what autograd saves for backward (the fastest; the most memory).
- `full`: every decoder layer is checkpointed: through the forward a layer keeps only its input (the hidden
  states); its activations are recomputed, one layer at a time, when the backward pass reaches it. Costs one
  more forward of the decoder (about a third more compute).
- `every_N`: every N-th decoder layer (layers 0, N, 2N, ...) is checkpointed and the others keep their
  activations: the "selective" middle ground of pretraining practice, about 1/N of full's recompute.

It goes through transformers' own switch, `PreTrainedModel.activation_checkpointing_enable(every_n_layers=N)`
(`gradient_checkpointing_enable` before transformers 5.23),
which sets `gradient_checkpointing` on each `GradientCheckpointingLayer` (the decoder layers) and wraps their
`forward`, not `__call__`: module hooks (DeepSpeed ZeRO-3's parameter gathering) stay outside the checkpoint, and
the recompute gathers through the submodules' own hooks. The checkpoint is torch's non-reentrant one
(`use_reentrant=False`): it needs no input that requires grad, and dynamo traces it under torch.compile as a
checkpointed region (tests/e2e/test_model_setup.py trains through it with aot_eager on CPU; inductor
and Liger's autograd functions inside a recomputed layer need a GPU to test). transformers also registers
`enable_input_require_grads()` (a hook making the embedding output require grad), which only the reentrant
checkpoint needs, e.g. with frozen embeddings; it changes nothing when the embeddings train, so it is left on.
"""

from __future__ import annotations

import math
from typing import Any

from model_utils.config.arguments import CHECKPOINTING_NONE, every_n_layers
from model_utils.errors import ConfigError
from model_utils.observe.log import print0

# The kwargs of torch.utils.checkpoint.checkpoint transformers passes on (see the module docstring).
CHECKPOINT_KWARGS = {"use_reentrant": False}


def checkpointed_layers(num_layers: int, value: str) -> int:
    """How many of num_layers decoder layers `value` checkpoints: layers 0, N, 2N, ... (as transformers picks)."""
    every = every_n_layers(value)
    return 0 if every is None else math.ceil(num_layers / every)


def describe(value: str, num_layers: int) -> str:
    """E.g. '14 of 28 decoder layers (every_2)'; 'none' when off."""
    if every_n_layers(value) is None:
        return CHECKPOINTING_NONE
    return f"{checkpointed_layers(num_layers, value)} of {num_layers} decoder layers ({value})"


def apply(model: Any, value: str, announce: bool = True) -> Any:
    """Checkpoint the decoder layers `value` names in a freshly built model (before Liger, compile and DeepSpeed
    wrap it); logs one line saying what is checkpointed (announce=False: the micro-batch probe's model).
    Returns the model."""
    every = every_n_layers(value)
    if every is None:
        return model
    from transformers.modeling_layers import GradientCheckpointingLayer

    name = type(model).__name__
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"--activation_checkpointing {value}: transformers has no activation checkpointing for {name}: "
            "use --activation_checkpointing none"
        )
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS), every_n_layers=every)
    else:  # transformers 5.17 to 5.22 (an H200 image has 5.17): the same switch under its older name
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS), every_n_layers=every
        )
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    on = sum(bool(m.gradient_checkpointing) for m in layers)
    if not layers:
        # Models from before transformers' per-layer switch (no GradientCheckpointingLayer) checkpoint all or
        # nothing; every_N cannot be honoured there and `full` could not be counted.
        raise ConfigError(
            f"--activation_checkpointing {value}: {name} has no decoder layers transformers can checkpoint one "
            "by one (GradientCheckpointingLayer): use --activation_checkpointing none"
        )
    assert on == math.ceil(len(layers) / every), (on, len(layers), every)  # transformers' every_n_layers rule
    if announce:
        print0(f"Activation checkpointing: {on} of {len(layers)} decoder layers ({value})")
    return model
