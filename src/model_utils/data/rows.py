"""What a training or validation step reads from its blocks: the rows, which of their tokens are trained on, and
where documents start inside them.

Every block source (the stream of prepared text, packed conversations, a mixture of sources) answers
`rows(indices)` with a `Rows`; the step batches, the loss over the step's tokens and the document-aware attention
read nothing else, so a new source needs no change downstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Rows:
    """Host-side rows of one gather.

    tokens:    [n, seq] int64.
    targets:   [n, seq] bool, True where token t is trained on (predicted from token t-1). A row's first token and
               the first token of every document are never targets (nothing before them in the same document
               predicts them); prompt tokens under a completion-only or assistant-only loss are not targets
               either. None: every token but each row's first is a target (the plain-text stream).
    positions: [n, seq] int64 position ids restarting at 0 where each document starts; attention never crosses
               such a start. None: one sequence per row (0..seq-1, attention across the whole row, as stream
               packing has always done).
    paired:    preference pairs (data/pairs.py): the first half of the rows are chosen sequences, the second half
               the rejected ones of the same pairs, in the same order (TRL's concatenated batch); each row is one
               sequence right-padded to the block (padding never a target).
    reference: [n] float32 with `paired`: the reference model's log-probabilities of the rows' sequences (the
               chosen then the rejected, as the rows); None: not computed yet.
    """

    tokens: np.ndarray
    targets: np.ndarray | None = None
    positions: np.ndarray | None = None
    paired: bool = False
    reference: np.ndarray | None = None


class BlockSource(Protocol):
    """A split's blocks: how many, and any of them by index."""

    seq_length: int

    def __len__(self) -> int: ...

    def rows(self, indices: np.ndarray) -> Rows: ...
