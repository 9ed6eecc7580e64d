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
the span is always a span of the text that is trained on. Those renders are made once per shape of conversation
(its roles) with placeholder contents, and each conversation is rendered once, whole (Renderer.spans): where that
equals the placeholders' rendering with its contents filled in, the spans are the filled renders'. Contents the
template looks into are rendered in full. Prompt/completion rows follow TRL's SFTTrainer: the
prompt's tokens are those the prompt alone and prompt + completion share (completion_only_loss).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import BuiltinMethodType, MethodType
from typing import Any

import numpy as np

from model_utils.data.template_proof import TemplateProof
from model_utils.data.token_spans import TokenSpans
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
_STR_FORMATS = ("format", "format_map")


def _quickened(environment: Any) -> None:
    """Shortcuts for the sandboxed environment a renderer compiles its template in, each giving exactly what
    jinja's own method gives (jinja2.sandbox), where most of a render's time went:
    - `is_safe_attribute` decided once per (type, attribute name): for ImmutableSandboxedEnvironment the check
      depends on nothing else (is_internal_attribute, modifies_known_mutable look at the type and the name);
    - `getattr` on a plain dict (`message.role`) looks the key up at once: jinja tries the attribute first, and a
      dict instance has only its class's attributes, so any other name reaches the key lookup anyway;
    - `getattr` once (type, name) is decided safe (`content.startswith`, `loop.last`): jinja's path would return
      the value itself but for a str's `format` and `format_map` (wrapped), which keep jinja's own path, as does a
      method of another type (it might be one of those);
    - `call` of a str's method: jinja's is_safe_callable looks for attributes a builtin method does not have.
    Another environment class is left as it is."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if type(environment) is not ImmutableSandboxedEnvironment:
        return
    check, sandboxed_getattr, sandboxed_call, undefined = (
        environment.is_safe_attribute,
        environment.getattr,
        environment.call,
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
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return undefined(obj=obj, name=attribute)
        if decided.get((kind, attribute)):
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                return sandboxed_getattr(obj, attribute)
            if kind is str and attribute not in _STR_FORMATS:
                return value
            # jinja wraps only str's format methods, which another type's method might be
            if not isinstance(value, (MethodType, BuiltinMethodType)):
                return value
        return sandboxed_getattr(obj, attribute)

    def call(context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        if type(obj) is BuiltinMethodType and type(obj.__self__) is str:
            # as context.call calls it: without the loop's and block's variables (for pass_context callables)
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            return obj(*args, **kwargs)  # a str's method raises no StopIteration (context.call's one catch)
        return sandboxed_call(context, obj, *args, **kwargs)

    environment.is_safe_attribute = is_safe_attribute
    environment.getattr = getattr_
    environment.call = call


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


def assistant_spans(
    template: str, messages: list[dict], special_tokens: dict[str, str], **kwargs: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered, and the character spans of its assistant turns (see the module's doc)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = _clean(messages)
    options = {**special_tokens, **kwargs}
    if has_generation_tags(template):
        try:
            rendered, indices = render_jinja_template(
                conversations=[messages], chat_template=template, return_assistant_tokens_mask=True, **options
            )
        except Exception as e:  # jinja's errors and the template's own raise_exception
            raise RenderError(f"the chat template cannot render it ({first_line(e)})") from None
        return rendered[0], [tuple(span) for span in indices[0]]
    return renderer(template, options).spans(messages)


class _Skeleton:
    """The renderings a conversation's spans come from (whole, through and up to each assistant turn), of one
    shape's placeholder conversation: each text as its literal pieces between the messages' contents."""

    def __init__(self, renders: tuple[str, list[str], list[str]], proven: bool) -> None:
        full, throughs, prompts = renders
        self.full = _pieces(full)
        self.proven = proven  # template_proof: every conversation of the shape renders as these, filled
        self._bounds = [
            (_Bound(_pieces(prompt), self.full), _Bound(_pieces(through), self.full))
            for prompt, through in zip(prompts, throughs, strict=True)
        ]

    def spans(self, assistant: list[int], contents: list[str]) -> tuple[str, list[tuple[int, int]]]:
        """The whole rendering filled, and the spans _aligned_spans finds in the filled renderings."""
        sizes = [len(c) for c in contents]
        spans = []
        for turn, (start, end) in zip(assistant, self._bounds, strict=True):
            first, stop = start.end(contents, sizes), end.end(contents, sizes)
            if stop <= first:
                raise _nothing_to_train(turn)
            spans.append((first, stop))
        return _filled(self.full, contents), spans


class _Bound:
    """Where a partial rendering (up to or through an assistant turn) ends in the whole one, filled, as _aligned
    finds it, from the pieces: where the two are the same piece by piece, so are their fillings, and only the
    rest is compared. A partial that the whole continues piece by piece (most templates only append) ends at its
    length, whatever the contents."""

    def __init__(self, partial: tuple[list[str], list[int]], whole: tuple[list[str], list[int]]) -> None:
        literals, slots = partial
        whole_literals, whole_slots = whole
        same = 0  # pieces before this one are the same in both
        while (
            same < len(slots)
            and same < len(whole_slots)
            and literals[same] == whole_literals[same]
            and slots[same] == whole_slots[same]
        ):
            same += 1
        self.appended = same == len(slots) and whole_literals[same].startswith(literals[same])
        cut = len(slots) if self.appended else same
        self.literal_chars, self.slots = sum(map(len, literals[:cut])), slots[:cut]
        if self.appended:
            self.literal_chars += len(literals[cut])
        self.rest = (literals[same:], slots[same:])
        self.whole_rest = (whole_literals[same:], whole_slots[same:])

    def end(self, contents: list[str], sizes: list[int]) -> int:
        before = self.literal_chars + sum([sizes[k] for k in self.slots])
        if self.appended:
            return before
        rest = _filled(self.rest, contents)
        # _aligned reads the whole one no further than the partial one's length
        literals, slots = self.whole_rest
        parts, size = [literals[0]], len(literals[0])
        for slot, literal in zip(slots, literals[1:], strict=True):
            if size >= len(rest):
                break
            parts += (contents[slot], literal)
            size += sizes[slot] + len(literal)
        return before + _aligned(rest, "".join(parts)[: len(rest)])


def _placeholder(k: int) -> str:
    return f"\ue000{k}\ue001"  # private-use characters: in no template, in no real text


_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


def _pieces(text: str) -> tuple[list[str], list[int]]:
    parts = _PLACEHOLDER.split(text)
    return parts[::2], [int(k) for k in parts[1::2]]


def _filled(pieces: tuple[list[str], list[int]], contents: list[str]) -> str:
    literals, slots = pieces
    out = [literals[0]]
    for slot, literal in zip(slots, literals[1:], strict=True):
        out += (contents[slot], literal)
    return "".join(out)


_SPACES = frozenset(c for c in map(chr, range(0x3001)) if c.isspace())  # U+3000 is the last


class _ContentGuard:
    """Which contents a template treats as it treats a placeholder, read from its syntax tree: it may trim or
    strip a content (the placeholder has no such ends), find a text in it, split it at one, compare it with one.
    A content with none of those ends, texts or equals renders as the placeholder renders, the content in its
    place (template_proof checks each step a template takes with a content against these sets). What the template strips, finds or compares a message's fields with is in these sets whatever it
    applies them to: a safe excess."""

    def __init__(self, environment: Any, template: str) -> None:
        from jinja2 import nodes

        self.inside: set[str] = set()  # a content holding one is rendered by its own renders
        self.equal: set[str] = set()  # a content equal to (or inside) one
        self.ends = set(" \t\n\r\x0b\x0c")  # a content starting or ending with one
        tree = environment.parse(template)

        def texts(exprs: Any) -> list[str]:
            return [e.value for e in exprs if isinstance(e, nodes.Const) and isinstance(e.value, str)]

        for call in tree.find_all(nodes.Call):
            if isinstance(call.node, nodes.Getattr):
                if call.node.attr in ("strip", "lstrip", "rstrip"):
                    self.ends.update("".join(texts(call.args)))
                else:
                    self.inside.update(texts(call.args))
        for compare in tree.find_all(nodes.Compare):
            left = texts([compare.expr])
            for op in compare.ops:
                (self.inside if op.op in ("in", "notin") else self.equal).update(left)
                self.equal.update(texts([op.expr]))
                left = texts([op.expr])
        for applied in tree.find_all((nodes.Filter, nodes.Test)):
            if applied.name == "trim":
                self.ends.update("".join(texts(applied.args)))
            else:
                (self.inside if applied.name == "replace" else self.equal).update(texts(applied.args))
        self.inside.discard("")
        self.ends.update(_SPACES)  # what strip() strips: any Unicode space, not only the ASCII ones
        # One search per content for the texts looked for (None: there are none); literals only, which re finds
        # far faster than a pattern with a character class in it.
        searched = sorted(self.inside, key=len, reverse=True)
        self._searched = re.compile("|".join(map(re.escape, searched))) if searched else None
        self._longest_equal = max(map(len, self.equal), default=0)

    def passes(self, content: Any) -> bool:
        """A real content: as the template treats its placeholder, and holding no placeholder's characters."""
        return (
            type(content) is str
            and "\ue000" not in content
            and "\ue001" not in content
            and self.opaque(content)
        )

    def opaque(self, content: str) -> bool:
        """As the template treats any content without those ends and texts (a placeholder is one)."""
        return (
            bool(content)
            and content[0] not in self.ends
            and content[-1] not in self.ends
            and (self._searched is None or self._searched.search(content) is None)
            and not (len(content) <= self._longest_equal and any(content in text for text in self.equal))
        )


