"""Weighted mixtures (data/mixture.py): what an epoch holds (shares normalised, capped by max_repeat), the shares
held in every window of the order (within 0.5 percentage points over 10 M tokens, computed from the index), the
order a resume reproduces at any world size, rows from sources of any kind, and each bad source as one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model_utils.config.arguments import parse_args
from model_utils.data import mixture
from model_utils.data.rows import Rows
from model_utils.data.sampler import BlockSampler, DataPosition, epoch_blocks
from model_utils.errors import ConfigError
from support.prepared_data import here, write_jsonl

SEQ = 2048


class Numbered:
    """A block source whose block b of source s holds the token s * 1000 + b everywhere (the id it was read as)."""

    def __init__(self, source: int, blocks: int, seq: int = 4, marked: bool = False) -> None:
        self.source, self.blocks, self.seq_length, self.marked = source, blocks, seq, marked

    def __len__(self) -> int:
        return self.blocks

    def rows(self, indices: np.ndarray) -> Rows:
        indices = np.asarray(indices, dtype=np.int64)
        assert indices.min() >= 0 and indices.max() < self.blocks
        tokens = np.repeat((self.source * 1000 + indices)[:, None], self.seq_length, axis=1)
        if not self.marked:
            return Rows(tokens)
        # A source of another kind: targets and document positions of its own.
        targets = np.zeros(tokens.shape, dtype=bool)
        targets[:, -1] = True
        return Rows(tokens, targets, np.zeros(tokens.shape, dtype=np.int64))


def make(shares, max_repeat, sizes, seed: int = 7, seq: int = 4) -> mixture.Mixture:
    names = [f"s{i}" for i in range(len(sizes))]
    sources = [Numbered(i, n, seq) for i, n in enumerate(sizes)]
    return mixture.Mixture(names, sources, mixture.plan(names, shares, max_repeat, sizes), seed)


def test_the_epoch_is_capped_by_the_source_that_runs_out_first() -> None:
    plan = mixture.plan(["web", "code"], [7, 3], [1, 1], [1000, 100])  # shares normalised: 0.7, 0.3
    assert plan.shares == pytest.approx((0.7, 0.3))
    assert plan.capped_by == "code" and plan.epoch_blocks == (233, 100)  # code whole, web a part
    repeated = mixture.plan(["web", "code"], [0.7, 0.3], [1, 4], [1000, 100])
    assert repeated.capped_by == "code" and repeated.epoch_blocks == (933, 400)  # code 4x, web 93%
    web_bound = mixture.plan(["web", "code"], [0.7, 0.3], [1, 10], [1000, 100])
    assert web_bound.capped_by == "web" and web_bound.epoch_blocks == (1000, 428)  # an epoch of 1,428 blocks
    line = repeated.describe()
    assert line.startswith("Mixture: web 70.0% planned, 69.99% of each epoch (933 of 1,000 blocks, 0.93x); ")
    assert line.endswith("an epoch is 1,333 blocks, capped by code (max_repeat 4)")


def test_the_counts_are_largest_remainders_and_never_past_a_limit() -> None:
    for sizes in ([37, 11, 5], [1000, 999, 998], [3, 3, 3]):
        plan = mixture.plan(["a", "b", "c"], [0.5, 0.3, 0.2], [1, 1.5, 2], sizes)
        total = plan.blocks_per_epoch
        exact = np.array(plan.shares) * total
        assert np.all(np.abs(np.array(plan.epoch_blocks) - exact) < 1)  # rounded, summing to the epoch
        assert all(
            n <= int(size * r) for n, size, r in zip(plan.epoch_blocks, sizes, (1, 1.5, 2), strict=True)
        )


def test_a_share_too_small_for_one_block_is_one_line() -> None:
    with pytest.raises(
        ConfigError,
        match=r"source tiny's share gives it no block in an epoch of 10 blocks: fix: .* max_repeat of big,",
    ):
        mixture.plan(["big", "tiny"], [1, 0.001], [1, 1], [10, 10])


def test_shares_hold_within_half_a_point_over_ten_million_tokens_anywhere_in_the_run() -> None:
    """The issue's check, from the index alone: every stretch of ten million tokens (4,883 blocks of 2,048), at
    the start, mid-epoch and across an epoch boundary, holds each source's share within 0.5 percentage points;
    and any window at all holds it within two blocks."""
    shares = [0.5, 0.3, 0.15, 0.05]
    mix = make(shares, [1, 1, 3, 8], [9000, 3000, 700, 150], seq=SEQ)
    window = -(-10_000_000 // SEQ)
    n = mix.blocks_per_epoch
    run = np.concatenate([mix.epoch_order(0), mix.epoch_order(1)])
    source = mix.source_of(run)
    epoch_shares = np.array(mix.plan.epoch_shares())
    assert np.all(np.abs(epoch_shares - shares) < 1e-3)
    for start in (0, n // 3, n - window // 2, n):
        counts = np.bincount(source[start : start + window], minlength=4)
        assert np.all(np.abs(counts / window - np.array(shares)) < 0.005), (start, counts / window)
    cumulative = np.cumsum(np.eye(4, dtype=np.int64)[source], axis=0)
    for width in (16, 97, window):
        counts = cumulative[width:] - cumulative[:-width]
        assert np.all(np.abs(counts - width * epoch_shares) <= 2), width
    # A shuffle of the same blocks would not hold: the order is interleaved, not drawn.
    shuffled = np.random.default_rng(0).permutation(source[:n])
    spread = [np.bincount(shuffled[s : s + 16], minlength=4) for s in range(0, n - 16, 16)]
    assert max(np.abs(c - 16 * epoch_shares).max() for c in spread) > 2


def test_each_epoch_draws_whole_shuffles_and_another_part_of_a_capped_source() -> None:
    mix = make([0.5, 0.5], [1, 2.5], [400, 100])  # 250 blocks of each: s0 a part, s1 2.5 times
    assert mix.plan.epoch_blocks == (250, 250)
    orders = [mix.epoch_order(e) for e in (0, 1)]
    for order in orders:
        assert len(order) == mix.blocks_per_epoch == epoch_blocks(mix) == 500
        first = order[mix.source_of(order) == 0]
        assert len(set(first.tolist())) == 250  # max_repeat 1: never twice in an epoch
        second = np.bincount(order[mix.source_of(order) == 1] - 400, minlength=100)
        assert set(second.tolist()) == {2, 3}  # two whole passes, then half of a third
    assert set(orders[0].tolist()) != set(orders[1].tolist())  # another part of s0 in each epoch
    again = make([0.5, 0.5], [1, 2.5], [400, 100])
    assert np.array_equal(again.epoch_order(1), orders[1])  # a function of (seed, epoch) alone
    assert not np.array_equal(make([0.5, 0.5], [1, 2.5], [400, 100], seed=8).epoch_order(1), orders[1])


def seen(mix: mixture.Mixture, position: DataPosition, steps: int, micro: int, accum: int, world: int):
    """The block ids each step reads, rank by rank in rank order, from `position` on; and the position after."""
    samplers = [BlockSampler.of(mix, micro, accum, rank, world, seed=1) for rank in range(world)]
    out = []
    for _ in range(steps):
        out.append([i for s in samplers for i in s.step_indices(position).reshape(-1).tolist()])
        position = samplers[0].advance(position)
    return out, position


def test_a_resume_reads_the_uninterrupted_runs_blocks_at_any_world_size() -> None:
    """2 ranks x micro 2 x accumulation 3 straight through two epochs; the same run killed mid-accumulation of
    step 9 (its micro-batches read, no step applied) resumes from the step-8 position: on 2 ranks, and on 1 rank
    and on 3 ranks with the same global batch of 12, each step reads exactly the same block ids."""
    mix = make([0.6, 0.4], [1, 2], [150, 40])
    straight, _ = seen(mix, DataPosition(), 30, 2, 3, 2)
    assert len({tuple(step) for step in straight}) == 30
    _, saved = seen(mix, DataPosition(), 8, 2, 3, 2)
    killed = BlockSampler.of(mix, 2, 3, 0, 2, seed=1).step_indices(saved)[0]  # read, the step never applied
    assert killed.tolist() == straight[8][:2]
    for micro, accum, world in ((2, 3, 2), (2, 6, 1), (4, 1, 3)):
        fresh = make([0.6, 0.4], [1, 2], [150, 40])  # a new process: nothing cached
        resumed, _ = seen(fresh, saved, 22, micro, accum, world)
        assert resumed == straight[8:], (micro, accum, world)
    assert epoch_blocks(mix) // 12 < 30  # the run crossed an epoch boundary


def test_blocks_read_count_each_source_from_the_position_alone() -> None:
    mix = make([0.7, 0.3], [1, 1], [700, 300])
    order = np.concatenate([mix.epoch_order(0), mix.epoch_order(1)])
    n = mix.blocks_per_epoch
    for position in (DataPosition(0, 0), DataPosition(0, 333), DataPosition(1, 5), DataPosition(0, 100)):
        expected = np.bincount(mix.source_of(order[: position.epoch * n + position.consumed]), minlength=2)
        assert mix.blocks_read(position).tolist() == expected.tolist()  # forwards, and back (a rollback)
        fresh = make([0.7, 0.3], [1, 1], [700, 300])
        assert fresh.blocks_read(position).tolist() == expected.tolist()
    shares = mix.shares_read(DataPosition(1, 0))
    assert shares == pytest.approx({"s0": 0.7, "s1": 0.3})


def test_rows_come_from_each_source_and_kinds_mix() -> None:
    blocks = mixture.SourceBlocks(["text", "chat"], [Numbered(0, 5), Numbered(1, 3, marked=True)])
    assert len(blocks) == 8 and blocks.parts() == [("text", 0, 5), ("chat", 5, 3)]
    rows = blocks.rows(np.array([6, 0, 4, 5]))
    assert rows.tokens[:, 0].tolist() == [1001, 0, 4, 1000]
    assert rows.targets is not None and rows.positions is not None
    assert rows.targets[0].tolist() == [False, False, False, True]  # the chat source's own
    assert rows.targets[1].tolist() == [False, True, True, True]  # the stream's: all but the first
    assert rows.positions[1].tolist() == [0, 1, 2, 3] and rows.positions[0].tolist() == [0, 0, 0, 0]
    plain = mixture.SourceBlocks(["a", "b"], [Numbered(0, 2), Numbered(1, 2)]).rows(np.array([3, 0]))
    assert plain.targets is None and plain.positions is None  # nobody says more than the stream
    assert blocks[np.array([[6, 0]])].shape == (1, 2, 4)  # as TokenBlocks answers blocks[indices]
    with pytest.raises(IndexError):
        blocks.rows(np.array([8]))
    assert mixture.parts(Numbered(0, 5)) == [(None, 0, 5)]


def corpus(path: Path, word: str, n: int) -> Path:
    return write_jsonl(path, [f"{word} {i}: " + f"{word} words " * (1 + i % 6) for i in range(n)])


def opened(tmp_path: Path, tokenizer, *flags: str) -> mixture.OpenedMixture:
    cfg = parse_args(["--data_cache_dir", str(tmp_path / "cache"), *flags])
    return mixture.open_sources(cfg.data, cfg.explicit, tokenizer, "tiny-qwen3", here, 32, cfg.loop.seed)


def test_each_source_is_prepared_apart_with_its_own_options(tmp_path: Path, tokenizer, capsys) -> None:
    a = corpus(tmp_path / "a.jsonl", "alpha", 300)
    b = write_jsonl(tmp_path / "b.jsonl", [f"beta {i} " * 9 for i in range(100)], field="body")
    listed = [
        {"name": "a", "dataset": str(a), "share": 3},
        {
            "name": "b",
            "dataset": str(b),
            "share": 1,
            "max_repeat": 3,
            "text_field": "body",
            "validation_fraction": 0,
        },
    ]
    mix = opened(tmp_path, tokenizer, "--sources", json.dumps(listed))
    assert mix.train.names == ("a", "b") and mix.train.plan.shares == (0.75, 0.25)
    assert "Mixture: a 75.0% planned" in capsys.readouterr().out
    assert len(list((tmp_path / "cache" / "prepared").iterdir())) == 2  # keyed separately
    assert mix.validation is not None and mix.validation.names == ("a",)  # b holds none out
    assert tokenizer.decode(mix.train.rows(np.array([len(mix.train) - 1])).tokens[0]).count("beta") >= 2
    again = opened(tmp_path, tokenizer, "--sources", json.dumps(listed))
    assert again.fingerprint == mix.fingerprint
    listed[0]["share"], listed[1]["share"] = 0.75, 0.25  # the same mixture, written otherwise
    assert opened(tmp_path, tokenizer, "--sources", json.dumps(listed)).fingerprint == mix.fingerprint
    listed[1]["share"] = 0.5
    assert opened(tmp_path, tokenizer, "--sources", json.dumps(listed)).fingerprint != mix.fingerprint


def test_a_missing_source_path_is_one_line(tmp_path: Path, tokenizer) -> None:
    a = corpus(tmp_path / "a.jsonl", "alpha", 50)
    with pytest.raises(ConfigError) as caught:
        opened(tmp_path, tokenizer, "--sources", f"a={a}@1,b={tmp_path / 'nope.jsonl'}@1")
    assert str(caught.value).startswith(f"source b: dataset {tmp_path / 'nope.jsonl'} does not exist: fix: ")
    assert not (tmp_path / "cache").exists()  # checked before any source is prepared


def test_a_source_of_zero_blocks_is_one_line(tmp_path: Path, tokenizer) -> None:
    a = corpus(tmp_path / "a.jsonl", "alpha", 50)
    tiny = write_jsonl(tmp_path / "tiny.jsonl", ["hi"])
    with pytest.raises(
        ConfigError, match=r"^source tiny has \d+ train tokens, fewer than one block of 32: fix: "
    ):
        opened(tmp_path, tokenizer, "--sources", f"a={a}@1,tiny={tiny}@1", "--validation_fraction", "0")
