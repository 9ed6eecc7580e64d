"""token_shards.content_fingerprint, what a checkpoint records of its data (launch.json) so that a resume on other
data is refused: a function of the training tokens, never of where the dataset lives. Apart from
test_token_shards.py, whose format tests this one does not need."""

from __future__ import annotations

import shutil
from pathlib import Path

from model_utils.config.arguments import DataArgs
from model_utils.data import token_shards
from support.prepared_data import DOCS, run_data, write_jsonl


def _prepared(tmp_path: Path, tokenizer, name: str, texts: list[str], **data: object):
    (tmp_path / name).mkdir(parents=True)
    source = write_jsonl(tmp_path / name / "d.jsonl", texts)
    args = DataArgs(dataset=str(source), data_cache_dir=str(tmp_path / name / "cache"), **data)  # type: ignore[arg-type]
    return run_data(args, tokenizer)


def test_the_same_content_anywhere_has_one_fingerprint_and_other_content_another(
    tmp_path: Path, tokenizer
) -> None:
    texts = [f"document {i}: " + DOCS[i % len(DOCS)] for i in range(60)]
    here = _prepared(tmp_path, tokenizer, "here", texts)
    fingerprint = token_shards.content_fingerprint(here.manifest)
    assert len(fingerprint) == 16
    # The same file prepared from another path, and the prepared dir moved elsewhere: the same data.
    elsewhere = _prepared(tmp_path, tokenizer, "elsewhere/deeper", texts)
    assert token_shards.content_fingerprint(elsewhere.manifest) == fingerprint
    moved = shutil.copytree(here.path, tmp_path / "node-local" / "copy")
    assert token_shards.content_fingerprint(token_shards.open_prepared(moved).manifest) == fingerprint
    # One document changed, or the same documents in another order, or another held-out share: other blocks.
    edited = _prepared(tmp_path, tokenizer, "edited", [*texts[:-1], "A different last document."])
    reordered = _prepared(tmp_path, tokenizer, "reordered", texts[::-1])
    split = _prepared(tmp_path, tokenizer, "split", texts, validation_fraction=0.2)
    others = {token_shards.content_fingerprint(d.manifest) for d in (edited, reordered, split)}
    assert len(others) == 3 and fingerprint not in others


def test_the_validation_documents_alone_do_not_change_it(tmp_path: Path, tokenizer) -> None:
    """The data position counts training blocks: a separate validation set leaves them as they were."""
    texts = [f"document {i}: " + DOCS[i % len(DOCS)] for i in range(30)]
    plain = _prepared(tmp_path, tokenizer, "plain", texts, validation_fraction=0)
    held = write_jsonl(tmp_path / "valid.jsonl", ["A held out document.", "And another one."])
    with_validation = _prepared(tmp_path, tokenizer, "with", texts, validation_dataset=str(held))
    assert token_shards.content_fingerprint(plain.manifest) == token_shards.content_fingerprint(
        with_validation.manifest
    )
