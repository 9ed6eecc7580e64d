"""Weighted mixtures (--sources): several datasets trained as one block source, each at its target token share.

The sources' blocks are numbered one after another (global block index -> source, local block), so the mixture is
itself a block source: the step batches, the loss and the validation read its `rows` as they read one dataset's,
whatever kind of source each part is.

What an epoch holds (OLMo-core's target ratios with a maximum repetition): the shares are normalised; source i
may give at most max_repeat_i x its blocks to an epoch; the epoch is the largest number of blocks in which every
source reaches its share within that limit, so the source that runs out first caps it (the start line names it)
and the others give a part of their blocks, a different seeded part each epoch. Each source's count is its share
of the epoch rounded by largest remainders (Hamilton), so the counts sum to the epoch. Where OLMo-core stops on a
requested token count that a source cannot reach, an epoch here simply ends where the first source would have to
repeat more; --epochs and --max_steps count such epochs. A source repeated past its size goes through whole
seeded permutations of its blocks, then part of one more.

The order of an epoch, seeded by (seed, epoch): each source's blocks in their own shuffled order, interleaved so
that every source's j-th block sits at the time (j + offset_i) / n_i of the epoch (a seeded offset in [0, 1)
per source). Any window of the run therefore holds each source's share to within two blocks, not one source and
then the other, and the order is a function of (seed, epoch) alone: the sampler's position (epoch, consumed)
stays all a resume needs, at any world size.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model_utils.data import block_cache, chat, documents, token_shards
from model_utils.data.documents import EMBEDDED
from model_utils.data.rows import BlockSource, Rows
from model_utils.data.sampler import DataPosition
from model_utils.errors import ConfigError
from model_utils.observe.log import print0


class SourceBlocks:
    """Named block sources numbered one after another: len() and rows() over all of them."""

    def __init__(self, names: Sequence[str], sources: Sequence[BlockSource]) -> None:
        assert len(names) == len(sources) > 0
        self.names, self.sources = tuple(names), tuple(sources)
        self.offsets = np.cumsum([0] + [len(s) for s in sources]).astype(np.int64)
        self.seq_length = sources[0].seq_length
        assert all(s.seq_length == self.seq_length for s in sources)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def parts(self) -> list[tuple[str, int, int]]:
        """(name, first global index, blocks) of each source."""
        return [
            (n, int(self.offsets[i]), len(s))
            for i, (n, s) in enumerate(zip(self.names, self.sources, strict=True))
        ]

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source number of each global block index."""
        return np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1

    def rows(self, indices: np.ndarray) -> Rows:
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"block index out of range [0, {len(self)})")
        which = self.source_of(flat)
        seq = self.seq_length
        tokens = np.empty((flat.size, seq), dtype=np.int64)
        answered: list[tuple[np.ndarray, Rows]] = []
        for number in np.unique(which).tolist():
            mask = which == number
            part = self.sources[number].rows(flat[mask] - self.offsets[number])
            tokens[mask] = part.tokens
            answered.append((mask, part))
        # A source that says nothing of targets or positions means the plain stream's (rows.py); only when another
        # source of the same gather says something are those spelled out for it.
        targets = positions = None
        if any(part.targets is not None for _, part in answered):
            targets = np.ones((flat.size, seq), dtype=bool)
            targets[:, 0] = False
            for mask, part in answered:
                if part.targets is not None:
                    targets[mask] = part.targets
        if any(part.positions is not None for _, part in answered):
            positions = np.broadcast_to(np.arange(seq, dtype=np.int64), (flat.size, seq)).copy()
            for mask, part in answered:
                if part.positions is not None:
                    positions[mask] = part.positions
        return Rows(tokens, targets, positions)

    def __getitem__(self, index: Any) -> np.ndarray:
        """The tokens of blocks `index` (any shape), as TokenBlocks answers it."""
        indices = np.asarray(index, dtype=np.int64)
        return self.rows(indices.reshape(-1)).tokens.reshape(*indices.shape, self.seq_length)


def parts(blocks: BlockSource) -> list[tuple[str | None, int, int]]:
    """(name, first global index, blocks) of each source of `blocks`; a single dataset's: one unnamed part."""
    if isinstance(blocks, SourceBlocks):
        return list(blocks.parts())
    return [(None, 0, len(blocks))]


