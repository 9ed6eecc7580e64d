"""Which parameters get weight decay, for every engine's optimizer: weight matrices do; norm gains and biases
(one-dimensional parameters) do not, since decay pulls a norm gain toward zero (Hugging Face's Trainer and most
pretraining recipes exempt them); embeddings too with --no_decay_embeddings. A parameter shared by two modules
(tied input and output embeddings) is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DecayGroups:
    decay: tuple[torch.nn.Parameter, ...]
    no_decay: tuple[torch.nn.Parameter, ...]

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """Parameter groups for the optimizer: the decayed group takes the optimizer's own weight_decay (from
        the DeepSpeed config), the other none. Empty groups are left out; the order is fixed (for resumes)."""
        groups: list[dict[str, Any]] = []
        if self.decay:
            groups.append({"params": list(self.decay)})
        if self.no_decay:
            groups.append({"params": list(self.no_decay), "weight_decay": 0.0})
        return groups

    def layout(self) -> list[list[int]]:
        """[tensors, elements] per group, as saved in launch.json: a resume whose layout differs cannot load the
        optimizer state."""
        return [[len(g), sum(p.numel() for p in g)] for g in (self.decay, self.no_decay) if g]

    def describe(self, weight_decay: float | None, no_decay_embeddings: bool) -> str:
        (dt, de), (nt, ne) = _count(self.decay), _count(self.no_decay)
        wd = "the optimizer's default" if weight_decay is None else f"{weight_decay:g}"
        exempt = "norms, biases" + (", embeddings" if no_decay_embeddings else "")
        return f"Weight decay {wd} on {dt} tensors ({de:,} parameters), none on {nt} ({ne:,}; {exempt})"


def _count(params: tuple[torch.nn.Parameter, ...]) -> tuple[int, int]:
    return len(params), sum(p.numel() for p in params)


def split_for_weight_decay(model: torch.nn.Module, no_decay_embeddings: bool) -> DecayGroups:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    seen: set[int] = set()
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        exempt = param.ndim < 2 or (no_decay_embeddings and id(param) in embeddings)
        (no_decay if exempt else decay).append(param)
    return DecayGroups(tuple(decay), tuple(no_decay))
