"""Preference pairs (--data_format preference) as the rows of a step, as TRL's DataCollatorForPreference makes them.

A pair is one stored document (chat.py): its chosen sequence (the prompt and the chosen answer, as TRL's
DPOTrainer tokenizes them) followed by its rejected one, DOC_START on the first token of each, TRAINED on the
answers' tokens. The pairs are found once, when the split is opened, from the DOC_START bits of the memory-mapped
flags. A gather of n pairs is 2n rows: the chosen sequences of the pairs in order, then their rejected ones (TRL's
concatenated batch), each cut to --seq_length as TRL's collator cuts it (--truncation_mode keep_start: its first
tokens; keep_end: its last) and right-padded to --seq_length (padding: the EOS id, never a target), where TRL pads to
the longest of the 2n: the same positions every step, as packed blocks compute (docs/preference.md). Under
keep_start a pair whose prompt alone fills --seq_length keeps no answer token: it is dropped, as TRL drops it, and
counted in the split's line; indices address the pairs kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model_utils.data.chat import DOC_START, TRAINED
from model_utils.data.rows import Rows
from model_utils.errors import ConfigError

KEEP_START, KEEP_END = "keep_start", "keep_end"


@dataclass(frozen=True)
class PairStats:
    pairs: int  # kept: what len() counts
    truncated: int  # of those, with a sequence longer than --seq_length
    dropped: int  # keep_start: the prompt fills --seq_length


class PairBlocks:
    """A split's preference pairs (a BlockSource): len() pairs; rows(indices) the 2n rows of n of them, `paired`.

    `reference`: None, or the reference model's log-probabilities of each kept pair's sequences, [len(self), 2]
    float32 (columns: chosen, rejected), set once they are computed; rows() then carries those of its pairs."""

    def __init__(
        self,
        tokens: list[np.ndarray],
        flags: list[np.ndarray],
        seq_length: int,
        pad_id: int,
        truncation_mode: str = KEEP_START,
        split: str = "train",
    ) -> None:
        if truncation_mode not in (KEEP_START, KEEP_END):
            raise ValueError(f"truncation_mode {truncation_mode!r}: {KEEP_START} or {KEEP_END}")
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.truncation_mode = truncation_mode
        self.split = split
        self.tokens = tokens
        self.flags = flags
        shard_of, start_of, chosen_of, rejected_of, prompt_of = [], [], [], [], []
        for shard, (ids, flag) in enumerate(zip(tokens, flags, strict=True)):
            flag = np.asarray(flag)
            starts = np.flatnonzero(flag & DOC_START)
            if len(ids) and (len(starts) % 2 or starts[0] != 0):
                raise ConfigError(
                    f"prepared data: shard {shard} of the {split} pairs holds {len(starts)} sequence starts, not "
                    "whole pairs: prepare the data again"
                )
            if not len(starts):
                continue
            lengths = np.diff(np.append(starts, len(ids)))
            # The answers are the sequences' last tokens, so the prompt is what of the chosen is not trained on.
            trained = np.add.reduceat(flag & TRAINED, starts, dtype=np.int64)
            shard_of.append(np.full(len(starts) // 2, shard, np.int64))
            start_of.append(starts[0::2].astype(np.int64))
            chosen_of.append(lengths[0::2].astype(np.int64))
            rejected_of.append(lengths[1::2].astype(np.int64))
            prompt_of.append((lengths[0::2] - trained[0::2]).astype(np.int64))
        empty = np.zeros(0, np.int64)
        shard_arr, start, chosen, rejected, prompt = (
            np.concatenate(parts) if parts else empty
            for parts in (shard_of, start_of, chosen_of, rejected_of, prompt_of)
        )
        keep = prompt < seq_length if truncation_mode == KEEP_START else np.ones(len(prompt), bool)
        long = (chosen > seq_length) | (rejected > seq_length)
        self.stats = PairStats(int(keep.sum()), int((long & keep).sum()), int((~keep).sum()))
        if len(keep) and not keep.any():
            raise ConfigError(
                f"every one of the {len(keep):,} {split} preference pairs has a prompt of --seq_length "
                f"{seq_length} tokens or more, so --truncation_mode keep_start leaves none an answer token (TRL "
                "drops such pairs): raise --seq_length, or pass --truncation_mode keep_end"
            )
        self.pair_shard = shard_arr[keep]
        self.chosen_start = start[keep]
        self.chosen_length = chosen[keep]
        self.rejected_length = rejected[keep]
        self.prompt_length = prompt[keep]
        self._reference: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.pair_shard)

    @property
    def reference(self) -> np.ndarray | None:
        return self._reference

    @reference.setter
    def reference(self, value: np.ndarray | None) -> None:
        if value is not None:
            value = np.asarray(value, dtype=np.float32)
            if value.shape != (len(self), 2):
                raise ValueError(
                    f"reference log-probabilities of shape {value.shape}, not ({len(self)}, 2): one chosen and "
                    "one rejected per pair"
                )
        self._reference = value

    @property
    def summary(self) -> str:
        """The split's one line: the pairs kept, and how many were truncated and (keep_start) dropped."""
        line = (
            f"Data: {self.stats.pairs:,} pairs ({self.split}); {self.stats.truncated:,} truncated to --seq_length "
            f"{self.seq_length} ({self.truncation_mode})"
        )
        if self.truncation_mode == KEEP_START:
            line += f", {self.stats.dropped:,} dropped: their prompt fills --seq_length"
        return line

    def rows(self, indices: np.ndarray) -> Rows:
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"pair index out of range [0, {len(self)})")
        shards = np.concatenate([self.pair_shard[flat], self.pair_shard[flat]])
        starts = self.chosen_start[flat]
        starts = np.concatenate([starts, starts + self.chosen_length[flat]])
        lengths = np.concatenate([self.chosen_length[flat], self.rejected_length[flat]])
        kept = np.minimum(lengths, self.seq_length)
        if self.truncation_mode == KEEP_END:
            starts = starts + lengths - kept
        # Every row a whole block, as packed documents fill theirs: each step computes (and counts) the same
        # positions; the padding follows each sequence, so its tokens' causal attention never sees it.
        tokens = np.full((kept.size, self.seq_length), self.pad_id, np.int64)
        targets = np.zeros((kept.size, self.seq_length), bool)
        rows = zip(shards.tolist(), starts.tolist(), kept.tolist(), strict=True)
        for row, (shard, start, length) in enumerate(rows):
            tokens[row, :length] = self.tokens[shard][start : start + length]
            targets[row, :length] = (np.asarray(self.flags[shard][start : start + length]) & TRAINED) != 0
        targets[:, :1] = False  # nothing in the row predicts its first token
        reference = None
        if self._reference is not None:
            picked = self._reference[flat]
            reference = np.concatenate([picked[:, 0], picked[:, 1]])
        return Rows(tokens, targets, None, paired=True, reference=reference)
