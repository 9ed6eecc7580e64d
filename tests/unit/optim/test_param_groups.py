"""Weight decay where it belongs: matrices decay; norm gains and biases never; embeddings on request."""

from __future__ import annotations

import torch

from model_utils.config.presets import PRESETS
from model_utils.optim.param_groups import split_for_weight_decay


def tiny_qwen3(tie: bool = True) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = PRESETS["tiny-qwen3"].build_config()
    config.tie_word_embeddings = tie
    return AutoModelForCausalLM.from_config(config)


def names(model: torch.nn.Module, params: tuple) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_norms_and_biases_are_exempt_matrices_decay() -> None:
    model = tiny_qwen3()
    groups = split_for_weight_decay(model, no_decay_embeddings=False)
    exempt = names(model, groups.no_decay)
    assert exempt and all(n.endswith("norm.weight") or n.endswith(".bias") for n in exempt), exempt
    assert all(p.ndim == 1 for p in groups.no_decay)
    decayed = names(model, groups.decay)
    assert "model.embed_tokens.weight" in decayed and any("q_proj.weight" in n for n in decayed)
    # Every trainable parameter exactly once (the tied lm_head is the embedding, counted once).
    assert len(groups.decay) + len(groups.no_decay) == len(list(model.parameters()))
    assert {id(p) for p in groups.decay}.isdisjoint({id(p) for p in groups.no_decay})
    opt = groups.optimizer_groups()
    assert [set(g) for g in opt] == [{"params"}, {"params", "weight_decay"}] and opt[1]["weight_decay"] == 0.0
    assert groups.layout() == [[len(groups.decay), sum(p.numel() for p in groups.decay)],
                               [len(groups.no_decay), sum(p.numel() for p in groups.no_decay)]]  # fmt: skip


def test_embeddings_exempt_on_request_untied_head_still_decays() -> None:
    model = tiny_qwen3(tie=False)
    groups = split_for_weight_decay(model, no_decay_embeddings=True)
    assert "model.embed_tokens.weight" in names(model, groups.no_decay)
    assert "lm_head.weight" in names(model, groups.decay)  # a Linear, not an embedding
    text = groups.describe(0.1, no_decay_embeddings=True)
    assert text.startswith("Weight decay 0.1 on ") and text.endswith("norms, biases, embeddings)")


def test_decay_is_applied_per_group_by_the_optimizer() -> None:
    """What the groups do in a real AdamW step: with zero gradients, decayed weights shrink, exempt ones do not."""
    model = tiny_qwen3()
    groups = split_for_weight_decay(model, no_decay_embeddings=False)
    optimizer = torch.optim.AdamW(groups.optimizer_groups(), lr=0.1, weight_decay=0.5)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    norm = groups.no_decay[0]
    matrix = groups.decay[0]
    assert torch.equal(norm, before[id(norm)])
    assert torch.allclose(matrix, before[id(matrix)] * (1 - 0.1 * 0.5))
