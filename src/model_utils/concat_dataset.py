"""Documents -> tokens -> fixed-length blocks, and the sharded, resumable order in which ranks read them.

Packing: every document is tokenized (fast tokenizer, batched `datasets.map`), gets an EOS appended, and the
documents are concatenated into one stream cut into blocks of `seq_length` tokens. Nothing is padded and no
document is truncated; only the stream's final partial block is dropped. Packed blocks are cached on disk, keyed
by the dataset's fingerprint, the tokenizer and the block length, so a second run neither tokenizes nor packs.

Order: each epoch is a permutation of the blocks, seeded by (seed, epoch). An optimizer step consumes one global
batch (micro batch x accumulation x data-parallel ranks) of consecutive permuted blocks; rank r reads its own
contiguous slice of it, so ranks never overlap. The position (epoch, blocks consumed) is all resume needs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model_utils.errors import ConfigError, first_line
from model_utils.log import print0

PACKING_VERSION = 1  # bump when the packed layout changes, so stale caches are not reused
_TEXT_SUFFIXES = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
EMBEDDED = "embedded"


# --- loading documents ----------------------------------------------------------------------------------


def _datasets() -> Any:
    """The datasets module, with its progress bars off: they flood log files; we print one summary line."""
    import datasets

    datasets.disable_progress_bars()
    return datasets


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _files_builder(path: Path) -> tuple[str, list[str]]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in _TEXT_SUFFIXES)
    suffixes = {p.suffix for p in files}
    if not files or not suffixes <= set(_TEXT_SUFFIXES):
        raise ConfigError(
            f"dataset {path} is not a save_to_disk dir nor .txt/.json/.jsonl/.parquet/.csv data: "
            "point --dataset at one of those"
        )
    builders = {_TEXT_SUFFIXES[s] for s in suffixes}
    if len(builders) > 1:
        raise ConfigError(
            f"dataset dir {path} mixes file types {sorted(suffixes)}: keep one kind per dataset"
        )
    return builders.pop(), [str(p) for p in files]


def _load_local(path: Path, split: str) -> Any:
    datasets = _datasets()

    if path.is_dir() and _is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(
                    f"dataset {path} has no split {split!r} (splits: {', '.join(loaded)}): "
                    "pass --train_split/--validation_split"
                )
            return loaded[split]
        if split != "train":
            raise ConfigError(f"dataset {path} is a single split, so split {split!r} does not exist")
        return loaded
    builder, files = _files_builder(path)
    if split != "train":
        raise ConfigError(f"local files {path} form a single split, so split {split!r} does not exist")
    if all(Path(f).stat().st_size == 0 for f in files):
        raise ConfigError(f"dataset {path} is empty: point --dataset at files with documents")
    # Plain text: blank-line separated paragraphs are the documents (one line each would cut sentences apart).
    extra = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **extra)
    except (ValueError, TypeError, StopIteration, datasets.exceptions.DatasetGenerationError) as e:
        reason = first_line(e)
        raise ConfigError(
            f"could not read dataset {path} as {builder} ({reason}): check the file format"
        ) from None


def _load_hub(name: str, config_name: str | None, split: str) -> Any:
    datasets = _datasets()

    try:
        return datasets.load_dataset(name, config_name, split=split)
    except (ValueError, OSError, ConnectionError) as e:  # datasets wraps network and missing-split errors so
        reason = first_line(e)
        raise ConfigError(
            f"could not load dataset {name!r} split {split!r} from the Hugging Face hub ({reason}): "
            "check the name and network access, or give a local path with --local_dataset true"
        ) from None


def is_local_dataset(data: Any) -> bool:
    """--dataset names a local path (--local_dataset true, or it exists, or it looks like a path), not a hub
    dataset. ('embedded' and s3:// URIs are decided before this.)"""
    if data.local_dataset is not None:
        return bool(data.local_dataset)
    return Path(data.dataset).expanduser().exists() or data.dataset.startswith(("/", ".", "~"))


def load_split(data: Any, split: str) -> Any:
    """One split of the configured dataset, as a `datasets.Dataset`."""
    from model_utils.assets import CORPUS_PATH

    name = data.dataset
    if name == EMBEDDED:
        return _load_local(CORPUS_PATH, split) if split == "train" else _missing_split(name, split)
    path = Path(name).expanduser()
    if is_local_dataset(data):
        if not path.exists():
            raise ConfigError(
                f"dataset path {name} does not exist: check --dataset (or --local_dataset false for a hub name)"
            )
        return _load_local(path, split)
    return _load_hub(name, data.dataset_config_name, split)


def _missing_split(name: str, split: str) -> Any:
    raise ConfigError(f"dataset {name!r} has only a train split, so {split!r} does not exist")


def load_documents(data: Any, seed: int) -> tuple[Any, Any | None]:
    """(train documents, validation documents or None), split at the document level so nothing leaks."""
    train = load_split(data, data.train_split)
    if data.text_field not in train.column_names:
        raise ConfigError(
            f"dataset {data.dataset} has no column {data.text_field!r} (columns: {', '.join(train.column_names)}): "
            "pass --text_field"
        )
    if len(train) == 0:
        raise ConfigError(
            f"dataset {data.dataset} split {data.train_split!r} is empty: point --dataset at data"
        )
    if data.validation_split is not None:
        return train, load_split(data, data.validation_split)
    if data.validation_fraction == 0:
        return train, None
    if len(train) < 2:
        raise ConfigError(
            f"dataset {data.dataset} has one document, too few to hold out validation: pass --validation_fraction 0"
        )
    parts = train.train_test_split(test_size=data.validation_fraction, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


# --- tokenizing and packing -----------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer: Any) -> str:
    payload = tokenizer.backend_tokenizer.to_str() + f"|eos={tokenizer.eos_token_id}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PackKey:
    dataset_fingerprint: str
    tokenizer_fingerprint: str
    text_field: str
    seq_length: int
    version: int = PACKING_VERSION

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


def tokenize(docs: Any, tokenizer: Any, text_field: str, cache_dir: Path) -> Any:
    """Batched fast tokenization with EOS appended; the result is cached by datasets under cache_dir."""
    eos = tokenizer.eos_token_id

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        texts = [t if isinstance(t, str) else "" for t in batch[text_field]]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": [[*x, eos] for x in ids]}

    cache_file = (
        cache_dir / f"tokens-{docs._fingerprint}-{tokenizer_fingerprint(tokenizer)}-{text_field}.arrow"
    )
    return docs.map(
        encode,
        batched=True,
        batch_size=1000,
        remove_columns=docs.column_names,
        cache_file_name=str(cache_file),
        desc="tokenizing",
    )


def pack(token_docs: Any, seq_length: int) -> np.ndarray:
    """Concatenate every document's tokens and cut the stream into [n_blocks, seq_length]."""
    import pyarrow.compute as pc

    column = token_docs.data.column("input_ids")
    flat = [pc.list_flatten(chunk).to_numpy(zero_copy_only=False) for chunk in column.chunks]
    stream = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
    n_blocks = len(stream) // seq_length
    return stream[: n_blocks * seq_length].astype(np.int32).reshape(n_blocks, seq_length)


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def packed_blocks(
    docs: Any, tokenizer: Any, text_field: str, seq_length: int, cache_dir: Path, role: str
) -> np.ndarray:
    """The packed blocks of `docs`, from the cache when a previous run built them."""
    key = PackKey(docs._fingerprint, tokenizer_fingerprint(tokenizer), text_field, seq_length)
    path = cache_dir / f"blocks-{key.digest()}.npy"
    if path.is_file():
        blocks = np.load(path, mmap_mode="r")
        print0(f"Data ({role}): {len(blocks)} blocks of {seq_length} tokens from cache {path}")
        return blocks
    cache_dir.mkdir(parents=True, exist_ok=True)
    blocks = pack(tokenize(docs, tokenizer, text_field, cache_dir), seq_length)
    _atomic_save(path, blocks)
    print0(f"Data ({role}): tokenized {len(docs)} documents into {len(blocks)} blocks of {seq_length} tokens")
    return np.load(path, mmap_mode="r")


# --- the sharded, resumable order -----------------------------------------------------------------------


@dataclass
class DataPosition:
    """Where training is in the data: the epoch and how many of its permuted blocks were consumed."""

    epoch: int = 0
    consumed: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> DataPosition:
        return cls(epoch=int(d["epoch"]), consumed=int(d["consumed"]))


class BlockSampler:
    """Which blocks each data-parallel rank reads for each optimizer step."""

    def __init__(
        self, num_blocks: int, micro_batch: int, grad_accum: int, dp_rank: int, dp_world: int, seed: int
    ) -> None:
        assert 0 <= dp_rank < dp_world
        self.num_blocks = num_blocks
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.per_rank = micro_batch * grad_accum
        self.global_batch = self.per_rank * dp_world
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_blocks // self.global_batch

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks))
        return self._order[1]

    def _normalise(self, pos: DataPosition) -> DataPosition:
        # A global batch that would run past the end starts the next epoch (the tail is seen next epoch).
        if pos.consumed + self.global_batch > self.num_blocks:
            return DataPosition(pos.epoch + 1, 0)
        return pos

    def step_indices(self, pos: DataPosition) -> np.ndarray:
        """This rank's block indices for the step at `pos`, shaped [grad_accum, micro_batch]."""
        pos = self._normalise(pos)
        start = pos.consumed + self.dp_rank * self.per_rank
        mine = self.order(pos.epoch)[start : start + self.per_rank]
        return mine.reshape(self.grad_accum, self.micro_batch)

    def advance(self, pos: DataPosition) -> DataPosition:
        pos = self._normalise(pos)
        return DataPosition(pos.epoch, pos.consumed + self.global_batch)


def validation_indices(
    num_blocks: int, batches: int, micro_batch: int, dp_rank: int, dp_world: int
) -> np.ndarray:
    """A fixed, disjoint slice of validation blocks per rank, [n_batches, micro_batch], same every evaluation."""
    per_rank = min(batches * micro_batch, num_blocks // dp_world) // micro_batch * micro_batch
    idx = np.arange(dp_rank, per_rank * dp_world, dp_world)
    return idx.reshape(-1, micro_batch)
