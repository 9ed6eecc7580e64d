"""How many UTF-8 bytes of text each token id stands for: the denominator of bits-per-byte, the validation
measure that does not depend on the tokenizer (observe/metrics.py).

Built once per run from a fast tokenizer's vocabulary, without decoding token by token (a byte-level token may be
a fragment of a character, which decodes alone to a 3-byte replacement mark). The sum over a text's tokens is the
length of the text they decode to in context:

- byte-level BPE (GPT-2, Llama 3, Qwen): each character of a token's string stands for one byte;
- SentencePiece-style vocabularies (Llama 2, Mistral, Gemma): `<0xNN>` byte-fallback tokens are one byte, the
  word-boundary mark is the space it decodes to, the rest their UTF-8 length;
- special tokens (EOS, chat markers) stand for no text: 0, as decoding with skip_special_tokens gives.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_METASPACE = "\u2581"  # SentencePiece's word-boundary mark, decoded to a space


def byte_level_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE writes the bytes 0-255 as (GPT-2's bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [256 + n for n in range(256 - len(printable))]
    return frozenset(chr(c) for c in [*printable, *shifted])


def _decoders(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [d for inner in spec.get("decoders", []) for d in _decoders(inner)]
    return [spec]


def byte_lengths(tokenizer: Any) -> np.ndarray:
    """The UTF-8 byte count of each token id of a fast tokenizer (len(tokenizer) entries, int64)."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    decoders = _decoders(backend.get("decoder"))
    byte_level = any(d.get("type") == "ByteLevel" for d in decoders)
    space_marks = {d["replacement"] for d in decoders if d.get("type") == "Metaspace" and "replacement" in d}
    space_marks |= {
        d["pattern"].get("String")
        for d in decoders
        if d.get("type") == "Replace" and d.get("content") == " " and isinstance(d.get("pattern"), dict)
    }
    space_marks.discard(None)
    alphabet = byte_level_alphabet()
    added = tokenizer.added_tokens_decoder  # id -> AddedToken, special or not
    special = set(tokenizer.all_special_ids) | {
        token_id for token_id, token in added.items() if token.special
    }
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    lengths = np.zeros(len(tokens), dtype=np.int64)
    for token_id, token in enumerate(tokens):
        if token_id in special or token is None:
            continue
        if token_id in added:  # an added token is its literal text, never byte-level or SentencePiece-coded
            lengths[token_id] = len(added[token_id].content.encode("utf-8"))
        elif byte_level and all(ch in alphabet for ch in token):
            lengths[token_id] = len(token)
        elif _BYTE_FALLBACK.match(token):
            lengths[token_id] = 1
        else:
            for mark in space_marks:
                token = token.replace(mark, " ")
            lengths[token_id] = len(token.encode("utf-8"))
    return lengths
