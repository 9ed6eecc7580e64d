"""Tokens placed from their ids alone against the tokenizer's own offsets (`char_to_token`): equal wherever an
answer is given, given for the ASCII characters of byte-level BPE text, withheld where it could differ (a space,
a character split across tokens, non-NFC text, a prefix space, a SentencePiece vocabulary)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from model_utils.data.token_spans import TokenSpans
from support.small_tokenizers import TEXTS, byte_level_tokenizer, sentencepiece_tokenizer

CHAT = "<|im_start|>user\nWho are you?<|endoftext|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA fox 🦊.  Ok\n"


def _placed(backend, text: str) -> tuple[list[int | None] | None, list[int | None]]:
    """Ours for every character of `text` (None: withheld), and char_to_token's."""
    spans = TokenSpans(backend.to_str(), backend)
    encoding = backend.encode(text, add_special_tokens=False)
    positions = list(range(len(text)))
    ours = [spans.tokens_at(text, encoding.ids, [p]) for p in positions]
    return [o[0] if o else None for o in ours], [encoding.char_to_token(p) for p in positions]


@pytest.mark.parametrize("trim_offsets", [False, True])
def test_byte_level_tokens_are_placed_as_the_offsets_place_them(tmp_path: Path, trim_offsets: bool) -> None:
    """With GPT-2's post-processor (trim_offsets) a token's spaces are in no token's offsets."""
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_str(byte_level_tokenizer(tmp_path / "tok").backend_tokenizer.to_str())
    if trim_offsets:
        backend.post_processor = processors.ByteLevel(trim_offsets=True)
    rng = random.Random(0)
    texts = [*TEXTS, CHAT, " ".join(rng.choice(TEXTS[0].split()) for _ in range(200))]
    answered = 0
    for text in texts:
        ours, offsets = _placed(backend, text)
        for p, (mine, theirs) in enumerate(zip(ours, offsets, strict=True)):
            if mine is not None:
                assert mine == theirs, (text, p)
                answered += 1
            else:
                assert text[p] == " " or not text[p].isascii(), (text, p)
    assert answered > 0.7 * sum(map(len, texts))


def test_where_the_ids_do_not_spell_the_text_the_offsets_answer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    tokenizer = byte_level_tokenizer(tmp_path / "tok")
    backend = tokenizer.backend_tokenizer
    assert TokenSpans(backend.to_str(), backend).usable
    # A normalizer that changes the text, NFC on a text not in NFC, a prefix space: the counts do not add up, or
    # the tokenizer is not one whose ids spell the text.
    nfc = Tokenizer.from_str(backend.to_str())
    nfc.normalizer = normalizers.NFC()
    decomposed = "Cafe\u0301 au lait"
    ids = nfc.encode(decomposed, add_special_tokens=False).ids
    assert TokenSpans(nfc.to_str(), nfc).tokens_at(decomposed, ids, [0]) is None
    assert TokenSpans(nfc.to_str(), nfc).tokens_at("Cafe", nfc.encode("Cafe").ids, [0]) == [0]
    lowered = Tokenizer.from_str(backend.to_str())
    lowered.normalizer = normalizers.Lowercase()
    prefixed = Tokenizer.from_str(backend.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    sentencepiece = sentencepiece_tokenizer(tmp_path / "sp").backend_tokenizer
    for other in (lowered, prefixed, sentencepiece):
        assert not TokenSpans(other.to_str(), other).usable
    # Counts that do not add up (here an id list that is not the text's) are withheld, not guessed.
    spans = TokenSpans(backend.to_str(), backend)
    ids = backend.encode("Tom and Ben", add_special_tokens=False).ids
    assert spans.tokens_at("Tom and Ben", ids, [0, 10]) is not None
    assert spans.tokens_at("Tom and Bens", ids, [0]) is None
