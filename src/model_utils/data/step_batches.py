"""A step's micro-batches on the device, gathered one step ahead so the device never waits for data.

A batch is a gather of rows from the split's block source (rows.BlockSource: the memory-mapped token shards, or
any other source): no tokenization or collation is left to do at training time, and one background thread is
enough of a "DataLoader worker" to keep the next step's rows read (from the page cache or a shared filesystem)
while the device computes. On a CPU device that thread would gain nothing: the forward and backward already keep
every core of the rank busy, so there is nothing to overlap, and the hand-overs to and from the thread cost more
CPU than the read (0.31-0.34 ms a step for the thread against about 0.1 ms for the read itself, 2 CPU ranks of
the embedded default: tools/loop_overhead.py --threads). There the rows are read on the training thread, still
one step ahead when the trainer asks for the next step's targets.

The rows' targets become the labels (-100 where a token is not trained on) and their document positions the
model's position ids. On CUDA the rows land in pinned host memory and are copied without blocking, so the copy
neither waits for the kernels queued before it nor stalls the Python thread queuing the next ones.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from model_utils.data.rows import BlockSource
from model_utils.data.sampler import BlockSampler, DataPosition

# The label of a token that is not trained on: what Hugging Face's causal-LM losses skip.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    """One micro-batch as the model reads it.

    labels: the tokens, IGNORE_INDEX where a token is not a target (always a row's first token: nothing in the
    row predicts it, and a flattened batch must not predict it from the previous row's last).
    position_ids: None for rows of one sequence each (attention across the whole row).
    targets: how many labels are trained on, counted on the host when the rows were read.
    shifted: the labels are already the next tokens (a shard of a sequence, `shard`): position i's label is the
    token at i + 1, so the loss must not shift them again.
    pairs: preference pairs (0: none): the first `pairs` rows are their chosen sequences, the next `pairs` the
    rejected ones (Rows.paired); the loss averages over pairs, not tokens (engines/preference.py).
    reference: the pairs' reference log-probabilities, chosen then rejected (DPO), when known.
    uncounted: the pairs only keep the ranks' forwards in step (a validation batch repeated): no metric counts them.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None
    targets: int
    shifted: bool = False
    pairs: int = 0
    reference: torch.Tensor | None = None
    uncounted: bool = False

    @property
    def loss_units(self) -> int:
        """What the loss averages over: the targets (tokens), or the pairs of preference data."""
        return self.pairs or self.targets

    @property
    def counted_pairs(self) -> int:
        return 0 if self.uncounted else self.pairs

    def model_inputs(self) -> dict[str, Any]:
        """The keyword arguments of the model's forward (no KV cache in training or validation)."""
        inputs: dict[str, Any] = {"input_ids": self.input_ids, "labels": self.labels, "use_cache": False}
        if self.shifted:  # Hugging Face's causal-LM loss takes labels shifted already as shift_labels
            inputs["shift_labels"] = self.labels
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs

    def untrained_after(self, rows: int) -> Batch:
        """The batch with no target in its rows from `rows` on (rows that only fill a micro-batch)."""
        labels = self.labels.clone()
        labels[rows:] = IGNORE_INDEX
        return Batch(
            self.input_ids, labels, self.position_ids, int((labels != IGNORE_INDEX).sum()), self.shifted
        )

    def shard(self, index: int, count: int) -> Batch:
        """Shard `index` of `count` equal slices of every row, for sequence parallelism: the labels shifted over the
        whole row first (the last token of a slice predicts the first of the next), the position ids of the slice
        (each shard's attention sees where its tokens stand in the row)."""
        length = self.input_ids.shape[-1]
        assert length % count == 0, (length, count)
        ignored = torch.full_like(self.labels[..., :1], IGNORE_INDEX)
        following = torch.cat([self.labels[..., 1:], ignored], dim=-1)
        positions = self.position_ids
        if positions is None:
            positions = torch.arange(length, dtype=torch.int64).expand(self.input_ids.shape[0], length)
        cut = slice(index * length // count, (index + 1) * length // count)
        labels = following[..., cut].contiguous()
        return Batch(
            self.input_ids[..., cut].contiguous(),
            labels,
            positions[..., cut].contiguous(),
            int((labels != IGNORE_INDEX).sum()),
            shifted=True,
        )

    def device_loss_units(self) -> torch.Tensor:
        """`loss_units` as a device tensor computed on the device (no host-to-device copy to wait for)."""
        if self.pairs:
            return torch.full((), self.pairs, device=self.labels.device)
        return (self.labels != IGNORE_INDEX).sum()

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        ids, labels = move(self.input_ids), move(self.labels)
        assert ids is not None and labels is not None
        return dataclasses.replace(
            self,
            input_ids=ids,
            labels=labels,
            position_ids=move(self.position_ids),
            reference=move(self.reference),
        )

    def pin_memory(self) -> Batch:
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return dataclasses.replace(
            self,
            input_ids=self.input_ids.pin_memory(),
            labels=self.labels.pin_memory(),
            position_ids=pin(self.position_ids),
            reference=pin(self.reference),
        )


# A rank's share of each sequence under sequence parallelism: (its index in its group, the group's size).
Shard = tuple[int, int]


def gather(
    source: BlockSource, indices: np.ndarray, pin: bool, flatten: bool = False, shard: Shard | None = None
) -> Batch:
    """Rows `indices` of `source` as a Batch in host memory (pinned if `pin`).

    `flatten`: rows with document positions go into one row of all their tokens, the layout in which Hugging
    Face's flash-attention path reads position ids as variable-length sequences (it detects packing only in a
    batch of one row); attention still never crosses a row, since every row's positions start at 0.
    `shard`: this rank's slice of each row (Batch.shard), with sequence parallelism.
    """
    rows = source.rows(np.asarray(indices))
    tokens = torch.from_numpy(np.asarray(rows.tokens, dtype=np.int64))
    trained = (
        np.ones(tokens.shape, dtype=bool) if rows.targets is None else np.array(rows.targets, dtype=bool)
    )
    trained[:, 0] = False
    labels = tokens.masked_fill(torch.from_numpy(~trained), IGNORE_INDEX)
    positions = (
        None if rows.positions is None else torch.from_numpy(np.asarray(rows.positions, dtype=np.int64))
    )
    if flatten and positions is not None:
        tokens, labels, positions = (t.reshape(1, -1) for t in (tokens, labels, positions))
    pairs = len(tokens) // 2 if rows.paired else 0
    reference = None if rows.reference is None else torch.from_numpy(np.asarray(rows.reference, np.float32))
    batch = Batch(tokens, labels, positions, int(trained.sum()), pairs=pairs, reference=reference)
    if shard is not None and shard[1] > 1:
        batch = batch.shard(*shard)
    return batch.pin_memory() if pin else batch


class StepBatches:
    """The micro-batches of each optimizer step, in the sampler's order, prepared one step ahead."""

    def __init__(
        self,
        source: BlockSource,
        sampler: BlockSampler,
        device: torch.device,
        flatten: bool = False,
        background: bool | None = None,
        shard: Shard | None = None,
    ) -> None:
        """`background`: gather in a worker thread; by default where that overlaps the device's compute, on any
        device but the CPU (the module docstring). `shard`: gather's, this rank's slice of each sequence."""
        self.source = source
        self.sampler = sampler
        self.device = device
        self.pin = device.type == "cuda"
        self.flatten = flatten  # gather's: for varlen (flash) attention over document positions
        self.shard = shard
        if background is None:
            background = device.type != "cpu"
        self._worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="dskit-data") if background else None
        )
        self._ahead: tuple[DataPosition, Future[list[Batch]]] | None = None

    def _start(self, position: DataPosition) -> Future[list[Batch]]:
        """The gathering of the step at `position`: in the worker, or here and now without one."""
        if self._worker is not None:
            return self._worker.submit(self._gather_step, position)
        done: Future[list[Batch]] = Future()
        done.set_result(self._gather_step(position))
        return done

    def _gather_step(self, position: DataPosition) -> list[Batch]:
        return [
            gather(self.source, idx, self.pin, self.flatten, self.shard)
            for idx in self.sampler.step_indices(position)
        ]

    def at(self, position: DataPosition) -> list[Batch]:
        """The step at `position`, on the device; with a worker, starts gathering the step after it in the
        background.

        Any position works (a resume, a jump); only the one gathered ahead (right after the previous call, or the
        last `targets_at`) is ready early.
        """
        if self._ahead is not None and self._ahead[0] == position:
            host = self._ahead[1].result()  # re-raises what went wrong in the worker
        else:
            host = self._gather_step(position)
        self._ahead = None
        if self._worker is not None:
            following = self.sampler.advance(position)
            self._ahead = (following, self._start(following))
        return [batch.to(self.device, non_blocking=self.pin) for batch in host]

    def targets_at(self, position: DataPosition) -> int:
        """This rank's loss units (targets; pairs of preference data) in the step at `position` (counted on the host
        as its rows were read), waiting for its gathering; the step after the last `at` is being gathered already
        (with a worker), any other is gathered now (and `at` then finds it ready)."""
        if self._ahead is None or self._ahead[0] != position:
            self._ahead = (position, self._start(position))
        return sum(batch.loss_units for batch in self._ahead[1].result())

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
        self._ahead = None
