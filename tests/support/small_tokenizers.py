"""Small tokenizers built offline for the data tests: the shipped byte-level BPE with added tokens, and a
Llama-2-style SentencePiece BPE with byte fallback; and texts that exercise them."""

from __future__ import annotations

import json
from pathlib import Path

from model_utils.assets import TOKENIZER_DIR

# Characters of 1 to 4 UTF-8 bytes, newlines and runs of spaces: byte-level tokens that are fragments of a
# character, and byte-fallback tokens for what a small SentencePiece vocabulary lacks.
TEXTS = [
    "Tom and Ben built a nest out of blocks.",
    "Café crème, naïve façade — 日本語のテキスト, emoji 🦊🚀 and ∑ x² ≥ 0.\n\n  Indented   line\ttab.",
    "ünïcödé 😀😀 ÆØÅ",
]


def byte_level_tokenizer(out: Path):
    """The shipped tiny-qwen3 BPE with a special chat marker and a non-special added token."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False)])
    backend.add_tokens([AddedToken("<think>", special=False, normalized=False)])  # as Qwen3's
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


def sentencepiece_tokenizer(out: Path):
    """A Llama-2-style BPE (word-boundary marks, byte fallback, the decoder's Replace/ByteFallback/Fuse/Strip),
    trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=["é", "ï"])
    trained.train_from_iterator(["Tom and Ben built a nest out of blocks. It was very round."] * 20, trainer)
    # The 256 byte tokens are ordinary vocabulary entries, as in Llama 2's (a trainer would make them special).
    learned = json.loads(trained.to_str())["model"]
    vocab = {**learned["vocab"], **{f"<0x{b:02X}>": len(learned["vocab"]) + b for b in range(256)}}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.add_special_tokens(specials)
    backend.normalizer, backend.pre_tokenizer = trained.normalizer, trained.pre_tokenizer
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))
