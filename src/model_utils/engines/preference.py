"""Preference objectives: DPO (TRL's sigmoid, robust, ipo and hinge losses) and reference-free SimPO, on
micro-batches of pairs (the chosen sequences, then the rejected ones of the same pairs: one forward for both, as TRL
does).

A pair's log-probability is the sum over its completion's tokens (SimPO's, and IPO's scores, their mean), under the
model being trained; DPO's reference log-probabilities come with the batch (loop/observers/reference.py computes
them once, before training, from the weights the run starts from). Each pair's loss is TRL's; the step's loss is
their mean over every pair of the step on every rank, as TRL's is over its batch: the engines' divisor
(step_loss.py) counts pairs here (Batch.loss_units), so accumulation and the world size do not change it.

The metrics users read for preference tuning (TRL's names: rewards of the chosen and rejected answers, their
margin, the share of pairs whose chosen reward is higher, the log-probabilities) are summed on the device as the
step runs and read once per log line (`take`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from model_utils.data.step_batches import IGNORE_INDEX, Batch
from model_utils.engines.base import EVAL, TRAIN

# The metrics, as TRL logs them ("rewards/chosen", ...) and as the kit's records name them.
METRICS = (
    ("rewards/chosen", "reward_chosen"),
    ("rewards/rejected", "reward_rejected"),
    ("rewards/margins", "reward_margin"),
    ("rewards/accuracies", "reward_accuracy"),
    ("logps/chosen", "logp_chosen"),
    ("logps/rejected", "logp_rejected"),
)
KEYS = tuple(key for _, key in METRICS)


@dataclass(frozen=True)
class Settings:
    """The objective's settings (config.arguments.ObjectiveArgs; the defaults are TRL's)."""

    objective: str  # "dpo" or "simpo"
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @classmethod
    def of(cls, args: Any) -> Settings:
        return cls(args.objective, args.beta, args.loss_type, args.label_smoothing, args.simpo_gamma)

    @property
    def uses_reference(self) -> bool:
        return self.objective == "dpo"

    def describe(self) -> str:
        if self.objective == "simpo":
            return (
                f"SimPO (reference-free): beta {self.beta:g}, gamma {self.simpo_gamma:g}, label smoothing "
                f"{self.label_smoothing:g}"
            )
        smoothing = f", label smoothing {self.label_smoothing:g}" if self.loss_type == "robust" else ""
        return f"DPO ({self.loss_type} loss): beta {self.beta:g}{smoothing}; reference: the starting weights"


def sequence_logps(module: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-probabilities of its targets, summed, and how many targets it has ([rows] each). One row's
    logits at a time in float32: the vocabulary-wide log-softmax of the whole batch is never held (TRL's
    selective_log_softmax does the same)."""
    logits = module(input_ids=batch.input_ids, use_cache=False).logits[:, :-1]
    labels = batch.labels[:, 1:]
    trained = labels != IGNORE_INDEX
    ids = labels.masked_fill(~trained, 0)
    rows = []
    for row_logits, row_ids in zip(logits, ids, strict=True):
        row = row_logits.float()
        rows.append(row.gather(-1, row_ids[:, None]).squeeze(-1) - row.logsumexp(-1))
    per_token = torch.stack(rows) * trained
    return per_token.sum(-1), trained.sum(-1)


def pair_losses(
    settings: Settings,
    logps: torch.Tensor,
    counts: torch.Tensor,
    reference: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each pair's loss and its metrics (per pair, detached), from the rows' summed log-probabilities and target
    counts (chosen rows first) and, for DPO, the reference's (same order): TRL 1.16's DPOTrainer._compute_loss and,
    for SimPO, its CPOTrainer.cpo_loss with loss_type simpo (cpo_alpha 0)."""
    chosen, rejected = logps.chunk(2)
    chosen_n, rejected_n = counts.chunk(2)
    beta, smoothing = settings.beta, settings.label_smoothing
    if settings.objective == "simpo":
        chosen, rejected = chosen / chosen_n.clamp(min=1), rejected / rejected_n.clamp(min=1)
        margin = chosen - rejected - settings.simpo_gamma / beta
        losses = -F.logsigmoid(beta * margin) * (1 - smoothing) - F.logsigmoid(-beta * margin) * smoothing
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    else:
        assert reference is not None, "DPO's batches carry the reference log-probabilities"
        ref_chosen, ref_rejected = reference.to(logps.dtype).chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        kind = settings.loss_type
        if kind == "sigmoid":
            losses = -F.logsigmoid(beta * delta)
        elif kind == "robust":
            clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
            flipped = -smoothing * F.logsigmoid(-beta * delta)
            losses = (clean - flipped) / (1 - 2 * smoothing)
        elif kind == "hinge":
            losses = torch.relu(1 - beta * delta)
        elif kind == "ipo":  # TRL normalizes IPO's scores by the completion's length
            ipo = chosen_ratio / chosen_n.clamp(min=1) - rejected_ratio / rejected_n.clamp(min=1)
            losses = (ipo - 1 / (2 * beta)) ** 2
        else:
            raise AssertionError(kind)  # the config refuses any other
        chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {
        "reward_chosen": chosen_rewards,
        "reward_rejected": rejected_rewards,
        "reward_margin": chosen_rewards - rejected_rewards,
        "reward_accuracy": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
        "logp_chosen": chosen.detach(),
        "logp_rejected": rejected.detach(),
    }
    return losses, metrics


class Preference:
    """The objective of preference pairs (engines call `summed_loss`, `eval_summed_loss`); keeps the metrics'
    sums since they were last taken, apart for training and validation."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.reference_weights: str | None = None  # DPO: the fingerprint of the weights the run starts from
        self._sums: dict[str, torch.Tensor | None] = {TRAIN: None, EVAL: None}

    def summed_loss(self, module: Any, batch: Batch, divisor: torch.Tensor) -> torch.Tensor:
        """The micro-batch's pair losses summed, over `divisor` (the step's pairs on all ranks, and what the
        engine's reduction divides by: step_loss.py)."""
        losses = self._losses(module, batch, TRAIN)
        return losses.sum() / divisor

    def eval_summed_loss(self, module: Any, batch: Batch) -> float:
        """The batch's pair losses summed (validation divides by the pairs of all batches)."""
        return float(self._losses(module, batch, EVAL).sum().item())

    def _losses(self, module: Any, batch: Batch, mode: str) -> torch.Tensor:
        assert batch.pairs, "a preference objective trains on pairs"
        logps, counts = sequence_logps(module, batch)
        losses, metrics = pair_losses(self.settings, logps, counts, batch.reference)
        if not batch.counted_pairs:  # a repeated validation batch (its loss is not counted either)
            return losses
        sums = torch.stack([metrics[key].double().sum() for key in KEYS])
        counted = torch.tensor([float(batch.counted_pairs)], dtype=torch.float64, device=sums.device)
        sums = torch.cat([sums, counted])
        held = self._sums[mode]
        self._sums[mode] = sums if held is None else held + sums
        return losses

    def take(self, mode: str) -> list[float]:
        """This rank's sums of the metrics (KEYS) and its pair count, since the last call (one wait for the
        device): summed over the ranks, `means` makes them the metrics."""
        sums, self._sums[mode] = self._sums[mode], None
        return [0.0] * (len(KEYS) + 1) if sums is None else sums.tolist()

    def means(self, sums: list[float]) -> dict[str, float]:
        """The metrics of `take`'s sums (over the ranks), each a mean over the pairs; {} when there were none."""
        pairs = sums[-1]
        return {key: value / pairs for key, value in zip(KEYS, sums[:-1], strict=True)} if pairs else {}
