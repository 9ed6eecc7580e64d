"""Best-fit-decreasing packing of whole documents: every document once and whole (or truncated/dropped past a
block, counted), rows whose positions restart at each document and whose targets never cross one, the same
blocks however the documents were sharded, and >= 95% fill on a skewed length distribution."""

from __future__ import annotations

import itertools

import numpy as np

from model_utils.data.chat import DOC_START, TRAINED
from model_utils.data.packing import PackedBlocks, best_fit_decreasing

EOS = 0


def _documents(lengths: list[int], seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Documents of these lengths: ids count up from 1 within each (so a row shows where it came from), the
    first half of each a prompt (untrained), the rest trained."""
    rng = np.random.default_rng(seed)
    tokens, flags = [], []
    for n in lengths:
        tokens.append(rng.integers(1, 1000, n).astype(np.uint16))
        flag = np.zeros(n, np.uint8)
        flag[n // 2 :] = TRAINED
        flag[0] = DOC_START
        flags.append(flag)
    return tokens, flags


def _shards(tokens, flags, cuts: list[int]):
    """The documents concatenated into shards cut after documents `cuts`."""
    bounds = [0, *cuts, len(tokens)]
    return (
        [np.concatenate(tokens[a:b]) for a, b in itertools.pairwise(bounds)],
        [np.concatenate(flags[a:b]) for a, b in itertools.pairwise(bounds)],
    )


def _skewed(n: int, seq: int, seed: int = 1) -> list[int]:
    """Chat-like lengths: most short, a long tail (lognormal), a few past the block."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=5.0, sigma=0.9, size=n).astype(int), 4, 3 * seq).tolist()


def test_best_fit_decreasing_places_each_item_once_within_capacity() -> None:
    lengths = np.array([5, 3, 8, 2, 2, 7, 1, 4])
    bins = best_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(lengths[b].sum() <= 10 for b in bins)
    assert len(bins) == int(np.ceil(lengths.sum() / 10))  # 32 tokens: 4 bins, the least possible


def test_rows_keep_documents_apart() -> None:
    tokens, flags = _documents([7, 3, 12, 5, 9, 2])
    blocks = PackedBlocks(*_shards(tokens, flags, [2, 4]), seq_length=16, pad_id=EOS)
    rows = blocks.rows(np.arange(len(blocks)))
    seen = []
    for row in range(len(blocks)):
        starts = np.flatnonzero(rows.positions[row] == 0)
        ends = [*starts[1:], 16]
        for start, end in zip(starts, ends, strict=True):
            segment = rows.tokens[row, start:end]
            assert not rows.targets[row, start]  # a document's first token is never a target
            assert np.array_equal(rows.positions[row, start:end], np.arange(end - start))
            match = [i for i, t in enumerate(tokens) if len(t) == end - start and np.array_equal(t, segment)]
            if match:
                doc = match[0]
                expected = (flags[doc] & TRAINED) != 0
                expected[0] = False
                assert np.array_equal(rows.targets[row, start:end], expected)
                seen.append(doc)
            else:  # the padding after the documents: EOS, nothing trained
                assert end == 16 and (segment == EOS).all() and not rows.targets[row, start:end].any()
    assert sorted(seen) == list(range(len(tokens)))  # each document once, whole
    assert np.array_equal(blocks[np.arange(len(blocks))], rows.tokens)


def test_packing_is_the_same_however_the_documents_were_sharded() -> None:
    tokens, flags = _documents(_skewed(400, 256))
    one = PackedBlocks(*_shards(tokens, flags, []), seq_length=256, pad_id=EOS)
    many = PackedBlocks(*_shards(tokens, flags, [50, 51, 200, 333]), seq_length=256, pad_id=EOS)
    again = PackedBlocks(*_shards(tokens, flags, [50, 51, 200, 333]), seq_length=256, pad_id=EOS)
    assert one.blocks == many.blocks == again.blocks
    everything = np.arange(len(one))
    for a, b in ((one.rows(everything), many.rows(everything)),):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.targets, b.targets)
        assert np.array_equal(a.positions, b.positions)


def test_documents_longer_than_a_block_are_truncated_or_dropped_and_counted() -> None:
    tokens, flags = _documents([30, 10, 30, 5])  # the 30s exceed a block of 20
    flags[2][:] = 0  # its first 20 tokens (all of it, here) have nothing to train on: dropped
    flags[2][0] = DOC_START
    blocks = PackedBlocks(*_shards(tokens, flags, []), seq_length=20, pad_id=EOS)
    assert (blocks.stats.truncated, blocks.stats.dropped, blocks.stats.documents) == (1, 1, 3)
    rows = blocks.rows(np.arange(len(blocks)))
    assert any(np.array_equal(row, tokens[0][:20]) for row in rows.tokens)  # its first 20 tokens, whole block
    assert "1 documents longer than a block truncated to it, 1 dropped" in blocks.stats.line(20)


def test_fill_on_a_skewed_length_distribution_is_at_least_95_percent() -> None:
    seq = 2048
    lengths = _skewed(20_000, seq, seed=3)
    assert max(lengths) > seq and np.median(lengths) < seq / 10  # skewed: mostly short, a tail past the block
    tokens, flags = _documents(lengths)
    blocks = PackedBlocks(*_shards(tokens, flags, []), seq_length=seq, pad_id=EOS)
    stats = blocks.stats
    assert stats.fill >= 0.95, stats.line(seq)
    assert stats.documents + stats.dropped == len(lengths) and stats.truncated > 0
    rows = blocks.rows(np.arange(min(64, len(blocks))))
    assert rows.targets.sum() <= stats.trained
