"""Packing (no token lost, EOS placement, no padding) and the sharded, resumable order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dskit.embedded_assets import TOKENIZER_DIR
from model_utils import concat_dataset
from model_utils.arguments import DataArgs
from model_utils.concat_dataset import (
    BlockSampler,
    DataPosition,
    load_documents,
    packed_blocks,
    validation_indices,
)
from model_utils.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


DOCS = [
    "The cat sat on the mat.",
    "Seven plus five is twelve. " * 40,  # longer than a block: must not be truncated
    "A short one.",
    "Zoë and José went to the market to buy bread and milk.",
]


def test_packing_loses_no_token_and_puts_eos_after_every_document(tmp_path: Path, tokenizer) -> None:
    docs, _ = load_documents(
        DataArgs(dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)), validation_fraction=0), 0
    )
    seq = 16
    blocks = packed_blocks(docs, tokenizer, "text", seq, tmp_path / "cache", "train")
    expected = [
        t
        for d in DOCS
        for t in [*tokenizer(d, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    ]
    assert blocks.shape == (len(expected) // seq, seq)
    # The blocks are the exact token stream, in document order, cut only at the end.
    assert blocks.reshape(-1).tolist() == expected[: blocks.size]
    assert len(expected) - blocks.size < seq  # only the final partial block is dropped
    eos_positions = [i for i, t in enumerate(expected) if t == tokenizer.eos_token_id]
    assert len(eos_positions) == len(DOCS)  # one EOS per document; no padding tokens anywhere
    assert tokenizer.decode(expected[: eos_positions[0]]) == DOCS[0]


def test_second_run_reads_the_cache_without_tokenizing(tmp_path: Path, tokenizer, monkeypatch) -> None:
    data = DataArgs(dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)), validation_fraction=0)
    docs, _ = load_documents(data, 0)
    first = np.array(packed_blocks(docs, tokenizer, "text", 8, tmp_path / "cache", "train"))

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(concat_dataset, "tokenize", no_tokenizing)
    docs, _ = load_documents(data, 0)
    assert np.array_equal(packed_blocks(docs, tokenizer, "text", 8, tmp_path / "cache", "train"), first)
    with pytest.raises(AssertionError, match="tokenized again"):  # a new block length is a new cache entry
        packed_blocks(docs, tokenizer, "text", 9, tmp_path / "cache", "train")


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "saved", "dir"])
def test_local_dataset_formats(tmp_path: Path, kind: str) -> None:
    import datasets

    texts = ["first document", "second document", "third"]
    ds = datasets.Dataset.from_dict({"text": texts})
    if kind == "txt":
        path = tmp_path / "d.txt"
        path.write_text("\n\n".join(texts) + "\n")  # blank-line separated paragraphs are the documents
    elif kind == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", texts)
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif kind == "saved":
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds, "validation": ds.select([0])}).save_to_disk(str(path))
    else:
        path = tmp_path / "files"
        path.mkdir()
        write_jsonl(path / "a.jsonl", texts[:2])
        write_jsonl(path / "b.jsonl", texts[2:])
    train, val = load_documents(DataArgs(dataset=str(path), validation_fraction=0), 0)
    assert sorted(t.strip() for t in train["text"]) == sorted(texts)
    assert val is None
    if kind == "saved":
        _, val = load_documents(DataArgs(dataset=str(path), validation_split="validation"), 0)
        assert val["text"] == ["first document"]


def test_validation_is_held_out_at_document_level(tmp_path: Path) -> None:
    texts = [f"document number {i}" for i in range(100)]
    train, val = load_documents(
        DataArgs(dataset=str(write_jsonl(tmp_path / "d.jsonl", texts)), validation_fraction=0.1), 3
    )
    assert len(val) == 10 and len(train) == 90
    assert not set(train["text"]) & set(val["text"])
    _, again = load_documents(DataArgs(dataset=str(tmp_path / "d.jsonl"), validation_fraction=0.1), 3)
    assert again["text"] == val["text"]  # deterministic for a seed


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: DataArgs(dataset=str(p / "missing.jsonl")), "does not exist"),
        (
            lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", ["x"], field="body"))),
            "no column 'text'",
        ),
        (lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", []))), "is empty"),
        (lambda p: DataArgs(dataset=str(p)), "is not a save_to_disk dir nor"),
        (
            lambda p: DataArgs(dataset=str((p / "bad.jsonl").write_text("{oops\n") and p / "bad.jsonl")),
            "could not read",
        ),
        (
            lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", ["a", "b"])), validation_split="test"),
            "split",
        ),
        (lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", ["one"]))), "too few to hold out"),
    ],
)
def test_bad_datasets(tmp_path: Path, setup, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_documents(setup(tmp_path), 0)


def consumed_by_rank(
    sampler_args: dict, world: int, steps: int, start=None
) -> tuple[list[list[int]], DataPosition]:
    samplers = [BlockSampler(dp_rank=r, dp_world=world, **sampler_args) for r in range(world)]
    pos = start or DataPosition()
    seen: list[list[int]] = [[] for _ in range(world)]
    for _ in range(steps):
        for r, s in enumerate(samplers):
            seen[r] += s.step_indices(pos).reshape(-1).tolist()
        pos = samplers[0].advance(pos)
    return seen, pos


def test_shards_are_disjoint_and_cover_an_epoch() -> None:
    args = {"num_blocks": 103, "micro_batch": 2, "grad_accum": 3, "seed": 7}
    world = 4  # global batch 24, 4 steps per epoch, 7 blocks left for the next epoch's permutation
    seen, pos = consumed_by_rank(args, world, steps=4)
    flat = [i for rank in seen for i in rank]
    assert len(flat) == len(set(flat)) == 96  # disjoint across ranks (and nodes: ranks are global)
    assert pos == DataPosition(epoch=0, consumed=96)
    seen_next, pos_next = consumed_by_rank(args, world, steps=1, start=pos)
    assert pos_next == DataPosition(epoch=1, consumed=24)  # the partial global batch rolls to the next epoch
    # Each epoch is a full permutation: over epoch 1's first step the order differs from epoch 0's.
    assert seen_next[0] != seen[0][:6]


def test_order_is_deterministic_per_seed_and_epoch() -> None:
    s = BlockSampler(50, 2, 1, 0, 1, seed=1)
    assert np.array_equal(s.order(3), BlockSampler(50, 2, 1, 0, 1, seed=1).order(3))
    assert not np.array_equal(s.order(3), s.order(4))
    assert not np.array_equal(s.order(3), BlockSampler(50, 2, 1, 0, 1, seed=2).order(3))


def test_resume_position_continues_exactly() -> None:
    args = {"num_blocks": 200, "micro_batch": 2, "grad_accum": 2, "seed": 5}
    straight, _ = consumed_by_rank(args, 2, steps=30)
    first, pos = consumed_by_rank(args, 2, steps=13)
    restored = DataPosition.from_dict(json.loads(json.dumps(pos.to_dict())))  # as stored in a checkpoint
    second, _ = consumed_by_rank(args, 2, steps=17, start=restored)
    assert [a + b for a, b in zip(first, second, strict=True)] == straight


def test_validation_slices_are_disjoint_and_fixed() -> None:
    a = validation_indices(num_blocks=21, batches=3, micro_batch=2, dp_rank=0, dp_world=2)
    b = validation_indices(num_blocks=21, batches=3, micro_batch=2, dp_rank=1, dp_world=2)
    assert a.shape == b.shape == (3, 2)
    assert not set(a.reshape(-1)) & set(b.reshape(-1))
    small = validation_indices(num_blocks=5, batches=8, micro_batch=2, dp_rank=1, dp_world=2)
    assert small.shape == (1, 2) and small.max() < 5
