"""Prompt/completion and conversation rows as token ids with one flag byte per token: whether it is trained on
(TRAINED: the completion; the assistant turns) and whether a document starts there (DOC_START).

Conversations are rendered as transformers' own chat-template renderer (the one `apply_chat_template` calls, with
the tokenizer's special tokens) renders them, in its sandboxed environment with two exact shortcuts (Renderer),
and tokenized like `apply_chat_template(tokenize=True)` does (the rendered text, no special tokens added), in
batches. The assistant tokens are found the way `return_assistant_tokens_mask` finds them: from
character spans of the rendered text, each marking the tokens from the one holding its first character to the
one holding its last. The spans come from the template's `{% generation %}` tags where it has them; else from
rendering the conversation up to each assistant turn (with the generation prompt) and through it: what the turn
adds to the full rendering is its span. Turns a template renders differently once later turns follow (stock
Qwen3 drops an earlier turn's `<think>` block) are aligned on the part of the turn the full rendering keeps, so
the span is always a span of the text that is trained on. Prompt/completion rows follow TRL's SFTTrainer: the
prompt's tokens are those the prompt alone and prompt + completion share (completion_only_loss).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model_utils.errors import ConfigError, first_line

TRAINED = 1
DOC_START = 2
ROLES = ("system", "user", "assistant", "tool")
PROMPT_COMPLETION = "prompt_completion"
MESSAGES = "messages"
TEXT = "text"
# Rows with nothing to train on (no assistant turn) are counted; more than this share of a unit's stops it.
UNTRAINED_LIMIT = 0.01
TOKENIZER_TEMPLATE = "the tokenizer's"
# The plan's "chat" entry's variables for the template (apply_chat_template's **kwargs), present only when given,
# so a preparation without them keeps its record (and its cache key) as it was.
TEMPLATE_KWARGS = "template_kwargs"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_tags(template: str) -> bool:
    return bool(_GENERATION_TAG.search(template))


def options(data: Any, tokenizer: Any, data_format: str) -> dict[str, Any]:
    """The plan record's "chat" entry: the template (its text, so every worker and a re-run use the same), where
    it came from, the special tokens it may name, and --train_on_prompt."""
    if data.chat_template is not None:
        path = Path(data.chat_template).expanduser()
        try:
            template = path.read_text()
        except OSError as e:
            raise ConfigError(
                f"--chat_template {data.chat_template}: cannot read it ({e.strerror}): pass a Jinja template file"
            ) from None
        source = str(path)
    else:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named variants: the default one, as apply_chat_template picks
            template = template.get("default")
        source = TOKENIZER_TEMPLATE
        if not template and data_format == MESSAGES:
            raise ConfigError(
                f"{data.dataset} holds conversations and the tokenizer has no chat template: pass "
                "--chat_template FILE (a Jinja chat template)"
            )
    special = {
        k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items() if isinstance(v, str)
    }
    chat = {
        "template": template or None,
        "template_from": source,
        "template_fingerprint": hashlib.sha256((template or "").encode()).hexdigest()[:16],
        "special_tokens": special,
        "train_on_prompt": bool(data.train_on_prompt),
    }
    if data.enable_thinking is not None:
        if "enable_thinking" not in (template or ""):  # it would change nothing: not a silent no-op
            raise ConfigError(
                f"--enable_thinking {str(data.enable_thinking).lower()}: the chat template ({source}) does not read "
                "enable_thinking (Qwen3's does): drop it, or pass --chat_template with a template that reads it"
            )
        chat[TEMPLATE_KWARGS] = {"enable_thinking": bool(data.enable_thinking)}
    return chat


# --- rendering ------------------------------------------------------------------------------------------


class RenderError(Exception):
    """A row the template cannot render, or renders inconsistently: the message says which turn and why."""


_DICT_ATTRIBUTES = frozenset(dir(dict))


def _quickened(environment: Any) -> None:
    """Two shortcuts for the sandboxed environment a renderer compiles its template in, each giving exactly what
    jinja's own method gives (jinja2.sandbox), where most of a render's time went:
    - `is_safe_attribute` decided once per (type, attribute name): for ImmutableSandboxedEnvironment the check
      depends on nothing else (is_internal_attribute, modifies_known_mutable look at the type and the name);
    - `getattr` on a plain dict (`message.role`) looks the key up at once: jinja tries the attribute first, and a
      dict instance has only its class's attributes, so any other name reaches the key lookup anyway.
    Another environment class is left as it is."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if type(environment) is not ImmutableSandboxedEnvironment:
        return
    check, sandboxed_getattr, undefined = (
        environment.is_safe_attribute,
        environment.getattr,
        environment.undefined,
    )
    decided: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = decided.get(key)
        if safe is None:
            safe = decided[key] = check(obj, attr, value)
        return safe

    def getattr_(obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return undefined(obj=obj, name=attribute)
        return sandboxed_getattr(obj, attribute)

    environment.is_safe_attribute = is_safe_attribute
    environment.getattr = getattr_


class Renderer:
    """One chat template with fixed variables (the special tokens, enable_thinking), rendering prefixes of a
    conversation as transformers' render_jinja_template renders each: the template compiled in its sandboxed
    environment (an overlay of it, with _quickened's shortcuts), the messages and variables made plain data, the
    reasoning fields aliased. The messages are converted once per conversation, not once per prefix."""

    def __init__(self, template: str, variables: dict[str, Any]) -> None:
        from transformers.utils import chat_template_utils

        environment = chat_template_utils._compile_jinja_template(template).environment.overlay()
        _quickened(environment)
        self.compiled = environment.from_string(template)
        self.variables = chat_template_utils._plain_template_data(variables)
        self._plain = chat_template_utils._plain_template_data
        self._aliased = chat_template_utils._alias_reasoning_fields

    def render(self, messages: list[dict], prefixes: list[tuple[int, bool]]) -> list[str]:
        """The first n messages rendered, with the generation prompt or not, for each (n, generation_prompt)."""
        chat = self._aliased(self._plain(messages))
        return [
            self.compiled.render(
                messages=chat[:n], tools=None, documents=None, add_generation_prompt=prompt, **self.variables
            )
            for n, prompt in prefixes
        ]


_renderers: dict[str, Renderer] = {}


def renderer(template: str, variables: dict[str, Any]) -> Renderer:
    """One per process, template and variables: compiling a template takes a while, a worker renders many rows."""
    key = hashlib.sha256(f"{template}|{json.dumps(variables, sort_keys=True)}".encode()).hexdigest()
    if key not in _renderers:
        _renderers[key] = Renderer(template, variables)
    return _renderers[key]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def _aligned(partial: str, full: str) -> int:
    """Where `partial` (the conversation rendered up to a point) ends in `full`: after their common prefix, the
    longest tail of `partial` that `full` continues there. A template may render a message differently once
    later ones follow: stock Qwen3 drops an earlier assistant turn's <think> block, Mistral's puts the system
    message in the last user turn only; the part of `partial` that `full` keeps is what counts."""
    common = _common_prefix(partial, full)
    tail = partial[common:]
    for skip in range(len(tail)):
        if full.startswith(tail[skip:], common):
            return common + len(tail) - skip
    return common


def assistant_spans(
    template: str, messages: list[dict], special_tokens: dict[str, str], **kwargs: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered, and the character spans of its assistant turns (see the module's doc)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = _clean(messages)
    options = {**special_tokens, **kwargs}
    try:
        if has_generation_tags(template):
            rendered, indices = render_jinja_template(
                conversations=[messages], chat_template=template, return_assistant_tokens_mask=True, **options
            )
            return rendered[0], [tuple(span) for span in indices[0]]
        assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        last = assistant[-1:] == [len(messages) - 1]  # then its "through" rendering is the full one
        throughs = [(i + 1, False) for i in (assistant[:-1] if last else assistant)]
        prompts = [(i, True) for i in assistant if i > 0]
        rendered = renderer(template, options).render(messages, [(len(messages), False), *throughs, *prompts])
        full = rendered[0]
        throughs_text = rendered[1 : 1 + len(throughs)] + rendered[:1] * last
        prompts_text = rendered[1 + len(throughs) :]
    except Exception as e:  # jinja's errors and the template's own raise_exception
        raise RenderError(f"the chat template cannot render it ({first_line(e)})") from None
    if assistant and assistant[0] == 0:
        prompts_text.insert(0, "")
    spans = []
    for turn, prompt, through in zip(assistant, prompts_text, throughs_text, strict=True):
        start = _aligned(prompt, full)
        end = _aligned(through, full)
        if end <= start:
            raise RenderError(
                f"the chat template renders assistant message {turn} as nothing beyond its generation prompt, so "
                "it has no token to train on"
            )
        spans.append((start, end))
    return full, spans


# --- checking rows --------------------------------------------------------------------------------------


def check_messages(messages: Any) -> str | None:
    """What is wrong with a conversation, or None."""
    if not isinstance(messages, list) or not messages:
        return f"is {type(messages).__name__ if messages != [] else 'an empty list'}, not a list of messages"
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {k} is {type(message).__name__}, not a mapping with 'role' and 'content'"
        role = message.get("role")
        if role is None:
            return f"message {k} has no 'role'"
        if role not in ROLES:
            return f"message {k} has the unknown role {role!r} (roles: {', '.join(ROLES)})"
        content = message.get("content")
        tool_call = role == "assistant" and message.get("tool_calls")
        if content is None and not tool_call:
            return f"message {k} ({role}) has no 'content'"
        if content is not None and not isinstance(content, str):
            return f"message {k} ({role}) has {type(content).__name__} content, not text"
        if role == "assistant" and not tool_call and not content.strip():
            return f"message {k} is an empty assistant turn"
    return None


def _check_prompt_completion(row: dict) -> str | None:
    prompt, completion = row.get("prompt"), row.get("completion")
    for name, value in (("prompt", prompt), ("completion", completion)):
        if isinstance(value, list):
            wrong = check_messages(value)
            if wrong:
                return f"'{name}' {wrong}"
        elif not isinstance(value, str):
            return f"'{name}' is {type(value).__name__}, not text or a list of messages"
    if isinstance(prompt, list) != isinstance(completion, list):
        return "'prompt' and 'completion' must both be text or both be lists of messages"
    if isinstance(completion, str) and not completion.strip():
        return "'completion' is empty"
    return None


# --- encoding -------------------------------------------------------------------------------------------


@dataclass
class Encoded:
    """A batch of documents: token ids and flag bytes of the same lengths, and how many have nothing trained."""

    ids: list[np.ndarray]
    flags: list[np.ndarray]
    untrained: int


def _common_ids(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ChatEncoder:
    """Rows of one format into documents, for one tokenizer and the plan's "chat" options."""

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: str, data_format: str, chat: dict) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.eos = eos_id
        self.dtype = np.dtype(dtype)
        self.format = data_format
        self.template = chat["template"]
        self.template_from = chat["template_from"]
        # What the template is rendered with: the special tokens and the plan's variables (enable_thinking).
        self.template_vars = {**chat["special_tokens"], **chat.get(TEMPLATE_KWARGS, {})}
        self.eos_text = chat["special_tokens"].get("eos_token", "")
        self.train_on_prompt = chat["train_on_prompt"]

    def encode(self, rows: list[Any], where: Callable[[int], str]) -> Encoded:
        """`where(i)` names row i of the batch (file and row) for a bad row's one line."""
        texts: list[str] = []
        spans: list[list[tuple[int, int]]] = []
        prompt_ids: list[list[int] | None] = []
        for i, row in enumerate(rows):
            wrong = check_messages(row) if self.format == MESSAGES else _check_prompt_completion(row)
            if wrong:
                raise ConfigError(f"{where(i)}: {wrong}: fix the row (docs/data.md lists what a row holds)")
            try:
                text, row_spans, prompt = self._render(row)
            except RenderError as e:
                raise ConfigError(
                    f"{where(i)}: {e}: fix the row, or pass --chat_template with a template that renders it "
                    f"(the template used: {self.template_from})"
                ) from None
            texts.append(text)
            spans.append(row_spans)
            prompt_ids.append(prompt)
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        ids, flags, untrained = [], [], 0
        for row, encoding, row_spans, prompt in zip(rows, encodings, spans, prompt_ids, strict=True):
            tokens = list(encoding.ids)
            mask = np.zeros(len(tokens) + 1, np.uint8)
            if self.train_on_prompt:
                mask[:] = TRAINED
            elif prompt is not None:  # prompt/completion: after the tokens the prompt alone shares
                mask[_common_ids(prompt, tokens) :] = TRAINED
            else:
                for start, end in row_spans:
                    first = encoding.char_to_token(start)
                    last = encoding.char_to_token(end - 1)
                    if first is None:
                        continue
                    mask[first : (last + 1 if last is not None else len(tokens))] = TRAINED
            if tokens and tokens[-1] == self.eos:
                mask = mask[:-1]  # the template ended the document with EOS itself
            else:
                # EOS ends every document, as in the text stream. Plain prompt/completion: trained (TRL appends it
                # to the completion); a template ends its turns itself, so after a rendered one it is not.
                plain = self.format == PROMPT_COMPLETION and isinstance(row["prompt"], str)
                mask[-1] = TRAINED if self.train_on_prompt or plain else 0
                tokens = [*tokens, self.eos]
            mask[0] = DOC_START  # nothing in the document predicts its first token
            if not (mask[1:] & TRAINED).any():
                untrained += 1
            ids.append(np.asarray(tokens, dtype=self.dtype))
            flags.append(mask)
        return Encoded(ids, flags, untrained)

    def _render(self, row: Any) -> tuple[str, list[tuple[int, int]], list[int] | None]:
        """The text to tokenize, the assistant spans (conversations), the prompt's ids (prompt/completion)."""
        if self.format == MESSAGES:
            if self.train_on_prompt:
                return self._full(row), [], None
            text, spans = assistant_spans(self.template, row, self.template_vars)
            return text, spans, None
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str):
            eos = self.eos_text
            full = prompt + completion
            # TRL appends the EOS to the completion (tokenized with it); ours is appended as an id below.
            if eos and full.endswith(eos):
                full = full[: -len(eos)]
            return full, [], self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if self.template is None:
            raise RenderError("its prompt is a conversation and the tokenizer has no chat template")
        try:
            prompt_text = renderer(self.template, self.template_vars).render(
                _clean(prompt), [(len(prompt), True)]
            )[0]
        except Exception as e:
            raise RenderError(f"the chat template cannot render its prompt ({first_line(e)})") from None
        return (
            self._full(prompt + completion),
            [],
            self.tokenizer.encode(prompt_text, add_special_tokens=False).ids,
        )

    def _full(self, messages: list[dict]) -> str:
        if self.template is None:
            raise RenderError("it is a conversation and the tokenizer has no chat template")
        try:
            return renderer(self.template, self.template_vars).render(
                _clean(messages), [(len(messages), False)]
            )[0]
        except Exception as e:
            raise RenderError(f"the chat template cannot render it ({first_line(e)})") from None


def render_prompt(template: str, messages: list[dict], special_tokens: dict[str, Any]) -> str:
    """A conversation as a prompt: rendered with the template's generation prompt, for the model to answer
    (`--sample_prompts`); a ConfigError when the template cannot render it."""
    special = {k: v for k, v in special_tokens.items() if isinstance(v, str)}
    try:
        return renderer(template, special).render(_clean(messages), [(len(messages), True)])[0]
    except Exception as e:
        raise ConfigError(
            f"the chat template cannot render the conversation prompt ({first_line(e)}): fix the prompt, or pass "
            "--chat_template with a template that renders it"
        ) from None


def _clean(messages: list[dict]) -> list[dict]:
    """Without the keys whose value is None, as apply_chat_template drops them (templates render "None")."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


# --- which format ---------------------------------------------------------------------------------------


def decide_format(data: Any, first: dict | None) -> tuple[str, Any, str | None]:
    """The format of the rows, the field(s) read for it, and with --data_format auto a line saying what was
    decided from the columns of the first row (`first`; None: plain text files)."""
    if data.data_format == MESSAGES:
        return MESSAGES, data.text_field if data.text_field != "text" else "messages", None
    if data.data_format == PROMPT_COMPLETION:
        return PROMPT_COMPLETION, ("prompt", "completion"), None
    if data.data_format == TEXT or first is None:
        return TEXT, data.text_field, None
    value = first.get(data.text_field)
    if isinstance(value, str):
        return TEXT, data.text_field, None
    for field in (data.text_field, "messages"):
        if isinstance(first.get(field), list):
            return MESSAGES, field, f"column {field!r} holds conversations: --data_format messages (auto)"
    if "prompt" in first and "completion" in first:
        return (
            PROMPT_COMPLETION,
            ("prompt", "completion"),
            "columns 'prompt' and 'completion': --data_format prompt_completion (auto)",
        )
    return TEXT, data.text_field, None
