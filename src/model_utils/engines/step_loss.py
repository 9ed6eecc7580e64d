"""The loss of an optimizer step over its tokens, for every engine: the sum of the token losses over all targets of
all its micro-batches on all ranks, divided by the number of those targets.

Not the mean of per-micro-batch means, which weighs a token of a micro-batch with few targets (a short answer, a
mostly-masked row) above one of a full micro-batch, so that gradient accumulation or the world size would change
what is trained (transformers#34191). Each micro-batch's loss is its summed token losses divided by the step's
global target count (Hugging Face's `num_items_in_batch`, which switches its loss to a sum over that divisor),
times the factor by which the engine's backward and gradient reduction divide again, so that the gradients the
optimizer sees are exactly those of the step's token mean.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from model_utils.data.step_batches import Batch


def world_ranks() -> int:
    """All ranks of the run: each target is on one of them (a sequence's shards on several, under sequence
    parallelism); the engines average gradients over the data-parallel ones among them."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def step_targets(micro_batches: list[Batch]) -> torch.Tensor:
    """The step's targets on all ranks, as a float32 device tensor (at least 1: a step with none has loss 0).

    One all-reduce of one number, queued on the device and never read back on the host: the divisor stays a
    tensor, so no rank waits for it before queuing its forwards. (Counting every rank's rows on every rank instead
    would read world-size times the step's data on each rank.)"""
    local = torch.stack([batch.device_loss_units() for batch in micro_batches]).sum()
    if world_ranks() > 1:
        torch.distributed.all_reduce(local)
    return local.clamp(min=1).float()


def loss_divisor(
    micro_batches: list[Batch], backward_divides_by: int, agreed: int | None = None
) -> torch.Tensor:
    """What each micro-batch's summed token loss is divided by: the step's global targets over
    `backward_divides_by`, the factor the engine's own backward and gradient reduction divide by.

    `agreed`: the count the ranks already summed in the turn before (loop/consensus.py carries the next step's
    targets in its one per-step collective), so no collective is made here; else step_targets counts them."""
    if agreed is not None:
        return _agreed_divisor(agreed, backward_divides_by, micro_batches[0].labels.device)
    return step_targets(micro_batches) / backward_divides_by


@functools.lru_cache(maxsize=8)
def _agreed_divisor(agreed: int, backward_divides_by: int, device: torch.device) -> torch.Tensor:
    """One tensor per count, made once: most steps of a run have the same count (every block full), and each of
    the three tensor operations costs more host time than the rest of the step's bookkeeping (never written to:
    the models only divide by it). Float32 and at least 1, as step_targets' count."""
    targets = torch.tensor(float(agreed), dtype=torch.float32, device=device).clamp(min=1)
    return targets / backward_divides_by


def summed_loss(module: Any, batch: Batch, divisor: torch.Tensor) -> torch.Tensor:
    """The micro-batch's token losses summed and divided by `divisor` (Hugging Face's num_items_in_batch)."""
    loss: torch.Tensor = module(**batch.model_inputs(), num_items_in_batch=divisor).loss
    return loss


def eval_summed_loss(module: Any, batch: Batch) -> float:
    """The batch's token losses summed over its targets (validation divides by the targets of all batches)."""
    one = torch.ones((), device=batch.input_ids.device)
    return float(summed_loss(module, batch, one).item())


class TokenMean:
    """--objective lm: the next-token loss, a mean over the step's trained tokens (the engines' default objective;
    engines/base.Objective)."""

    reference_weights = None

    def summed_loss(self, module: Any, batch: Batch, divisor: torch.Tensor) -> torch.Tensor:
        return summed_loss(module, batch, divisor)

    def eval_summed_loss(self, module: Any, batch: Batch) -> float:
        return eval_summed_loss(module, batch)

    def take(self, mode: str) -> list[float]:
        return []  # the loss is the metric

    def means(self, sums: list[float]) -> dict[str, float]:
        return {}
