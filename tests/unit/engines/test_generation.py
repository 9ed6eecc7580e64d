"""Greedy generation for the samples: with the key/value cache, exactly `new_tokens` forwards per prompt (what
keeps a sharded model's ranks in step), the same tokens as transformers' own greedy search, and no early stop at
end-of-text. Under ZeRO-2, ZeRO-3 and FSDP on 1 and 2 ranks: tests/e2e/test_validation.py."""

from __future__ import annotations

import torch

from model_utils.engines import generation
from support.pretrained import tiny_model


def test_greedy_runs_new_tokens_forwards_per_prompt_and_matches_transformers_greedy_search() -> None:
    model = tiny_model(seed=3).eval()
    calls = []

    def forward(**inputs):
        calls.append(inputs["input_ids"].shape[1])
        return model(**inputs)

    prompts = [(5, 17, 99, 4), (7,)]
    out = generation.greedy(forward, prompts, 6, torch.device("cpu"))
    assert calls == [4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # the prompt once, then one token per forward
    for prompt, tokens in zip(prompts, out, strict=True):
        reference = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
        )
        assert tokens == reference[0, len(prompt) :].tolist()


def test_greedy_does_not_stop_at_end_of_text() -> None:
    """A model that always answers end-of-text still runs every forward: ranks reach it at the same count."""
    model = tiny_model(seed=3).eval()
    eos = 2

    def forward(**inputs):
        out = model(**inputs)
        out.logits[..., eos] = 1e4
        return out

    assert generation.greedy(forward, [(5, 6)], 4, torch.device("cpu")) == [[eos] * 4]
