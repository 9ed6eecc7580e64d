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
        return self.tokens_at_many([text], [np.asarray(ids)], [positions])[0]

    def tokens_at_many(
        self, texts: list[str], ids: list[np.ndarray], positions: list[list[int]]
    ) -> list[list[int] | None]:
        """tokens_at for many texts at once: the byte counts of all their tokens added up in one pass, and every
        position looked up in one search (a text's own calls cost more than its tokens, for short ones)."""
        if not self.usable:
            return [None] * len(texts)
        sizes = np.fromiter(map(len, ids), np.int64, len(ids))
        if not len(sizes) or not sizes.sum():
            return [None] * len(texts)
        ends = np.cumsum(self.lengths[np.concatenate(ids)])  # every token's byte end, texts one after another
        first_token = np.cumsum(sizes) - sizes
        # each text's first byte and its bytes as its ids spell them, in the texts one after another
        before = np.where(first_token > 0, ends[np.maximum(first_token - 1, 0)], 0)
        spelled_bytes = np.where(sizes > 0, ends[np.maximum(first_token + sizes - 1, 0)], before) - before
        queries: list[int] = []  # byte positions in all the texts one after another
        asked: list[tuple[int, int] | None] = []
        totals = np.zeros(len(texts), np.int64)
        for k, (text, at) in enumerate(zip(texts, positions, strict=True)):
            placed = self._bytes_at(text, at) if sizes[k] else None
            if placed is None:
                asked.append(None)
                continue
            byte_at, totals[k] = placed
            base = int(before[k])
            asked.append((len(queries), len(byte_at)))
            queries += [base + b for b in byte_at]
        spelled = spelled_bytes == totals  # the ids spell each text byte for byte
        found = np.searchsorted(ends, queries, side="right").tolist() if queries else []
        out: list[list[int] | None] = []
        for k, where in enumerate(asked):
            if where is None or not spelled[k]:
                out.append(None)
                continue
            offset, count = where
            first = int(first_token[k])
            out.append([t - first for t in found[offset : offset + count]])
        return out

    def _bytes_at(self, text: str, positions: list[int]) -> tuple[list[int], int] | None:
        """Each position's byte offset in `text` and the text's bytes, or None where the ids cannot answer."""
        ascii_text = text.isascii()
        if not ascii_text and self.nfc and not unicodedata.is_normalized("NFC", text):
            return None
        for p in positions:
            ch = text[p]
            if ch == " " or not ch.isascii():
                return None
        if ascii_text:
            return positions, len(text)
        # each position's byte offset, the text encoded once, piece by piece
        offsets, total, last = {}, 0, 0
        for p in sorted(set(positions)):
            total += len(text[last:p].encode("utf-8"))
            offsets[p], last = total, p
        total += len(text[last:].encode("utf-8"))
        return [offsets[p] for p in positions], total


def _byte_level(pre_tokenizer: dict | None) -> bool:
    """A ByteLevel pre-tokenizer (alone or in a sequence) that adds no prefix space."""
    if not pre_tokenizer:
        return False
    steps = (
        pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    )
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    return bool(byte_level) and not any(s.get("add_prefix_space") for s in byte_level)
