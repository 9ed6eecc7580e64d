"""Which tokens hold given characters of a text, from its token ids alone, for the tokenizers whose tokens spell
their text byte for byte (byte-level BPE: Qwen, Llama 3, GPT-2), so the text is tokenized without offsets (about
a third of the tokenizer's time, measured on conversations).

Each id stands for a fixed number of the text's UTF-8 bytes (a vocabulary token one per character of its
byte-level string, an added token its literal's), so the tokens' cumulative byte counts place every byte. The
answer is `Encoding.char_to_token`'s where that is certain, and None (the caller asks the offsets) elsewhere:
- the counts must add up to the text's bytes (a prefix space, a stripping added token, a normalizer that changed
  the text: they do not) and the text must be as the normalizer leaves it (none, or NFC on NFC text);
- each character asked about must be ASCII and not a space: a character split across tokens belongs to several,
  and byte-level offsets leave a token's leading and trailing spaces out of it (`trim_offsets`).
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence

import numpy as np

from model_utils.data.token_bytes import byte_level_alphabet


class TokenSpans:
    """One tokenizer's byte count per id, or `usable` False where its tokens do not spell their text."""

    def __init__(self, tokenizer_json: str, tokenizer: object) -> None:
        spec = json.loads(tokenizer_json)
        normalizer = (spec.get("normalizer") or {}).get("type")
        self.nfc = normalizer == "NFC"
        self.usable = normalizer in (None, "NFC") and _byte_level(spec.get("pre_tokenizer"))
        self.lengths = np.zeros(0, np.int64)
        if not self.usable:
            return
        vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=False)
        added = tokenizer.get_added_tokens_decoder()
        self.lengths = np.zeros(max([*vocab.values(), *added, -1]) + 1, np.int64)
        if not set("".join(vocab)) <= byte_level_alphabet():
            self.usable = False  # a token that is not byte-level: this vocabulary is not what it seemed
            return
        self.lengths[np.fromiter(vocab.values(), np.int64, len(vocab))] = np.fromiter(
            map(len, vocab), np.int64, len(vocab)
        )  # one byte per character of a byte-level token's string
        for token_id, token in added.items():
            self.lengths[token_id] = len(token.content.encode("utf-8"))

    def tokens_at(self, text: str, ids: Sequence[int], positions: list[int]) -> list[int] | None:
        """The index of the token holding each character position of `text` (tokenized to `ids`), or None where
        the offsets must answer."""
        if not self.usable or not len(ids):
            return None
        ascii_text = text.isascii()
        if not ascii_text and self.nfc and not unicodedata.is_normalized("NFC", text):
            return None
        for p in positions:
            ch = text[p]
            if ch == " " or not ch.isascii():
                return None
        ends = np.cumsum(self.lengths[np.asarray(ids)])
        if ascii_text:
            at, total = positions, len(text)
        else:  # each position's byte offset, the text encoded once, piece by piece
            offsets, total, last = {}, 0, 0
            for p in sorted(set(positions)):
                total += len(text[last:p].encode("utf-8"))
                offsets[p], last = total, p
            total += len(text[last:].encode("utf-8"))
            at = [offsets[p] for p in positions]
        if ends[-1] != total:
            return None
        return np.searchsorted(ends, at, side="right").tolist()


def _byte_level(pre_tokenizer: dict | None) -> bool:
    """A ByteLevel pre-tokenizer (alone or in a sequence) that adds no prefix space."""
    if not pre_tokenizer:
        return False
    steps = (
        pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    )
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    return bool(byte_level) and not any(s.get("add_prefix_space") for s in byte_level)
