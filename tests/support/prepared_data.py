"""Small datasets for the data tests: JSON lines writers, the token ids a text must become (with the
`tokenizer` fixture of tests/unit/conftest.py), a one-process `prepared()` and `dskit prepare-data`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dskit import prepare_data
from model_utils.config.arguments import DataArgs
from model_utils.data import block_cache


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def ids_of(tokenizer, texts: list[str]) -> list[int]:
    eos = tokenizer.eos_token_id
    return [t for d in texts for t in [*tokenizer(d, add_special_tokens=False)["input_ids"], eos]]


def here(fn):
    return fn()


def run_data(data: DataArgs, tokenizer, explicit: frozenset[str] = frozenset()):
    return block_cache.prepared(data, explicit, tokenizer, "tiny-qwen3", here)


def stream(dataset, split: str) -> list[int]:
    blocks = dataset.blocks(split, 1)  # one-token blocks: the whole token stream, in order
    return blocks[np.arange(len(blocks))].reshape(-1).tolist()


DOCS = [
    "The cat sat on the mat.",
    "Seven plus five is twelve. " * 40,  # longer than a block: must not be truncated
    "A short one.",
    "Zoë and José went to the market to buy bread and milk.",
]


def corpus(tmp_path: Path, n: int = 400) -> Path:
    texts = [
        f"Document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 7) for i in range(n)
    ]
    return write_jsonl(tmp_path / "corpus.jsonl", texts)


def prep(out: Path, *args: str) -> int:
    return prepare_data.main([str(out), *args])
