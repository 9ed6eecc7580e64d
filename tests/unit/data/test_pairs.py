"""Preference pairs as rows: the chosen sequences then the rejected ones, cut to --seq_length as TRL's
DataCollatorForPreference cuts them and padded on to whole blocks (TRL pads to the longest row) as it makes them (input_ids, completion_mask) in both truncation modes, pairs
whose prompt fills --seq_length dropped as TRL drops them and counted in one line, and the reference
log-probabilities carried in the rows' order."""

from __future__ import annotations

import numpy as np
import pytest

from model_utils.data.chat import DOC_START, TRAINED
from model_utils.data.pairs import PairBlocks
from model_utils.data.rows import BlockSource, Rows
from model_utils.errors import ConfigError
from support.preference_data import collated

PAD = 0
# (prompt_ids, chosen_ids, rejected_ids) as TRL's DPOTrainer tokenizes them: answers of other lengths, a long
# prompt, a long answer, an empty prompt.
EXAMPLES = [
    ([11, 12, 13], [21, 22], [31]),
    ([14, 15], [23], [32, 33, 34]),
    ([16, 17, 18, 19, 20, 21], [24, 25], [35]),  # its prompt alone fills a seq_length of 6
    ([1], [26, 27, 28, 29, 30, 31, 32, 33], [36, 37]),  # a chosen answer longer than 6
    ([], [41, 42], [43]),  # no prompt: the answer starts each sequence
    ([2, 3, 4, 5, 6], [44], [45, 46]),
]


def _stored(examples: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """The pairs as a preparation stores them (chat.ChatEncoder): prompt + chosen then prompt + rejected, a
    document start at each, the answers trained on."""
    ids, flags = [], []
    for prompt, chosen, rejected in examples:
        for answer in (chosen, rejected):
            ids += prompt + answer
            mask = [0] * len(prompt) + [TRAINED] * len(answer)
            mask[0] |= DOC_START
            flags += mask
    return np.array(ids, np.uint16), np.array(flags, np.uint8)


def _blocks(examples: list[tuple], seq_length: int, mode: str = "keep_start", split: int = 3) -> PairBlocks:
    """Over two shards (the first `split` pairs, the rest)."""
    first, second = _stored(examples[:split]), _stored(examples[split:])
    return PairBlocks([first[0], second[0]], [first[1], second[1]], seq_length, PAD, mode, "train")


def _assert_rows_equal_trls(rows: Rows, examples: list[tuple], seq_length: int, mode: str) -> None:
    theirs = collated(examples, PAD, seq_length, mode)
    assert rows.paired and rows.positions is None and rows.targets is not None
    # TRL pads to the longest row; the kit's rows are whole blocks, padded on to seq_length, never targets.
    width = theirs["input_ids"].shape[1]
    assert rows.tokens.shape == (theirs["input_ids"].shape[0], seq_length)
    assert (
        rows.tokens[:, :width].tolist() == theirs["input_ids"].tolist()
        and (rows.tokens[:, width:] == PAD).all()
    )
    # A row's first token is never a target (nothing before it predicts it; TRL's loss drops it by its shift).
    completion = theirs["completion_mask"].numpy().astype(bool)
    assert (rows.targets[:, 1:width] == completion[:, 1:]).all() and not rows.targets[:, 0].any()
    assert not rows.targets[:, width:].any()
    assert not (rows.targets[:, :width] & (theirs["attention_mask"].numpy() == 0)).any()  # never the padding


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_rows_equal_trls_collated_batch(mode: str) -> None:
    seq = 6
    blocks: BlockSource = _blocks(EXAMPLES, seq, mode)
    # TRL drops, under keep_start, the pairs whose prompt alone fills max_length (_prepare_dataset's filter)
    kept = [e for e in EXAMPLES if mode == "keep_end" or len(e[0]) < seq]
    assert len(blocks) == len(kept) == (6 if mode == "keep_end" else 5)
    assert blocks.seq_length == seq
    for order in ([0, 1, 2, 3, 4], [3, 0], [2], [1, 4, 1]):
        rows = blocks.rows(np.array(order))
        assert rows.tokens.shape[0] == 2 * len(order)
        _assert_rows_equal_trls(rows, [kept[i] for i in order], seq, mode)
        assert rows.reference is None  # none computed


def test_without_truncation_the_rows_are_the_stored_sequences() -> None:
    blocks = _blocks(EXAMPLES, 64)
    rows = blocks.rows(np.arange(len(blocks)))
    _assert_rows_equal_trls(rows, EXAMPLES, 64, "keep_start")
    assert rows.tokens.shape == (12, 64)  # whole blocks (the longest row: 1 + 8)
    assert blocks.stats.truncated == blocks.stats.dropped == 0
    with pytest.raises(IndexError):
        blocks.rows(np.array([6]))


def test_the_summary_line_counts_truncated_and_dropped_pairs() -> None:
    assert _blocks(EXAMPLES, 6).summary == (
        "Data: 5 pairs (train); 2 truncated to --seq_length 6 (keep_start), 1 dropped: their prompt fills "
        "--seq_length"
    )
    assert _blocks(EXAMPLES, 6, "keep_end").summary == (
        "Data: 6 pairs (train); 3 truncated to --seq_length 6 (keep_end)"
    )


def test_every_pair_dropped_is_one_line_saying_what_to_do() -> None:
    with pytest.raises(ConfigError) as raised:
        _blocks(EXAMPLES[2:3], 6, split=1)
    line = str(raised.value)
    assert line.startswith("every one of the 1 train preference pairs has a prompt of --seq_length 6 tokens")
    assert "raise --seq_length, or pass --truncation_mode keep_end" in line and "\n" not in line
    assert len(_blocks(EXAMPLES[2:3], 6, "keep_end", split=1)) == 1
    empty = PairBlocks([], [], 6, PAD)  # no pairs at all (an empty validation split): no refusal, len 0
    assert len(empty) == 0 and empty.rows(np.zeros(0, np.int64)).tokens.shape == (0, 6)


def test_the_reference_log_probabilities_follow_the_rows() -> None:
    blocks = _blocks(EXAMPLES, 6)
    reference = np.arange(2 * len(blocks), dtype=np.float64).reshape(len(blocks), 2) / 10
    blocks.reference = reference
    assert blocks.reference.dtype == np.float32
    rows = blocks.rows(np.array([3, 1]))
    assert rows.reference is not None and rows.reference.dtype == np.float32
    assert rows.reference.tolist() == pytest.approx([0.6, 0.2, 0.7, 0.3])  # chosen 3, 1; rejected 3, 1
    with pytest.raises(ValueError, match=r"shape \(6, 2\), not \(5, 2\)"):
        blocks.reference = np.zeros((6, 2))
    blocks.reference = None
    assert blocks.rows(np.array([0])).reference is None


def test_a_shard_of_cut_pairs_is_refused() -> None:
    ids, flags = _stored(EXAMPLES[:2])
    cut = int(np.flatnonzero(flags & DOC_START)[-1])  # the last pair's rejected sequence missing
    with pytest.raises(
        ConfigError, match=r"holds 3 sequence starts, not whole pairs: prepare the data again"
    ):
        PairBlocks([ids[:cut]], [flags[:cut]], 8, PAD)
