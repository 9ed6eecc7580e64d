"""--sample_prompts read and tokenized: text lines, JSONL rows (text, "prompt", a conversation) and a JSON list
(the run file's list); a conversation rendered with the chat template and its generation prompt; and bad input
(a missing file, no prompts, an empty prompt, a bad row, a conversation without a template, a prompt too long)
in one line that says how to fix it. The samples they give: tests/e2e/test_validation.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_utils.assets import CHAT_TEMPLATE_PATH, TOKENIZER_DIR
from model_utils.data import prompts
from model_utils.errors import ConfigError

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_a_text_file_holds_one_prompt_per_non_blank_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("Once upon a time\n\n  \nThe capital of France is\n")
    assert prompts.read(str(path)) == ["Once upon a time", "The capital of France is"]


def test_jsonl_rows_and_a_json_list_hold_texts_and_conversations(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = ["Once upon a time", {"prompt": "The capital of France is"}, {"messages": CONVERSATION}]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n\n")
    expected = ["Once upon a time", "The capital of France is", CONVERSATION]
    assert prompts.read(str(path)) == expected
    assert prompts.read(json.dumps(rows)) == expected  # the run file's list, as the config keeps it


@pytest.mark.parametrize(
    ("content", "suffix", "expected"),
    [
        (None, ".txt", "cannot read it (No such file or directory): fix: name a prompts file"),
        ("\n  \n", ".txt", "holds no prompts: fix: give at least one prompt, or drop --sample_prompts"),
        ("", ".jsonl", "holds no prompts: fix:"),
        ('"ok"\n{"prompt": "  "}\n', ".jsonl", ":2: the prompt is empty: fix:"),
        ('{"prompt": "a", "messages": []}\n', ".jsonl", ':1: a row holds "prompt" (text) or "messages"'),
        (
            '{"messages": [{"role": "robot", "content": "x"}]}\n',
            ".jsonl",
            ":1: the conversation message 0 has",
        ),
        ("not json\n", ".jsonl", ":1: not JSON (Expecting value at column 1): fix: one prompt per line"),
        ("42\n", ".jsonl", ":1: int is not a prompt: fix: give text or a list of messages"),
    ],
)
def test_bad_prompt_files_are_one_line(
    tmp_path: Path, content: str | None, suffix: str, expected: str
) -> None:
    path = tmp_path / f"prompts{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as err:
        prompts.read(str(path))
    message = str(err.value)
    assert message.startswith(f"--sample_prompts {path}") and expected in message and "\n" not in message


def test_an_empty_list_is_no_prompts() -> None:
    with pytest.raises(ConfigError, match=r"^--sample_prompts holds no prompts: fix"):
        prompts.read("[]")
    with pytest.raises(ConfigError, match=r"^--sample_prompts: not a JSON list of prompts"):
        prompts.read("[oops")


def test_text_is_tokenized_as_training_text_and_a_conversation_through_the_template(tokenizer) -> None:
    template = CHAT_TEMPLATE_PATH.read_text()
    text, conversation = prompts.encode(["Once upon a time", CONVERSATION], tokenizer, template, 64, 8)
    assert text == prompts.Prompt("Once upon a time", tuple(tokenizer.encode("Once upon a time")))
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    assert conversation.text == rendered and conversation.text.rstrip().endswith("Assistant:")
    assert conversation.ids == tuple(tokenizer.encode(rendered, add_special_tokens=False))


def test_a_conversation_needs_a_template_and_a_prompt_must_leave_room_for_its_tokens(tokenizer) -> None:
    with pytest.raises(
        ConfigError, match=r"prompt 2 is a conversation and the tokenizer has no chat template: fix"
    ):
        prompts.encode(["hi", CONVERSATION], tokenizer, None, 64, 8)
    with pytest.raises(
        ConfigError, match=r"prompt 1 has 4 tokens, and with --sample_max_new_tokens 29 it must fit"
    ):
        prompts.encode(["Once upon a time"], tokenizer, None, 32, 29)
    assert prompts.encode(["Once upon a time"], tokenizer, None, 32, 28)[0].ids
