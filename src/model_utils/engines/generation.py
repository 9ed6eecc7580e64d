"""Greedy generation for the run's samples (--sample_prompts), shared by the engines: each hands it the forward
that runs its model (the DeepSpeed engine's, whose ZeRO-3 hooks gather every layer's weights on every rank; FSDP's
sharded root module, which all-gathers each layer).

With sharded weights a forward is a collective: every rank must run as many, in the same order. So every rank
generates every prompt, one at a time, for exactly `new_tokens` tokens (no early stop at end-of-text, which ranks
could reach at different times), with the model's key/value cache so that each new token costs one token's
forward. Greedy: the highest logit wins (the first of equal ones), so the text depends on the weights alone, with
nothing random to seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


@torch.no_grad()
def greedy(
    forward: Callable[..., Any], prompts: Sequence[Sequence[int]], new_tokens: int, device: torch.device
) -> list[list[int]]:
    """The `new_tokens` token ids that follow each prompt (token ids), greedily."""
    generated = []
    for prompt in prompts:
        step_input = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        cache = None
        tokens = []
        for _ in range(new_tokens):
            out = forward(input_ids=step_input, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            step_input = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(step_input)
        generated.append(torch.cat(tokens, dim=1)[0].tolist())
    return generated
