"""The embedded default assets (corpus + tokenizer) for the "tiny-qwen3" preset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import embedded_assets as embedded

TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded.TOKENIZER_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def documents() -> list[str]:
    with embedded.CORPUS_PATH.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_regenerated_assets_are_byte_identical_to_committed(tmp_path: Path) -> None:
    # A separate process, as a maintainer would run it: also proves the build does not depend on
    # per-process state such as string hash randomisation.
    subprocess.run(
        [sys.executable, str(embedded.__file__), "--out-dir", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh_corpus = tmp_path / embedded.CORPUS_PATH.name
    assert fresh_corpus.read_bytes() == embedded.CORPUS_PATH.read_bytes()

    fresh_tok = tmp_path / embedded.TOKENIZER_DIR.name
    committed = sorted(p.name for p in embedded.TOKENIZER_DIR.iterdir())
    assert sorted(p.name for p in fresh_tok.iterdir()) == committed
    for name in committed:
        assert (fresh_tok / name).read_bytes() == (embedded.TOKENIZER_DIR / name).read_bytes(), name


def test_write_corpus_in_process_matches_committed(tmp_path: Path) -> None:
    out = embedded.write_corpus(tmp_path / "corpus.jsonl")
    assert out.read_bytes() == embedded.CORPUS_PATH.read_bytes()


def test_generate_corpus_depends_on_seed_and_size() -> None:
    small = embedded.generate_corpus(seed=0, target_bytes=20_000)
    assert small == embedded.generate_corpus(seed=0, target_bytes=20_000)
    assert small != embedded.generate_corpus(seed=1, target_bytes=20_000)
    assert 20_000 <= sum(len(d.encode("utf-8")) for d in small) < 200_000


def test_corpus_file_format() -> None:
    raw = embedded.CORPUS_PATH.read_bytes()
    assert b"\r" not in raw
    assert raw.endswith(b"\n")
    for line in raw.decode("utf-8").split("\n")[:-1]:
        record = json.loads(line)
        assert list(record) == ["text"]
        assert record["text"].strip()
        assert line == json.dumps(record, ensure_ascii=False, sort_keys=True)
    assert "Zoë".encode() in raw  # non-ASCII stays literal (ensure_ascii=False)


def test_corpus_size_and_lengths(tokenizer: PreTrainedTokenizerBase, documents: list[str]) -> None:
    assert len(documents) >= 1000
    assert embedded.CORPUS_PATH.stat().st_size <= 4 * 1024 * 1024
    words = [len(d.split()) for d in documents]
    assert sum(50 <= w <= 400 for w in words) >= 0.6 * len(documents)

    lengths = [len(ids) for ids in tokenizer(documents)["input_ids"]]
    long_docs = [n for n in lengths if n > 2000]
    assert len(long_docs) >= 0.02 * len(documents), "tests of no-truncation need long documents"


def test_long_document_is_not_truncated(tokenizer: PreTrainedTokenizerBase, documents: list[str]) -> None:
    longest = max(documents, key=len)
    ids = tokenizer(longest)["input_ids"]
    assert len(ids) > 2000
    assert tokenizer.decode(ids) == longest
    assert tokenizer.model_max_length >= 1_000_000


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time, there was a little girl named Lily.",
        "  leading spaces,\ttabs\nand newlines\n\n  ",
        "Seven plus five is twelve.\n7 + 5 = 12",
        "Zoë and José ate crème brûlée — 🍰 日本語 Ελληνικά",
        "",
    ],
)
def test_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_round_trip_corpus_sample(tokenizer: PreTrainedTokenizerBase, documents: list[str]) -> None:
    for text in documents[:200]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.eos_token == embedded.EOS_TOKEN
    assert tokenizer.eos_token_id is not None
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.bos_token is None
    assert tokenizer.bos_token_id is None
    # EOS written in text is recognised as the single special token (documents are joined with it).
    assert tokenizer(embedded.EOS_TOKEN)["input_ids"] == [tokenizer.eos_token_id]


def test_no_special_tokens_added(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "The dog ran to the park."
    ids = tokenizer(text)["input_ids"]
    assert ids == tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids[:1]) == "The"  # first token is text, not a BOS


def test_loads_offline_as_fast_tokenizer(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fresh = AutoTokenizer.from_pretrained(str(embedded.TOKENIZER_DIR), local_files_only=True)
    assert fresh.is_fast
    assert len(fresh) == embedded.VOCAB_SIZE == 2048
    assert fresh.vocab_size == 2048
    assert fresh.get_vocab() == tokenizer.get_vocab()


def test_tokenizer_dir_is_small() -> None:
    names = {p.name for p in embedded.TOKENIZER_DIR.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= names <= TOKENIZER_FILES
    assert sum(p.stat().st_size for p in embedded.TOKENIZER_DIR.iterdir()) < 1024 * 1024


def test_build_tokenizer_is_deterministic_and_sized() -> None:
    texts = embedded.generate_corpus(seed=3, target_bytes=300_000)
    first = embedded.build_tokenizer(texts, vocab_size=512)
    second = embedded.build_tokenizer(texts, vocab_size=512)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == 512
    assert first.convert_tokens_to_ids(embedded.EOS_TOKEN) == first.eos_token_id == first.pad_token_id
