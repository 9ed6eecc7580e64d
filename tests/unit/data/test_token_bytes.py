"""The byte-length table of bits-per-byte against decoding: the tokens of a text sum to the UTF-8 length of what
they decode to in context, for the shipped byte-level BPE (with an added special and a non-special token) and a
Llama-2-style SentencePiece BPE with byte fallback, both built here offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.data import token_bytes
from support.small_tokenizers import TEXTS, byte_level_tokenizer, sentencepiece_tokenizer


def decoded_bytes(tokenizer, context: list[int], ids: list[int]) -> int:
    """The bytes `ids` add to the text after `context` (a SentencePiece decoder strips a text's first space)."""

    def length(tokens: list[int]) -> int:
        return len(tokenizer.decode(tokens, skip_special_tokens=True).encode("utf-8"))

    return length(context + ids) - length(context)


@pytest.mark.parametrize("build", [byte_level_tokenizer, sentencepiece_tokenizer])
def test_a_texts_tokens_sum_to_the_bytes_they_decode_to(tmp_path: Path, build) -> None:
    tokenizer = build(tmp_path / "tok")
    table = token_bytes.byte_lengths(tokenizer)
    assert table.shape == (len(tokenizer),)
    context = tokenizer.encode("Once", add_special_tokens=False)
    for text in TEXTS:
        ids = tokenizer.encode(" " + text, add_special_tokens=False)
        assert int(table[ids].sum()) == decoded_bytes(tokenizer, context, ids), (text, ids)
    # Each character of 2 to 4 bytes: the case where one token is a fragment of a character (byte-level) or a
    # byte of its own (fallback), which decoding token by token would count as a 3-byte replacement mark.
    ids = tokenizer.encode("🦊日é", add_special_tokens=False)
    assert int(table[ids].sum()) == decoded_bytes(tokenizer, context, ids) >= len("🦊日é".encode())


def test_special_tokens_stand_for_no_text_and_added_tokens_for_their_own(tmp_path: Path) -> None:
    tokenizer = byte_level_tokenizer(tmp_path / "tok")
    table = token_bytes.byte_lengths(tokenizer)
    marker, think = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<think>"])
    assert table[tokenizer.eos_token_id] == table[marker] == 0
    assert table[think] == len("<think>") == 7
    ids = tokenizer.encode("<|im_start|>a <think> fox<|endoftext|>", add_special_tokens=False)
    assert marker in ids and think in ids and tokenizer.eos_token_id in ids
    assert int(table[ids].sum()) == len(b"a <think> fox") == decoded_bytes(tokenizer, [], ids)


def test_the_sentencepiece_vocabulary_has_byte_fallback_tokens_of_one_byte(tmp_path: Path) -> None:
    tokenizer = sentencepiece_tokenizer(tmp_path / "tok")
    table = token_bytes.byte_lengths(tokenizer)
    ids = tokenizer.encode("🦊", add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    fallback = [i for i, piece in zip(ids, pieces, strict=True) if piece.startswith("<0x")]
    assert len(fallback) == 4, pieces  # the fox is 4 bytes the vocabulary has only as bytes
    assert all(table[i] == 1 for i in fallback)
    assert table[tokenizer.convert_tokens_to_ids("▁")] == 1  # the mark is the space it decodes to
