"""`--sample_prompts`: the fixed prompts a run generates samples from (loop/observers/samples.py), read and
tokenized once when the run is resolved, so that a missing file, an empty one or a bad row is one line before any
rank trains.

The setting is a file or a JSON list (the run file's `report.sample_prompts` list arrives as one). A `.jsonl` or
`.json` file holds one prompt per line: a JSON string, `{"prompt": text}` or `{"messages": [...]}`; any other file
holds one text prompt per non-blank line. A conversation is rendered with the run's chat template (--chat_template,
else the tokenizer's) and its generation prompt, so the model answers as the assistant it is trained to be; a
text prompt is tokenized as the training text is, without special tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils.data import chat
from model_utils.errors import ConfigError

FLAG = "--sample_prompts"
JSON_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Prompt:
    text: str  # what the model reads, as text (a conversation: rendered by the chat template)
    ids: tuple[int, ...]


def read(setting: str) -> list[str | list[dict]]:
    """The prompts as given: texts and conversations (lists of messages)."""
    if setting.lstrip().startswith("["):
        try:
            rows = json.loads(setting)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{FLAG}: not a JSON list of prompts ({e}): fix: give a file or a list"
            ) from None
        return [_prompt(row, f"{FLAG}: prompt {k + 1}") for k, row in enumerate(rows)] or _none(FLAG)
    path = Path(setting).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ConfigError(
            f"{FLAG} {setting}: cannot read it ({why}): fix: name a prompts file (.jsonl rows or text lines)"
        ) from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix not in JSON_SUFFIXES:
        return [line for _, line in lines] or _none(f"{FLAG} {setting}")
    prompts = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{FLAG} {setting}:{n}: not JSON ({e.msg} at column {e.colno}): fix: one prompt per line"
            ) from None
        prompts.append(_prompt(row, f"{FLAG} {setting}:{n}"))
    return prompts or _none(f"{FLAG} {setting}")


def _none(where: str) -> Any:
    raise ConfigError(f"{where} holds no prompts: fix: give at least one prompt, or drop {FLAG}")


def _prompt(row: Any, where: str) -> str | list[dict]:
    value = row
    if isinstance(row, dict):
        keys = set(row) & {"prompt", "messages"}
        if len(keys) != 1:
            raise ConfigError(
                f'{where}: a row holds "prompt" (text) or "messages" (a conversation): fix the row'
            )
        value = row[keys.pop()]
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: the prompt is empty: fix: give it text, or remove it")
        return value
    if isinstance(value, list):
        wrong = chat.check_messages(value)
        if wrong:
            raise ConfigError(f"{where}: the conversation {wrong}: fix the row")
        return value
    raise ConfigError(
        f"{where}: {type(value).__name__} is not a prompt: fix: give text or a list of messages"
    )


def encode(
    prompts: list[str | list[dict]], tokenizer: Any, template: str | None, longest: int, new_tokens: int
) -> tuple[Prompt, ...]:
    """The prompts as the model reads them. `template`: the chat template for conversations; `longest`: the
    tokens a prompt and its `new_tokens` may take together (the run's sequence length)."""
    encoded = []
    for k, prompt in enumerate(prompts, 1):
        if isinstance(prompt, list):
            if not template:
                raise ConfigError(
                    f"{FLAG}: prompt {k} is a conversation and the tokenizer has no chat template: fix: pass "
                    "--chat_template FILE, or give it as text"
                )
            text = chat.render_prompt(tokenizer, template, prompt)
        else:
            text = prompt
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not ids or len(ids) + new_tokens > longest:
            raise ConfigError(
                f"{FLAG}: prompt {k} has {len(ids)} tokens, and with --sample_max_new_tokens {new_tokens} it "
                f"must fit the sequence length {longest}: fix: shorten it or generate fewer tokens"
            )
        encoded.append(Prompt(text, ids))
    return tuple(encoded)
