"""Prompt/completion and conversation rows as token ids with one flag byte per token: whether it is trained on
(TRAINED: the completion; the assistant turns) and whether a document starts there (DOC_START).

Conversations are rendered and tokenized by transformers' public `apply_chat_template`, many rows a call. Where
the template has `{% generation %}` tags, the assistant tokens are its `return_assistant_tokens_mask`. Else each
assistant turn is a span of the conversation's rendering: from where the conversation up to the turn, rendered
with the generation prompt, ends in it to where the conversation through the turn ends in it; its tokens are
those from the one holding its first character to the one holding its last, as `return_assistant_tokens_mask`
finds them. A template that renders a turn differently once more follow (stock Qwen3 drops an earlier turn's
`<think>` block, Mistral's moves the system message to the last user turn) is aligned on what the whole
rendering keeps (_aligned). Prompt/completion rows follow TRL's SFTTrainer: the prompt's tokens are those the
prompt alone and prompt + completion share (completion_only_loss).

Preference rows (a prompt, a chosen and a rejected answer; data/pairs.py reads them) are tokenized as TRL's
DPOTrainer does (_prepare_dataset): text rows as the tokenizer's __call__ with the EOS text appended to each answer
that lacks it, conversations by the template (the prompt with its generation prompt), an implicit prompt as TRL's
extract_prompt finds it; the answer starts where the prompt's ids and the prompt + answer's first differ (the
earlier of the chosen's and the rejected's). A pair is one document: the prompt + chosen ids followed by the prompt
+ rejected ids, DOC_START on the first token of each, TRAINED on the answers' tokens, no EOS added.
"""

from __future__ import annotations

import hashlib
import itertools
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
PREFERENCE = "preference"
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
    """A row the template cannot render, or renders with nothing to train on: the message says why."""


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
    if full.startswith(partial):  # most templates only append
        return len(partial)
    common = _common_prefix(partial, full)
    tail = partial[common:]
    if common == len(full):
        return common
    # The longest tail of `tail` that `full` continues with: one starting with full's next character.
    skip = tail.find(full[common])
    while skip != -1:
        if full.startswith(tail[skip:], common):
            return common + len(tail) - skip
        skip = tail.find(full[common], skip + 1)
    return common


def _nothing_to_train(turn: int) -> RenderError:
    return RenderError(
        f"the chat template renders assistant message {turn} as nothing beyond its generation prompt, so it has "
        "no token to train on"
    )


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
        if role == "assistant" and not tool_call and (not content or content.isspace()):
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


PAIR_FIELDS = ("prompt", "chosen", "rejected")
Pair = tuple[Any, Any, Any]  # prompt, chosen, rejected: all text or all lists of messages


def extract_prompt(chosen: Any, rejected: Any) -> Pair:
    """TRL's extract_prompt (trl/data_utils.py), for rows without a prompt: the prompt is the longest common
    prefix of the two (messages, or characters less a space that ends it), each answer the rest. As TRL's loop, when
    one is a prefix of the other the prompt stops one item short of the shorter."""
    n = min(len(chosen), len(rejected))
    at = next((i for i in range(n) if chosen[i] != rejected[i]), None)
    if at is None:
        at = n - 1
    elif at > 0 and chosen[at - 1] == " ":  # the space before the answer goes with it
        at -= 1
    return chosen[:at], chosen[at:], rejected[at:]


def _pair(row: dict) -> Pair | str:
    """A preference row's prompt, chosen and rejected answers (the prompt extracted where the row has none), or
    what is wrong with it."""
    names = [name for name in PAIR_FIELDS if name in row]
    for name in names:
        value = row[name]
        if isinstance(value, list):
            wrong = check_messages(value)
            if wrong:
                return f"'{name}' {wrong}"
        elif not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            return f"'{name}' is {kind}, not text or a list of messages"
    texts = [name for name in names if isinstance(row[name], str)]
    lists = [name for name in names if isinstance(row[name], list)]
    if texts and lists:
        return (
            f"'{texts[0]}' is text and '{lists[0]}' a list of messages: a pair's fields are all text or all lists "
            "of messages"
        )
    chosen, rejected = row["chosen"], row["rejected"]
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(answer, str) and not answer.strip():
            return f"'{name}' is empty"
    if chosen == rejected:
        return "'chosen' and 'rejected' are identical: there is nothing to prefer"
    if "prompt" in row:
        return row["prompt"], chosen, rejected
    prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if not prompt:
        return (
            "'chosen' and 'rejected' share no prompt (they differ from their first "
            f"{'message' if lists else 'character'}), and the row has no 'prompt'"
        )
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(answer, str) and not answer.strip():
            return f"'{name}' is empty past the prompt it shares with the other answer"
    return prompt, chosen, rejected