# Per shape, this many conversations are also rendered prefix by prefix and their spans compared: a template
# the guard misjudges is then rendered so for every conversation after.
CHECKED_PER_SHAPE = 2
# A shape whose first this many conversations all render otherwise than filled is rendered prefix by prefix.
MISSES_PER_SHAPE = 4
MAX_SHAPES = 4096


class Renderer:
    """One chat template with fixed variables (the special tokens, enable_thinking), rendering prefixes of a
    conversation as transformers' render_jinja_template renders each: the template compiled in its sandboxed
    environment (an overlay of it, with _quickened's shortcuts), the messages and variables made plain data, the
    reasoning fields aliased. The messages are converted once per conversation, not once per prefix.

    Spans come from renderings of a conversation up to and through each assistant turn; those are the same for
    every conversation of one shape (its roles, messages holding only role and a content the template treats
    as opaque: _ContentGuard) but for the contents, so they are rendered once per shape with placeholders. Where
    template_proof proves the template outputs such contents verbatim, a conversation of that shape is not
    rendered at all: its text and spans are the placeholders' filled with its contents. Else it is rendered once,
    whole: equal to the placeholders' filled, its spans are those of the filled renderings (else rendered prefix
    by prefix). The first conversations of each shape are rendered prefix by prefix too, a check of both."""

    def __init__(self, template: str, variables: dict[str, Any]) -> None:
        from transformers.utils import chat_template_utils

        self._template = template
        self._environment = chat_template_utils._compile_jinja_template(template).environment
        environment = self._environment.overlay()
        _quickened(environment)
        self.compiled = environment.from_string(template)
        self._proof: TemplateProof | None = None
        self.variables = chat_template_utils._plain_template_data(variables)
        self._plain = chat_template_utils._plain_template_data
        self._aliased = chat_template_utils._alias_reasoning_fields
        self.guard = _ContentGuard(environment, template)
        self.skeletons: dict[tuple[str, ...], _Skeleton | None] = {}
        self.checked: dict[tuple[str, ...], int] = {}  # conversations checked against their own renders
        # conversations whose whole rendering was not the filled one
        self.missed: dict[tuple[str, ...], int] = {}
        self.by_shape = True

    def render(
        self, messages: list[dict], prefixes: list[tuple[int, bool]], plain: bool = False
    ) -> list[str]:
        """The first n messages rendered, with the generation prompt or not, for each (n, generation_prompt).
        `plain`: the messages hold only str roles and contents, which transformers' conversion would copy as they
        are (no rich objects to make inert, no reasoning field to alias)."""
        chat = messages if plain else self._aliased(self._plain(messages))
        return [
            self.compiled.render(
                messages=chat[:n], tools=None, documents=None, add_generation_prompt=prompt, **self.variables
            )
            for n, prompt in prefixes
        ]

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation (no None values) rendered, and its assistant turns' character spans."""
        assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        shape = self._shape(messages)
        skeleton = self._skeleton(shape, assistant) if shape else None
        if skeleton is not None:
            filled, spans = skeleton.spans(assistant, [m["content"] for m in messages])
            if skeleton.proven:
                full = filled
            else:
                full = self._rendered(messages, [(len(messages), False)], plain=True)[0]
                if filled != full:
                    self.missed[shape] = missed = self.missed.get(shape, 0) + 1
                    if missed >= MISSES_PER_SHAPE and not self.checked.get(shape):
                        # the template renders such contents otherwise: no shortcut
                        self.skeletons[shape] = None
                    return full, _aligned_spans(assistant, *self._renders(messages, assistant, full))
            checked = self.checked.get(shape, 0)
            if checked >= CHECKED_PER_SHAPE:
                return full, spans
            self.checked[shape] = checked + 1
            exact = self._renders(messages, assistant, None if skeleton.proven else full)
            exact_spans = _aligned_spans(assistant, *exact)
            if exact[0] != full or exact_spans != spans:
                self.by_shape = False  # the guard or the proof misjudged this template: every prefix rendered
            return exact[0], exact_spans
        return (renders := self._renders(messages, assistant))[0], _aligned_spans(assistant, *renders)

    def _shape(self, messages: list[dict]) -> tuple[str, ...] | None:
        if not self.by_shape:
            return None
        passes = self.guard.passes
        for m in messages:
            if len(m) != 2 or type(m.get("role")) is not str or not passes(m.get("content")):
                return None
        return tuple([m["role"] for m in messages])

    def _skeleton(self, shape: tuple[str, ...], assistant: list[int]) -> _Skeleton | None:
        if shape not in self.skeletons:
            if len(self.skeletons) >= MAX_SHAPES:
                return None
            placeholders = [{"role": role, "content": _placeholder(k)} for k, role in enumerate(shape)]
            try:
                if not all(self.guard.opaque(m["content"]) for m in placeholders):
                    raise RenderError("the template looks inside a placeholder")
                renders = self._renders(placeholders, assistant)
                self.skeletons[shape] = _Skeleton(renders, self._proven(shape, assistant, renders))
            except RenderError:  # then the conversation's own renders (and errors) decide
                self.skeletons[shape] = None
        return self.skeletons[shape]

    def _proven(
        self, shape: tuple[str, ...], assistant: list[int], renders: tuple[str, list[str], list[str]]
    ) -> bool:
        """Whether the shape's renderings are proven to be every such conversation's, filled (template_proof)."""
        if self._proof is None:
            self._proof = TemplateProof(self._environment, self._template, self.guard)
        proof = self._proof
        placeholders = [{"role": role, "content": _placeholder(k)} for k, role in enumerate(shape)]

        def tracked(messages: list[dict], prefixes: list[tuple[int, bool]]) -> list[str]:
            rendered = proof.render(shape, [m["content"] for m in messages], prefixes, self.variables)
            if rendered is None:
                raise RenderError(f"not proven: {proof.unproven}")
            return rendered

        try:
            return self._renders(placeholders, assistant, render=tracked) == renders
        except RenderError:
            return False

    def _renders(
        self,
        messages: list[dict],
        assistant: list[int],
        full: str | None = None,
        render: Callable[[list[dict], list[tuple[int, bool]]], list[str]] | None = None,
    ) -> tuple[str, list[str], list[str]]:
        """The whole rendering (unless given), and those through and up to each assistant turn."""
        last = assistant[-1:] == [len(messages) - 1]  # then its "through" rendering is the full one
        throughs = [(i + 1, False) for i in (assistant[:-1] if last else assistant)]
        prompts = [(i, True) for i in assistant if i > 0]
        whole = [] if full is not None else [(len(messages), False)]
        rendered = (render or self._rendered)(messages, [*whole, *throughs, *prompts])
        if full is None:
            full = rendered.pop(0)
        rendered.insert(0, full)
        prompts_text = rendered[1 + len(throughs) :]
        if assistant and assistant[0] == 0:
            prompts_text.insert(0, "")
        return full, rendered[1 : 1 + len(throughs)] + rendered[:1] * last, prompts_text

    def _rendered(
        self, messages: list[dict], prefixes: list[tuple[int, bool]], plain: bool = False
    ) -> list[str]:
        try:
            return self.render(messages, prefixes, plain)
        except Exception as e:  # jinja's errors and the template's own raise_exception
            raise RenderError(f"the chat template cannot render it ({first_line(e)})") from None


