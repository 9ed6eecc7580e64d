"""Chat tokenizers and conversations for the data tests, built offline: the embedded tiny-qwen3 BPE with each
model family's special tokens added and its stock chat template (tests/support/chat_templates: Qwen3, Llama-3.1
and Gemma-3 as TRL vendors them, Mistral-7B-Instruct-v0.3 as published; the kit's shipped tiny one), saved like
a hub tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from model_utils.assets import CHAT_TEMPLATE_PATH, TOKENIZER_DIR

TEMPLATES = Path(__file__).parent / "chat_templates"


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # the stock template's file
    tagged: str  # the same rendering with {% generation %} tags (TRL's training template where TRL has one)
    special: tuple[str, ...]
    bos: str | None
    eos: str


FAMILIES = {
    "qwen3": Family(
        "qwen3", "qwen3.jinja", "qwen3_tagged.jinja", ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>"
    ),
    "llama3_1": Family(
        "llama3_1",
        "llama3_1.jinja",
        "llama3_1_training.jinja",
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "mistral": Family(
        "mistral",
        "mistral_v0_3.jinja",
        "mistral_v0_3_training.jinja",
        ("<s>", "</s>", "[INST]", "[/INST]"),
        "<s>",
        "</s>",
    ),
    "gemma3": Family(
        "gemma3",
        "gemma3.jinja",
        "gemma3_training.jinja",
        ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        "<bos>",
        "<eos>",
    ),
    # the shipped tiny template (a path: template_text reads it where it is), for the tiny tokenizer as it is
    "tiny": Family("tiny", str(CHAT_TEMPLATE_PATH), "tiny_tagged.jinja", (), None, "<|endoftext|>"),
}


def template_text(name: str) -> str:
    return (TEMPLATES / name).read_text()  # an absolute path is read where it is


def chat_tokenizer(family: Family, out: Path, template: str | None = None):
    """The tiny BPE with the family's special tokens and chat template, saved in `out` and loaded back."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=family.eos,
        bos_token=family.bos,
        pad_token=family.eos,
        model_max_length=1_000_000_000,
    )
    tokenizer.chat_template = template_text(template or family.template)
    tokenizer.save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


def conversations(family: str) -> list[list[dict]]:
    """Single- and multi-turn conversations, with and without a system message (Gemma-3 and Mistral fold it into
    a user turn), with reasoning for Qwen3 (in the content and as reasoning_content), whitespace to trim."""
    chats = [
        [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}],
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name a red fruit."},
            {"role": "assistant", "content": "  A cherry.  "},
        ],
        [
            {"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "One, two, three."},
            {"role": "user", "content": "And back?"},
            {"role": "assistant", "content": "Three, two, one."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You are welcome.\nBye."},
        ],
        [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi there, how can I help?"},
            {"role": "user", "content": "Tell me a word for happy."},
            {"role": "assistant", "content": "Glad."},
        ],
    ]
    if family == "qwen3":
        chats += [
            [
                {"role": "user", "content": "Is nine a square?"},
                {"role": "assistant", "content": "Yes.", "reasoning_content": "Three times three is nine."},
            ],
            [
                {"role": "user", "content": "Is seven odd?"},
                {"role": "assistant", "content": "<think>\nSeven is not divisible by two.\n</think>\n\nYes."},
                {"role": "user", "content": "Is eight?"},
                {"role": "assistant", "content": "No.", "reasoning_content": "Eight is two times four."},
            ],
            [
                {"role": "user", "content": "Pick a color."},
                {"role": "assistant", "content": "Blue.", "reasoning_content": "Any will do."},
                {"role": "user", "content": "Another."},
                {"role": "assistant", "content": "Green."},
            ],
        ]
    return chats


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