@dataclass(frozen=True)
class MixturePlan:
    """What one epoch of a mixture holds."""

    names: tuple[str, ...]
    shares: tuple[float, ...]  # planned, normalised
    max_repeat: tuple[float, ...]
    source_blocks: tuple[int, ...]  # blocks each source has
    epoch_blocks: tuple[int, ...]  # blocks each source gives to every epoch
    capped_by: str  # the source whose max_repeat ends the epoch

    @property
    def blocks_per_epoch(self) -> int:
        return sum(self.epoch_blocks)

    def epoch_shares(self) -> tuple[float, ...]:
        return tuple(n / self.blocks_per_epoch for n in self.epoch_blocks)

    def to_dict(self) -> dict[str, dict[str, float]]:
        """Each source's planned and epoch share, max_repeat and blocks (the metrics file's start record)."""
        return {
            name: {"planned_share": planned, "epoch_share": actual, "max_repeat": limit, "epoch_blocks": n}
            for name, planned, actual, limit, n in zip(
                self.names, self.shares, self.epoch_shares(), self.max_repeat, self.epoch_blocks, strict=True
            )
        }

    def describe(self) -> str:
        parts = [
            f"{name} {100 * planned:.1f}% planned, {100 * actual:.2f}% of each epoch ({n:,} of {size:,} blocks, "
            f"{n / size:.2f}x)"
            for name, planned, actual, n, size in zip(
                self.names,
                self.shares,
                self.epoch_shares(),
                self.epoch_blocks,
                self.source_blocks,
                strict=True,
            )
        ]
        limit = self.max_repeat[self.names.index(self.capped_by)]
        return (
            f"Mixture: {'; '.join(parts)}; an epoch is {self.blocks_per_epoch:,} blocks, capped by "
            f"{self.capped_by} (max_repeat {limit:g})"
        )


def _largest_remainders(total: int, shares: np.ndarray) -> np.ndarray:
    exact = total * shares
    counts = np.floor(exact).astype(np.int64)
    left = total - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")  # ties: the source listed first
    counts[order[:left]] += 1
    return counts


def plan(
    names: Sequence[str], shares: Sequence[float], max_repeat: Sequence[float], blocks: Sequence[int]
) -> MixturePlan:
    """The epoch of these sources (the module's doc: the shares normalised, capped by max_repeat)."""
    weights = np.asarray(shares, dtype=np.float64)
    weights = weights / weights.sum()
    allowed = np.floor(np.asarray(blocks, dtype=np.float64) * np.asarray(max_repeat, dtype=np.float64))
    reach = allowed / weights  # the epoch at which each source has given all it may
    capped = int(np.argmin(reach))
    total = int(np.floor(reach[capped] + 1e-9))
    counts = _largest_remainders(total, weights)
    while np.any(counts > allowed):  # a remainder rounded up past a limit: one block shorter
        total -= 1
        counts = _largest_remainders(total, weights)
    for name, count in zip(names, counts.tolist(), strict=True):
        if count == 0:
            raise ConfigError(
                f"source {name}'s share gives it no block in an epoch of {total:,} blocks: fix: raise its share, "
                f"or the max_repeat of {names[capped]}, which caps the epoch"
            )
    return MixturePlan(
        names=tuple(names),
        shares=tuple(float(w) for w in weights),
        max_repeat=tuple(float(r) for r in max_repeat),
        source_blocks=tuple(int(b) for b in blocks),
        epoch_blocks=tuple(int(c) for c in counts),
        capped_by=names[capped],
    )