# --- encoding -------------------------------------------------------------------------------------------


@dataclass
class Encoded:
    """A batch of documents: token ids and flag bytes of the same lengths, how many have nothing trained, and
    which is the first of those (`where` names it; None: none)."""

    ids: list[np.ndarray]
    flags: list[np.ndarray]
    untrained: int
    first_untrained: str | None = None


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
        from transformers import PreTrainedTokenizerFast

        # transformers' tokenizer around the prepared one, for apply_chat_template; the source tokenizer's special
        # tokens reach the template as its variables (below), as its own special_tokens_map would pass them
        self.chat_tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        self.tokenizer = self.chat_tokenizer.backend_tokenizer
        self.eos = eos_id
        self.dtype = np.dtype(dtype)
        self.format = data_format
        self.template = chat["template"]
        self.template_from = chat["template_from"]
        # The template's variables: the source tokenizer's special tokens and the plan's (enable_thinking).
        self.template_vars = {**chat["special_tokens"], **chat.get(TEMPLATE_KWARGS, {})}
        self.eos_text = chat["special_tokens"].get("eos_token", "")
        self.train_on_prompt = chat["train_on_prompt"]
        self.tagged = self.template is not None and has_generation_tags(self.template)

    def encode(self, rows: list[Any], where: Callable[[int], str]) -> Encoded:
        """`where(i)` names row i of the batch (its file and line) for a bad row's one line."""
        if self.format == PREFERENCE:
            return self._encode_pairs(rows, where)
        for i, row in enumerate(rows):
            wrong = check_messages(row) if self.format == MESSAGES else _check_prompt_completion(row)
            if wrong:
                raise ConfigError(f"{where(i)}: {wrong}: fix the row (docs/data.md lists what a row holds)")
        tokenized = self._rendered(rows, where, self._tokenized)
        ids, flags, untrained, first_untrained = [], [], 0, None
        for i, (row, (tokens, trained)) in enumerate(zip(rows, tokenized, strict=True)):
            n = len(tokens)
            document = np.fromiter(itertools.chain(tokens, (self.eos,)), self.dtype, n + 1)
            mask = np.zeros(n + 1, np.uint8)
            mask[:n][trained] = TRAINED
            if n and tokens[-1] == self.eos:
                document, mask = document[:n], mask[:n]  # the template ended the document with EOS itself
            else:
                # EOS ends every document, as in the text stream. Plain prompt/completion: trained (TRL appends it
                # to the completion); a template ends its turns itself, so after a rendered one it is not.
                plain = self.format == PROMPT_COMPLETION and isinstance(row["prompt"], str)
                mask[-1] = TRAINED if self.train_on_prompt or plain else 0
            mask[0] = DOC_START  # nothing in the document predicts its first token
            if not mask[1:].any():  # past the first, a flag is TRAINED or nothing
                untrained += 1
                first_untrained = first_untrained or where(i)
            ids.append(document)
            flags.append(mask)
        return Encoded(ids, flags, untrained, first_untrained)

    def _rendered(
        self, rows: list[Any], where: Callable[[int], str], tokenize: Callable[[list], list]
    ) -> list:
        """`tokenize(rows)`; the batch is rendered at once, so where the template fails, the first row failing
        alone is named in one line."""
        try:
            return tokenize(rows)
        except RenderError:
            for i, row in enumerate(rows):
                try:
                    tokenize([row])
                except RenderError as e:
                    raise ConfigError(
                        f"{where(i)}: {e}: fix the row, or pass --chat_template with a template that renders it "
                        f"(the template used: {self.template_from})"
                    ) from None
            raise

    def _encode_pairs(self, rows: list[dict], where: Callable[[int], str]) -> Encoded:
        """Preference rows: each pair one document, the chosen sequence then the rejected one (the module's doc)."""
        pairs = []
        for i, row in enumerate(rows):
            pair = _pair(row)
            if isinstance(pair, str):
                raise ConfigError(f"{where(i)}: {pair}: fix the row (docs/data.md lists what a pair holds)")
            pairs.append(pair)
        ids, flags = [], []
        for i, (chosen, rejected, prompt) in enumerate(self._rendered(pairs, where, self._pair_ids)):
            for name, sequence in (("chosen", chosen), ("rejected", rejected)):
                if len(sequence) == prompt:
                    raise ConfigError(
                        f"{where(i)}: the {name} answer adds no token to the prompt's: fix the row"
                    )
            if chosen[prompt:] == rejected[prompt:]:
                raise ConfigError(
                    f"{where(i)}: 'chosen' and 'rejected' tokenize identically: there is nothing to prefer: fix "
                    "the row"
                )
            split = len(chosen)
            document = np.array(chosen + rejected, self.dtype)
            mask = np.zeros(len(document), np.uint8)
            mask[prompt:split] = TRAINED
            mask[split + prompt :] = TRAINED
            mask[0] |= DOC_START
            mask[split] |= DOC_START
            ids.append(document)
            flags.append(mask)
        return Encoded(ids, flags, 0)

    def _pair_ids(self, pairs: list[Pair]) -> list[tuple[list[int], list[int], int]]:
        """Each pair's prompt + chosen ids, prompt + rejected ids, and how many of their first ids are the
        prompt's: TRL's DPOTrainer._prepare_dataset. Conversations are rendered as apply_chat_template renders
        them and tokenized as it does (no special tokens added); text is tokenized as the tokenizer's __call__
        (its special tokens added, as TRL's _tokenize does), after the EOS text is appended to each answer that
        does not end with it."""
        chats = [pair for pair in pairs if isinstance(pair[1], list)]
        prompts = iter(self._tokens(self._render([p for p, _, _ in chats], True)))
        chosens = iter(self._tokens(self._render([p + c for p, c, _ in chats], False)))
        rejecteds = iter(self._tokens(self._render([p + r for p, _, r in chats], False)))
        eos = self.eos_text
        texts = []
        for prompt, chosen, rejected in pairs:
            if isinstance(chosen, str):
                chosen = chosen if chosen.endswith(eos) else chosen + eos
                rejected = rejected if rejected.endswith(eos) else rejected + eos
                texts += [prompt, prompt + chosen, prompt + rejected]
        encoded = iter(self._tokens(texts, special=True))
        out = []
        for pair in pairs:
            if isinstance(pair[1], list):
                prompt, chosen, rejected = next(prompts).ids, next(chosens).ids, next(rejecteds).ids
            else:
                prompt, chosen, rejected = next(encoded).ids, next(encoded).ids, next(encoded).ids
            out.append((chosen, rejected, min(_common_ids(prompt, chosen), _common_ids(prompt, rejected))))
        return out

    def _tokenized(self, rows: list[Any]) -> list[tuple[list[int], np.ndarray]]:
        """Each row's token ids and which of them are trained on (a bool per token)."""
        if self.format == PROMPT_COMPLETION:
            return self._prompt_completion(rows)
        if self.train_on_prompt:
            return [(e.ids, np.ones(len(e), bool)) for e in self._tokens(self._render(rows, False))]
        if self.tagged:
            out = self._render(rows, return_dict=True, return_assistant_tokens_mask=True)
            return [
                (ids, np.array(mask, bool))
                for ids, mask in zip(out["input_ids"], out["assistant_masks"], strict=True)
            ]
        return self._by_turns(rows)

    def _by_turns(self, rows: list[list[dict]]) -> list[tuple[list[int], np.ndarray]]:
        """Each assistant turn's span: where the conversation up to it (with the generation prompt) and through
        it end in the whole rendering (see the module's doc)."""
        turns = [[i for i, m in enumerate(row) if m["role"] == "assistant"] for row in rows]
        wholes = self._render(rows, False)
        prompts, throughs = [], []
        for row, at in zip(rows, turns, strict=True):
            prompts += [row[:i] for i in at if i > 0]  # up to a first message: nothing
            throughs += [row[: i + 1] for i in at if i + 1 < len(row)]  # through a last: the whole rendering
        prompts, throughs = iter(self._render(prompts, True)), iter(self._render(throughs, False))
        out = []
        for row, at, whole, encoding in zip(
            rows, turns, wholes, self._tokens(wholes, offsets=True), strict=True
        ):
            trained = np.zeros(len(encoding), bool)
            for i in at:
                start = _aligned(next(prompts), whole) if i > 0 else 0
                end = _aligned(next(throughs), whole) if i + 1 < len(row) else len(whole)
                if end <= start:
                    raise _nothing_to_train(i)
                # as return_assistant_tokens_mask: the tokens holding the span's first and last characters
                first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
                if first is not None:
                    trained[first : last + 1 if last is not None else None] = True
            out.append((encoding.ids, trained))
        return out

    def _prompt_completion(self, rows: list[dict]) -> list[tuple[list[int], np.ndarray]]:
        """TRL's completion_only_loss: trained on what follows the tokens the prompt alone shares with the row."""
        chats = [row for row in rows if isinstance(row["prompt"], list)]
        wholes = iter(self._render([row["prompt"] + row["completion"] for row in chats], False))
        prompts = iter(self._render([row["prompt"] for row in chats], True))
        texts, prompt_texts = [], []
        for row in rows:
            if isinstance(row["prompt"], list):
                texts.append(next(wholes))
                prompt_texts.append(next(prompts))
                continue
            whole, eos = row["prompt"] + row["completion"], self.eos_text
            # TRL appends the EOS to the completion (tokenized with it); ours is appended as an id.
            texts.append(whole[: -len(eos)] if eos and whole.endswith(eos) else whole)
            prompt_texts.append(row["prompt"])
        encodings = self._tokens(texts + prompt_texts)
        out = []
        for encoding, prompt in zip(encodings[: len(rows)], encodings[len(rows) :], strict=True):
            trained = np.ones(len(encoding), bool)
            if not self.train_on_prompt:
                trained[: _common_ids(prompt.ids, encoding.ids)] = False
            out.append((encoding.ids, trained))
        return out

    def _render(
        self, conversations: list[list[dict]], generation_prompt: bool = False, **tokenized: Any
    ) -> Any:
        """The conversations rendered, or with `tokenized` (apply_chat_template's return_dict...) tokenized."""
        if not conversations:
            return []
        if self.template is None:
            raise RenderError("it is a conversation and the tokenizer has no chat template")
        try:
            return self.chat_tokenizer.apply_chat_template(
                conversations,
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                tokenize=bool(tokenized),
                **tokenized,
                **self.template_vars,
            )
        except Exception as e:  # jinja's errors and the template's own raise_exception
            raise RenderError(f"the chat template cannot render it ({first_line(e)})") from None

    def _tokens(self, texts: list[str], offsets: bool = False, special: bool = False) -> list[Any]:
        """As apply_chat_template tokenizes its rendering: no special tokens added; `offsets` for char_to_token;
        `special`: as the tokenizer's __call__, with the special tokens its post-processor adds (a BOS)."""
        encode = self.tokenizer.encode_batch if offsets else self.tokenizer.encode_batch_fast
        return encode(texts, add_special_tokens=special)


