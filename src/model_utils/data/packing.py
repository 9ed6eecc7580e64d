"""Blocks of whole documents for prompt/completion and conversation data: best-fit-decreasing packing.

Documents (one conversation, one prompt + completion; found by the DOC_START flags stored beside the tokens)
are placed longest first, each into the block whose free space fits it most tightly, a new block when none
does. No document is split: one longer than a block is truncated to its first --seq_length tokens, or dropped
when nothing in those is trained on; both are counted in the summary line. The packing depends on the
documents alone (their lengths, ties by their order in the prepared data), so every rank and every process
that opens the same data gets the same blocks. A block's rows carry the targets (the stored trained-on flags,
never a document's first token) and position ids that restart at each document; the free space at a block's
end is padding (EOS ids, no target, its own positions).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from model_utils.data.chat import DOC_START, TRAINED
from model_utils.data.rows import Rows


@dataclass(frozen=True)
class PackingStats:
    documents: int
    blocks: int
    tokens: int  # document tokens in the blocks
    trained: int  # of those, targets
    capacity: int  # blocks x seq_length
    truncated: int
    dropped: int

    @property
    def fill(self) -> float:
        return self.tokens / self.capacity if self.capacity else 0.0

    @property
    def trained_share(self) -> float:
        return self.trained / self.tokens if self.tokens else 0.0

    def line(self, seq_length: int) -> str:
        return (
            f"packed {self.documents:,} documents into {self.blocks:,} blocks of {seq_length} tokens: "
            f"{self.fill:.1%} of the blocks' tokens are documents' (the rest padding), {self.trained_share:.1%} "
            f"of those are trained on; {self.truncated:,} documents longer than a block truncated to it, "
            f"{self.dropped:,} dropped (nothing trained on in their first {seq_length} tokens)"
        )


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of item indices: items longest first (ties: lower index first), each into the bin with the least
    free space that holds it. Free spaces are kept as a sorted list of the distinct values in use with a stack of
    bins per value, so an item costs a bisect (lengths are at most `capacity`)."""
    order = np.lexsort((np.arange(len(lengths)), -lengths))
    bins: list[list[int]] = []
    free_values: list[int] = []  # sorted, distinct free spaces of open bins
    by_free: dict[int, list[int]] = {}
    for item in order.tolist():
        size = int(lengths[item])
        at = bisect.bisect_left(free_values, size)
        if at == len(free_values):
            chosen, free = len(bins), capacity
            bins.append([])
        else:
            free = free_values[at]
            stack = by_free[free]
            chosen = stack.pop()
            if not stack:
                free_values.pop(at)
                del by_free[free]
        bins[chosen].append(item)
        left = free - size
        if left > 0:
            if left not in by_free:
                bisect.insort(free_values, left)
                by_free[left] = []
            by_free[left].append(chosen)
    return bins


class PackedBlocks:
    """A split's documents packed into blocks of `seq_length` (a BlockSource)."""

    def __init__(
        self, tokens: list[np.ndarray], flags: list[np.ndarray], seq_length: int, pad_id: int
    ) -> None:
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.tokens = tokens
        self.flags = flags
        shard_of, start_of, length_of, trained_of = [], [], [], []
        for shard, (ids, flag) in enumerate(zip(tokens, flags, strict=True)):
            flag = np.asarray(flag)
            starts = np.flatnonzero(flag & DOC_START)
            if len(ids) and (not len(starts) or starts[0] != 0):
                starts = np.concatenate([[0], starts])  # (a prefix cut by --max_tokens starts mid-way: never)
            ends = np.append(starts[1:], len(ids))
            lengths = ends - starts
            # Trained tokens per document (a long one's: in the part kept), summed by segment, not per document.
            trained = np.add.reduceat(flag & TRAINED, starts, dtype=np.int64) if len(starts) else starts
            for doc in np.flatnonzero(lengths > seq_length).tolist():
                trained[doc] = int(
                    (flag[starts[doc] : starts[doc] + seq_length] & TRAINED).sum(dtype=np.int64)
                )
            shard_of.append(np.full(len(starts), shard, np.int64))
            start_of.append(starts.astype(np.int64))
            length_of.append(lengths.astype(np.int64))
            trained_of.append(trained.astype(np.int64))
        empty = np.zeros(0, np.int64)
        shard_arr = np.concatenate(shard_of) if shard_of else empty
        start_arr = np.concatenate(start_of) if start_of else empty
        lengths = np.concatenate(length_of) if length_of else empty
        trained = np.concatenate(trained_of) if trained_of else empty
        long = lengths > seq_length
        keep = ~long | (
            trained > 0
        )  # a long document is truncated, unless nothing in the kept part is trained on
        self.doc_shard = shard_arr[keep]
        self.doc_start = start_arr[keep]
        self.doc_length = np.minimum(lengths[keep], seq_length)
        self.blocks = best_fit_decreasing(self.doc_length, seq_length)
        self.stats = PackingStats(
            documents=int(keep.sum()),
            blocks=len(self.blocks),
            tokens=int(self.doc_length.sum()),
            trained=int(trained[keep].sum()),
            capacity=len(self.blocks) * seq_length,
            truncated=int((long & keep).sum()),
            dropped=int((~keep).sum()),
        )
        self.dtype = tokens[0].dtype if tokens else np.dtype(np.uint16)

    def __len__(self) -> int:
        return len(self.blocks)

    def _check(self, flat: np.ndarray) -> None:
        if flat.size and (flat.min() < 0 or flat.max() >= len(self.blocks)):
            raise IndexError(f"block index out of range [0, {len(self.blocks)})")

    def rows(self, indices: np.ndarray) -> Rows:
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)
        self._check(flat)
        n, seq = flat.size, self.seq_length
        tokens = np.full((n, seq), self.pad_id, np.int64)
        targets = np.zeros((n, seq), bool)
        positions = np.zeros((n, seq), np.int64)
        for row, block in enumerate(flat.tolist()):
            at = 0
            for doc in self.blocks[block]:
                shard, start, length = self.doc_shard[doc], self.doc_start[doc], self.doc_length[doc]
                tokens[row, at : at + length] = self.tokens[shard][start : start + length]
                targets[row, at : at + length] = (
                    np.asarray(self.flags[shard][start : start + length]) & TRAINED
                ) != 0
                positions[row, at : at + length] = np.arange(length)
                at += length
            positions[row, at:] = np.arange(seq - at)  # the padding: a segment of its own, nothing trained
        targets[:, 0] = False
        return Rows(tokens, targets, positions)

    def __getitem__(self, index: object) -> np.ndarray:
        indices = np.asarray(index, dtype=np.int64)
        rows = self.rows(indices.reshape(-1)).tokens.astype(self.dtype)
        return rows.reshape(*indices.shape, self.seq_length)