_renderers: dict[str, Renderer] = {}


def renderer(template: str, variables: dict[str, Any]) -> Renderer:
    """One per process, template and variables: compiling a template takes a while, a worker renders many rows."""
    key = hashlib.sha256(f"{template}|{json.dumps(variables, sort_keys=True)}".encode()).hexdigest()
    if key not in _renderers:
        _renderers[key] = Renderer(template, variables)
    return _renderers[key]


def _aligned_spans(
    assistant: list[int], full: str, throughs: list[str], prompts: list[str]
) -> list[tuple[int, int]]:
    spans = []
    for turn, prompt, through in zip(assistant, prompts, throughs, strict=True):
        start = _aligned(prompt, full)
        end = _aligned(through, full)
        if end <= start:
            raise _nothing_to_train(turn)
        spans.append((start, end))
    return spans


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

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.token_spans = TokenSpans(tokenizer_json, self.tokenizer)
        self.eos = eos_id
        self.dtype = np.dtype(dtype)
        self.format = data_format
        self.template = chat["template"]
        self.template_from = chat["template_from"]
        # What the template is rendered with: the special tokens and the plan's variables (enable_thinking).
        self.template_vars = {**chat["special_tokens"], **chat.get(TEMPLATE_KWARGS, {})}
        self.eos_text = chat["special_tokens"].get("eos_token", "")
        self.train_on_prompt = chat["train_on_prompt"]
        self.tagged = self.template is not None and has_generation_tags(self.template)
        self._renderer: Renderer | None = None

    def renderer(self) -> Renderer:
        if self._renderer is None:  # looked up once, not per row (its key hashes the template)
            self._renderer = renderer(self.template, self.template_vars)
        return self._renderer

    def encode(self, rows: list[Any], where: Callable[[int], str]) -> Encoded:
        """`where(i)` names row i of the batch (its file and line) for a bad row's one line."""
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
        # Without offsets where the ids alone place the spans (token_spans.py); a row they cannot place is
        # tokenized again with them.
        offsets = not self.token_spans.usable and any(spans)
        encode = self.tokenizer.encode_batch if offsets else self.tokenizer.encode_batch_fast
        encodings = encode(texts, add_special_tokens=False)
        eos, dtype = self.eos, self.dtype
        documents = [np.fromiter(itertools.chain(e.ids, (eos,)), dtype, len(e) + 1) for e in encodings]  # EOS
        at = self._token_spans(texts, documents, spans, encodings if offsets else None)
        ids, flags, untrained, first_untrained = [], [], 0, None
        for i, (row, encoding, document, row_at, prompt) in enumerate(
            zip(rows, encodings, documents, at, prompt_ids, strict=True)
        ):
            n = len(document) - 1
            mask = np.zeros(n + 1, np.uint8)
            if self.train_on_prompt:
                mask[:] = TRAINED
            elif prompt is not None:  # prompt/completion: after the tokens the prompt alone shares
                mask[_common_ids(prompt, encoding.ids) :] = TRAINED
            else:
                for first, last in row_at:
                    if first is not None:
                        mask[first : (last + 1 if last is not None else n)] = TRAINED
            if n and document[n - 1] == eos:
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

    def _token_spans(
        self,
        texts: list[str],
        documents: list[np.ndarray],
        spans: list[list[tuple[int, int]]],
        encodings: Any,
    ) -> list[list[tuple[int | None, int | None]]]:
        """Per row, the tokens holding each span's first and last characters, as `return_assistant_tokens_mask`
        finds them (char_to_token); `encodings` have the offsets, or None: then the ids place them where they can
        (token_spans.py), and a row they cannot place is tokenized again with offsets."""
        if self.train_on_prompt or not any(spans):
            return [[] for _ in texts]
        positions = [[p for start, end in row for p in (start, end - 1)] for row in spans]
        at: list[list[int | None] | None] = [None] * len(texts)
        if encodings is None:
            rows = [k for k, row in enumerate(spans) if row]
            found = self.token_spans.tokens_at_many(
                [texts[k] for k in rows], [documents[k][:-1] for k in rows], [positions[k] for k in rows]
            )
            for k, row_at in zip(rows, found, strict=True):
                at[k] = row_at
        out: list[list[tuple[int | None, int | None]]] = []
        for k, row_at in enumerate(at):
            if row_at is None and spans[k]:
                encoding = (
                    encodings[k] if encodings else self.tokenizer.encode(texts[k], add_special_tokens=False)
                )
                row_at = [encoding.char_to_token(p) for p in positions[k]]
            out.append(list(zip(row_at[::2], row_at[1::2], strict=True)) if row_at else [])
        return out

    def _render(self, row: Any) -> tuple[str, list[tuple[int, int]], list[int] | None]:
        """The text to tokenize, the assistant spans (conversations), the prompt's ids (prompt/completion)."""
        if self.format == MESSAGES:
            if self.train_on_prompt:
                return self._full(row), [], None
            if self.tagged:
                text, spans = assistant_spans(self.template, row, self.template_vars)
            elif self.template is None:
                raise RenderError("it is a conversation and the tokenizer has no chat template")
            else:
                text, spans = self.renderer().spans(_clean(row))
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
            prompt_text = self.renderer().render(_clean(prompt), [(len(prompt), True)])[0]
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
            return self.renderer().render(_clean(messages), [(len(messages), False)])[0]
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
    if all(None not in m.values() for m in messages):
        return messages  # most conversations: nothing to drop, nothing copied
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
