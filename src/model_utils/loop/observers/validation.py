"""Validation: every --validation_freq trained steps and after the last, the loss of the planned validation blocks
(--validation_batches), on every rank, as a mean over their target tokens on all ranks, so that a full pass gives
the loss of the whole set whatever the world size; a mixture's sources each apart too (the overall loss over every
source's blocks read); with the bytes of text those targets decode to, for bits per byte. Before the first step
with --validation_at_start (a fresh run's step 0), and alone with --validation_only. Its result goes to every
observer (after_validation: the reporter's line, the trackers, the ledger); its time is left out of the
throughput."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from model_utils.config.arguments import ALL
from model_utils.data import mixture, step_batches, token_bytes
from model_utils.data.sampler import ValidationPlan, validation_plan
from model_utils.engines.base import EVAL
from model_utils.launch.distributed import all_reduce_sum
from model_utils.loop.hooks import Observer
from model_utils.observe import metrics, watchdog
from model_utils.observe.log import print0
from model_utils.resolve.resolver import split_origin

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext


class Validator(Observer):
    def __init__(self, ctx: LoopContext, plans: list[tuple[str | None, int, ValidationPlan]]) -> None:
        self.engine, self.hooks, self.device = ctx.engine, ctx.hooks, ctx.dist.device
        self.blocks, self.flatten, self.plans = ctx.run.val_blocks, ctx.flatten, plans
        self.shard, self.micro_batch = ctx.dist.shard, ctx.run.micro_batch_size
        loop = ctx.run.config.loop
        self.every, self.at_start, self.only = (
            loop.validation_freq,
            loop.validation_at_start,
            loop.validation_only,
        )
        # The UTF-8 bytes each token id stands for, for bits per byte: built once (a few us per id).
        self.byte_lengths = token_bytes.byte_lengths(ctx.run.tokenizer)

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Validator | None:
        """A plan per validation source (a mixture's sources each; one dataset's blocks, unnamed)."""
        run, dist = ctx.run, ctx.dist
        if run.val_blocks is None:
            return None
        mb = run.micro_batch_size
        assert isinstance(mb, int)
        batches = run.config.loop.validation_batches
        plans = []
        for name, first, count in mixture.parts(run.val_blocks):
            plan = validation_plan(
                count, None if batches == ALL else batches, mb, dist.data_rank, dist.data_ranks
            )
            if count < mb * dist.data_ranks:
                which = (
                    f"source {name}'s" if name is not None else split_origin(run.config.data, "validation")[0]
                )
                print0(
                    f"Validation: {which} has {count} blocks, fewer than micro batch {mb} x {dist.readers}: each "
                    f"validation reads all {count} (a rank without one repeats one, uncounted)"
                )
            plans.append((name, first, plan))
        return cls(ctx, plans)

    def evaluation_due(self, step: int, last: bool, start: bool = False) -> str | None:
        at_start = self.only or (self.at_start and step == 0)
        return watchdog.VALIDATION if (at_start if start else step % self.every == 0 or last) else None

    @torch.no_grad()
    def evaluate(self, step: int) -> metrics.Validation:
        started = time.perf_counter()
        self.engine.eval()
        # Summed losses in float64: the order of batches and ranks does not round it.
        sums: list[float] = []
        for _, first, plan in self.plans:
            loss_sum, targets, text_bytes = 0.0, 0, 0
            for indices, weight in zip(plan.batches, plan.weights, strict=True):
                # Each batch is progress: a full pass (--validation_batches all) may outlast the watchdog's limit.
                self.hooks.on_phase(watchdog.VALIDATION, step)
                batch = self._batch(first + indices)  # on the host, where its text bytes are counted
                if not weight:  # a repeated batch that keeps the ranks' forwards in step: not counted
                    batch = dataclasses.replace(batch, uncounted=True)
                # Every rank runs it, counted or not: ZeRO-3/FSDP gather the weights in each forward.
                loss = self.engine.eval_loss(batch.to(self.device))
                if weight:
                    loss_sum += loss
                    targets += batch.loss_units
                    if not batch.pairs:  # bits per byte are of text; a pair's loss is not per token
                        labels = batch.labels[batch.labels != step_batches.IGNORE_INDEX].numpy()
                        text_bytes += int(self.byte_lengths[labels].sum())
            sums += [loss_sum, float(targets), float(text_bytes)]
        self.engine.train()
        objective = self.engine.objective
        totals = all_reduce_sum(sums + objective.take(EVAL), self.device)  # one collective for everything
        objective_sums, totals = totals[len(sums) :], totals[: len(sums)]
        scores = [
            metrics.Score(nats, int(targets), int(text_bytes))
            for nats, targets, text_bytes in zip(totals[0::3], totals[1::3], totals[2::3], strict=True)
        ]
        return metrics.Validation(
            score=metrics.Score.combined(scores),
            blocks=sum(plan.blocks for _, _, plan in self.plans),
            total_blocks=sum(plan.total_blocks for _, _, plan in self.plans),
            seconds=time.perf_counter() - started,
            sources=tuple(
                (name, score)
                for (name, _, _), score in zip(self.plans, scores, strict=True)
                if name is not None
            ),
            preference=objective.means(objective_sums) or None,
        )

    def _batch(self, indices: np.ndarray) -> step_batches.Batch:
        blocks: Any = self.blocks
        if self.shard[1] > 1 and not self.flatten and len(indices) < self.micro_batch:
            # DeepSpeed's Ulysses takes micro-batches of the rows it was built for: a short one is filled with its
            # last row, untrained.
            filled = np.concatenate([indices, np.repeat(indices[-1:], self.micro_batch - len(indices))])
            return (
                step_batches.gather(blocks, filled, pin=False)
                .untrained_after(len(indices))
                .shard(*self.shard)
            )
        return step_batches.gather(blocks, indices, pin=False, flatten=self.flatten, shard=self.shard)
