"""The peak bytes of activations (and their gradients) in a bf16 forward + backward of a Hugging Face causal LM
on fake tensors: what `dskit estimate` is checked against, with no memory spent on real weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def traced_activation_peak(
    config: Any, batch: int, seq: int, prepare: Callable[[Any], None] | None = None
) -> int:
    """`prepare(model)` runs on the built model before the trace (e.g. switch checkpointing on)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    default = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        finally:
            torch.set_default_dtype(default)
        if prepare is not None:
            prepare(model)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            # As the Trainer does: the model output (and its bf16 logits) is dropped before backward.
            model(input_ids=ids, labels=ids).loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return sum(v for k, v in peak.items() if getattr(k, "value", k) in ("Activation", "Temp", "Gradient"))