class Mixture(SourceBlocks):
    """The training blocks of a mixture: the sources' blocks, and the order of each epoch (the module's doc)."""

    def __init__(
        self, names: Sequence[str], sources: Sequence[BlockSource], mixture_plan: MixturePlan, seed: int
    ) -> None:
        super().__init__(names, sources)
        assert mixture_plan.source_blocks == tuple(len(s) for s in sources)
        self.plan, self.seed = mixture_plan, seed
        self.blocks_per_epoch = mixture_plan.blocks_per_epoch
        self._order: tuple[int, np.ndarray] | None = None
        self._read: tuple[DataPosition, np.ndarray] | None = None

    def _blocks_of(self, number: int, epoch: int) -> np.ndarray:
        """Source `number`'s local blocks in this epoch: whole shuffles of its blocks, then part of one more."""
        size, count = len(self.sources[number]), self.plan.epoch_blocks[number]
        rng = np.random.default_rng([self.seed, epoch, number])
        passes = [rng.permutation(size) for _ in range(-(-count // size))]
        return np.concatenate(passes)[:count]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global block indices of epoch `epoch`, in training order (a function of (seed, epoch) alone)."""
        cached = self._order
        if cached is not None and cached[0] == epoch:
            return cached[1]
        counts = self.plan.epoch_blocks
        phase = np.random.default_rng([self.seed, epoch, len(counts)]).random(len(counts))
        times = np.concatenate([(np.arange(n) + phase[i]) / n for i, n in enumerate(counts)])
        blocks = np.concatenate([self.offsets[i] + self._blocks_of(i, epoch) for i in range(len(counts))])
        order = blocks[np.argsort(times, kind="stable")]
        self._order = (epoch, order)
        return order

    def blocks_read(self, position: DataPosition) -> np.ndarray:
        """Blocks of each source read from the start of the run to `position` (its whole epochs, then the
        consumed part of this one); counted on from the last position asked when it lies behind this one."""
        counts = np.zeros(len(self.sources), dtype=np.int64)
        start = 0
        last = self._read
        if last is not None and last[0].epoch == position.epoch and last[0].consumed <= position.consumed:
            counts, start = last[1].copy(), last[0].consumed
        else:
            counts += position.epoch * np.asarray(self.plan.epoch_blocks, dtype=np.int64)
        consumed = min(position.consumed, self.blocks_per_epoch)
        read = self.epoch_order(position.epoch)[start:consumed]
        counts += np.bincount(self.source_of(read), minlength=len(self.sources))
        self._read = (position, counts)
        return counts

    def shares_read(self, position: DataPosition) -> dict[str, float]:
        """The realised token share of each source over the blocks read to `position` (blocks hold equal tokens)."""
        counts = self.blocks_read(position)
        total = int(counts.sum())
        return {name: (int(c) / total if total else 0.0) for name, c in zip(self.names, counts, strict=True)}


@dataclass(frozen=True)
class OpenedMixture:
    train: Mixture
    validation: SourceBlocks | None  # the sources that hold validation blocks, each evaluated on its own
    fingerprint: (
        str  # the sources' content, shares and repeats: a resume onto another mixture resets the data
    )


def _check_exists(name: str, data: Any) -> None:
    if data.dataset == EMBEDDED or data.dataset.startswith("s3://") or not documents.is_local(data):
        return
    if not Path(data.dataset).expanduser().exists():
        raise ConfigError(
            f"source {name}: dataset {data.dataset} does not exist: fix: correct its path in --sources (data.sources "
            "of a run file), or set the source's local_dataset to false for a hub dataset"
        )


def _source_blocks(
    name: str, dataset: token_shards.PreparedDataset, split: str, seq_length: int
) -> BlockSource:
    # A preference step's rows are the pairs of one source, not a mixture's blocks.
    if dataset.data_format == chat.PREFERENCE:
        raise ConfigError(
            f"source {name} holds preference pairs, which --sources does not mix: train on them alone with "
            "--dataset (one file or dir of pairs)"
        )
    blocks = dataset.blocks(split, seq_length)
    if len(blocks) == 0:
        fix = (
            "raise its validation_fraction, or set it to 0 to skip its validation"
            if split == "validation"
            else "give it more data, use a smaller --seq_length, or leave it out of --sources"
        )
        raise ConfigError(
            f"source {name} has {dataset.tokens(split):,} {split} tokens, fewer than one block of {seq_length}: "
            f"fix: {fix}"
        )
    return blocks


def open_sources(
    data: Any,
    explicit: frozenset[str],
    tokenizer: Any,
    tokenizer_name: str,
    run_first: Callable[[Callable[[], Any]], Any],
    seq_length: int,
    seed: int,
    from_run_file: Callable[[str], str | None] = lambda flag: None,
) -> OpenedMixture:
    """Each source prepared (or opened) as a single dataset is, keyed by its own options (`from_run_file`: as
    block_cache.prepared takes it); the mixture of their train blocks with its plan said in one line; their
    validation blocks."""
    specs = data.source_specs
    for spec in specs:
        _check_exists(spec.name, data.for_source(spec))
    names, train, validation, contents = [], [], [], []
    for spec in specs:
        # The source's own keys join the explicit ones: a prepared dir refuses what it would ignore.
        own = {key for key, _ in spec.options}
        dataset = block_cache.prepared(
            data.for_source(spec), explicit | own, tokenizer, tokenizer_name, run_first,
            lambda flag, own=own: None if flag in own else from_run_file(flag),
        )  # fmt: skip
        names.append(spec.name)
        train.append(_source_blocks(spec.name, dataset, "train", seq_length))
        if dataset.holds_validation:
            validation.append((spec.name, _source_blocks(spec.name, dataset, "validation", seq_length)))
        contents.append(token_shards.content_fingerprint(dataset.manifest))
    mixture_plan = plan(
        names, [s.share for s in specs], [s.max_repeat for s in specs], [len(b) for b in train]
    )
    print0(mixture_plan.describe())
    val = SourceBlocks([n for n, _ in validation], [b for _, b in validation]) if validation else None
    # Normalised shares: 7 and 3 are the mixture of 0.7 and 0.3, and a resume onto either continues it.
    identity = list(zip(names, contents, mixture_plan.shares, mixture_plan.max_repeat, strict=True))
    fingerprint = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
    return OpenedMixture(Mixture(names, train, mixture_plan, seed), val, fingerprint)