def render_prompt(tokenizer: Any, template: str, messages: list[dict]) -> str:
    """A conversation as a prompt: rendered with the template's generation prompt, for the model to answer
    (`--sample_prompts`); a ConfigError when the template cannot render it."""
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:
        raise ConfigError(
            f"the chat template cannot render the conversation prompt ({first_line(e)}): fix the prompt, or pass "
            "--chat_template with a template that renders it"
        ) from None


# --- which format ---------------------------------------------------------------------------------------


def pair_fields(first: dict | None) -> tuple[str, ...]:
    """The columns of preference rows: with the prompt, or (no 'prompt' in the first row) the chosen and rejected
    conversations or texts it is extracted from. Unknown columns (`first` None: S3 objects) name a prompt."""
    return PAIR_FIELDS if first is None or "prompt" in first else PAIR_FIELDS[1:]


def decide_format(data: Any, first: dict | None) -> tuple[str, Any, str | None]:
    """The format of the rows, the field(s) read for it, and with --data_format auto a line saying what was
    decided from the columns of the first row (`first`; None: plain text files)."""
    if data.data_format == MESSAGES:
        return MESSAGES, data.text_field if data.text_field != "text" else "messages", None
    if data.data_format == PROMPT_COMPLETION:
        return PROMPT_COMPLETION, ("prompt", "completion"), None
    if data.data_format == PREFERENCE:
        return PREFERENCE, pair_fields(first), None
    if data.data_format == TEXT or first is None:
        return TEXT, data.text_field, None
    value = first.get(data.text_field)
    if isinstance(value, str):
        return TEXT, data.text_field, None
    if "chosen" in first and "rejected" in first:
        return (
            PREFERENCE,
            pair_fields(first),
            "columns 'chosen' and 'rejected': --data_format preference (auto)",
        )
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
