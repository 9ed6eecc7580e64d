"""Loss masks of prompt/completion and conversation rows: the same tokens and the same trained-on tokens as TRL's
SFTTrainer (assistant_only_loss, completion_only_loss) for the Qwen3, Llama-3.1, Mistral and Gemma-3 templates,
from the stock templates (no generation tags) by the prefix-render comparison; and a bad row in one line."""

from __future__ import annotations

import random

import numpy as np
import pytest

from model_utils.config.arguments import DataArgs
from model_utils.data import chat
from model_utils.data.token_shards import TokenizerSpec
from model_utils.errors import ConfigError
from support.chat_data import FAMILIES, chat_tokenizer, conversations, template_text


def _encoder(tokenizer, data_format: str, **data) -> chat.ChatEncoder:
    spec = TokenizerSpec.of(tokenizer, "test")
    options = chat.options(DataArgs(**data), tokenizer, data_format)
    return chat.ChatEncoder(spec.json, spec.eos_id, spec.dtype, data_format, options)


def _ours(
    tokenizer, rows: list, data_format: str = chat.MESSAGES, **data
) -> list[tuple[list[int], list[int]]]:
    """Each row's ids and trained flags (DataArgs(**data)'s options), with the EOS appended to end the document
    where the template did not."""
    encoded = _encoder(tokenizer, data_format, **data).encode(rows, lambda i: f"row {i}")
    out = []
    for ids, flags in zip(encoded.ids, encoded.flags, strict=True):
        ids, trained = ids.tolist(), ((flags & chat.TRAINED) != 0).astype(int).tolist()
        out.append((ids, trained))
    return out


def _trl(tokenizer, rows: list[dict], tmp_path, **config) -> list[tuple[list[int], list[int]]]:
    """TRL's SFTTrainer's tokenized rows: input_ids, and 1 where its labels train on the token."""
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True, **config)
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    return [(r["input_ids"], [int(label != -100) for label in r["labels"]]) for r in trainer.train_dataset]


def _without_appended_eos(ours: tuple[list[int], list[int]], reference_ids: list[int]):
    ids, trained = ours
    if len(ids) == len(reference_ids) + 1:
        return ids[:-1], trained[:-1]
    return ids, trained


@pytest.mark.parametrize("family", ["qwen3", "llama3_1", "mistral", "gemma3"])
def test_assistant_masks_equal_trls(family: str, tmp_path) -> None:
    spec = FAMILIES[family]
    stock = chat_tokenizer(spec, tmp_path / "stock")
    chats = conversations(family)
    ours = _ours(stock, chats)
    # TRL swaps its training template in for the stock Qwen3 and Gemma-3 ones; it has none for Llama-3.1 or
    # Mistral, so it is given the stock template with generation tags added (the same rendering).
    trl_tokenizer = (
        stock if family in ("qwen3", "gemma3") else chat_tokenizer(spec, tmp_path / "tagged", spec.tagged)
    )
    reference = _trl(trl_tokenizer, [{"messages": c} for c in chats], tmp_path, assistant_only_loss=True)
    compared = 0
    for chat_, mine, (ref_ids, ref_trained) in zip(chats, ours, reference, strict=True):
        ids, trained = _without_appended_eos(mine, ref_ids)
        if ids != ref_ids:
            # TRL's Qwen3 training template keeps every turn's <think> block, the stock one (trained on here)
            # drops those before the last question: only multi-turn Qwen3 conversations render differently.
            assert family == "qwen3" and sum(m["role"] == "user" for m in chat_) > 1
            continue
        assert trained == ref_trained, stock.decode(ids)
        assert 1 in trained
        compared += 1
    assert compared >= 3


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_stock_qwen3_masks_equal_its_tagged_rendering_in_both_thinking_modes(
    enable_thinking, tmp_path
) -> None:
    """Multi-turn Qwen3, which TRL renders differently: the stock rendering with generation tags (qwen3_tagged)
    through transformers' return_assistant_tokens_mask, the mode chosen by --enable_thinking (default: the
    template's, thinking). In non-thinking mode the empty <think> block is part of the generation prompt (the model
    is given it), so it is not trained on; everything else is the same."""
    tokenizer = chat_tokenizer(FAMILIES["qwen3"], tmp_path / "tok")
    tagged = template_text("qwen3_tagged.jinja")
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    chats = conversations("qwen3")
    ours = _ours(tokenizer, chats, enable_thinking=enable_thinking)
    empty_thinks = 0
    for messages, mine in zip(chats, ours, strict=True):
        reference = tokenizer.apply_chat_template(
            messages, return_dict=True, return_assistant_tokens_mask=True, chat_template=tagged, **kwargs
        )
        ids, trained = _without_appended_eos(mine, reference["input_ids"])
        assert ids == reference["input_ids"]
        text = tokenizer.decode(ids)
        encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        expected = np.array(reference["assistant_masks"])
        last = messages[-1]
        if (
            enable_thinking is False
            and last.get("reasoning_content") is None
            and "<think>" not in last["content"]
        ):
            at = text.rindex(EMPTY_THINK)
            first, end = encoding.char_to_token(at), encoding.char_to_token(at + len(EMPTY_THINK) - 1) + 1
            assert expected[first:end].all()  # trained on by the tagged template, the prompt here
            assert not any(trained[first:end])
            expected[first:end] = 0
            empty_thinks += 1
        if enable_thinking is False and last.get("reasoning_content") is not None:
            continue  # reasoning given in non-thinking mode: its "<think>\n" reads as the prompt's
        assert trained == expected.tolist(), text
    assert empty_thinks == (5 if enable_thinking is False else 0)


def test_enable_thinking_is_refused_where_it_would_change_nothing(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["llama3_1"], tmp_path / "tok")
    with pytest.raises(
        ConfigError, match=r"^--enable_thinking false: the chat template \(the tokenizer's\) does not"
    ):
        chat.options(DataArgs(enable_thinking=False), tokenizer, chat.MESSAGES)
    qwen3 = chat_tokenizer(FAMILIES["qwen3"], tmp_path / "qwen3")
    assert "template_kwargs" not in chat.options(DataArgs(), qwen3, chat.MESSAGES)  # records as before
    given = chat.options(DataArgs(enable_thinking=False), qwen3, chat.MESSAGES)
    assert given["template_kwargs"] == {"enable_thinking": False}


EMPTY_THINK = "<think>\n\n</think>\n\n"


def test_generation_tags_are_used_where_the_template_has_them(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["gemma3"], tmp_path / "tok", "gemma3_training.jinja")
    messages = conversations("gemma3")[2]
    reference = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ((ids, trained),) = _ours(tokenizer, [messages])
    assert ids[: len(reference["input_ids"])] == reference["input_ids"]
    assert trained[: len(reference["input_ids"])] == reference["assistant_masks"]


def test_completion_masks_equal_trls(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["qwen3"], tmp_path / "tok")
    plain = [
        {"prompt": "The capital of France is", "completion": " Paris."},
        {"prompt": "Two plus two equals ", "completion": "four"},
        {"prompt": "Q: what color is the sky?\nA:", "completion": " Blue, on a clear day."},
    ]
    ours = _ours(tokenizer, plain, chat.PROMPT_COMPLETION)
    assert ours == _trl(tokenizer, plain, tmp_path, completion_only_loss=True)
    assert all(trained[-1] == 1 for _, trained in ours)  # the EOS that ends the completion is trained on
    conversational = [{"prompt": c[:-1], "completion": c[-1:]} for c in conversations("qwen3")[:4]]
    ours = _ours(tokenizer, conversational, chat.PROMPT_COMPLETION)
    reference = _trl(tokenizer, conversational, tmp_path, completion_only_loss=True)
    for mine, (ref_ids, ref_trained) in zip(ours, reference, strict=True):
        assert _without_appended_eos(mine, ref_ids) == (ref_ids, ref_trained)


def test_train_on_prompt_trains_every_token_but_the_first(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["llama3_1"], tmp_path / "tok")
    spec = TokenizerSpec.of(tokenizer, "test")
    options = chat.options(DataArgs(train_on_prompt=True), tokenizer, chat.MESSAGES)
    encoded = chat.ChatEncoder(spec.json, spec.eos_id, spec.dtype, chat.MESSAGES, options).encode(
        conversations("llama3_1")[:1], str
    )
    flags = encoded.flags[0]
    assert flags[0] == chat.DOC_START and (flags[1:] == chat.TRAINED).all()


BAD_ROWS = [
    ([{"content": "hi"}, {"role": "assistant", "content": "yo"}], "message 0 has no 'role'"),
    ([{"role": "human", "content": "hi"}], "message 0 has the unknown role 'human'"),
    (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}],
        "message 1 is an empty assistant turn",
    ),
    ([{"role": "user", "content": ["hi"]}], "message 0 (user) has list content, not text"),
    ("hello", "is str, not a list of messages"),
]


@pytest.mark.parametrize(("row", "wrong"), BAD_ROWS)
def test_a_bad_conversation_is_one_line_naming_the_row(row, wrong: str, tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["qwen3"], tmp_path / "tok")
    good = conversations("qwen3")[0]
    with pytest.raises(ConfigError) as raised:
        _encoder(tokenizer, chat.MESSAGES).encode([good, row], lambda i: f"data.jsonl row {i}")
    line = str(raised.value)
    assert line.startswith(f"data.jsonl row 1: {wrong}") and "\n" not in line


def test_a_row_the_template_cannot_render_is_one_line(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["mistral"], tmp_path / "tok")
    two_users = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    with pytest.raises(
        ConfigError, match=r"^data.jsonl row 0: the chat template cannot render it \(.*alternate"
    ):
        _encoder(tokenizer, chat.MESSAGES).encode([two_users], lambda i: f"data.jsonl row {i}")


def test_the_first_row_with_nothing_to_train_on_is_named(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["qwen3"], tmp_path / "tok")
    good, no_answer = conversations("qwen3")[0], [{"role": "user", "content": "Hello?"}]
    encoder = _encoder(tokenizer, chat.MESSAGES)
    encoded = encoder.encode([good, no_answer, no_answer], lambda i: f"data.jsonl line {i + 1}")
    assert encoded.untrained == 2 and encoded.first_untrained == "data.jsonl line 2"
    assert encoder.encode([good], lambda i: f"data.jsonl line {i + 1}").first_untrained is None


def test_bad_prompt_completion_rows(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["qwen3"], tmp_path / "tok")
    for row, wrong in (
        ({"prompt": 3, "completion": "x"}, "'prompt' is int, not text or a list of messages"),
        ({"prompt": "x", "completion": ""}, "'completion' is empty"),
    ):
        with pytest.raises(ConfigError, match=f"^f.jsonl row 0: {wrong}"):
            _encoder(tokenizer, chat.PROMPT_COMPLETION).encode([row], lambda i: f"f.jsonl row {i}")


def test_auto_decides_by_the_first_rows_columns() -> None:
    data = DataArgs()
    assert chat.decide_format(data, {"text": "a"})[:2] == ("text", "text")
    decided = chat.decide_format(data, {"messages": [{"role": "user", "content": "a"}]})
    assert decided[:2] == ("messages", "messages") and "--data_format messages (auto)" in decided[2]
    # --text_field messages on conversations: conversations, not 0 documents
    assert chat.decide_format(DataArgs(text_field="messages"), {"messages": []})[:2] == (
        "messages",
        "messages",
    )
    assert chat.decide_format(data, {"prompt": "a", "completion": "b"})[:2] == (
        "prompt_completion",
        ("prompt", "completion"),
    )
    assert chat.decide_format(DataArgs(data_format="text"), {"messages": []})[:2] == ("text", "text")


@pytest.mark.parametrize("family", ["qwen3", "llama3_1", "mistral", "gemma3"])
def test_the_renderer_renders_every_prefix_as_transformers_does(family: str) -> None:
    """chat.Renderer (one conversion per conversation, the quickened sandbox) against render_jinja_template, the
    renderer of apply_chat_template: every prefix, with and without the generation prompt, stock and tagged."""
    from transformers.utils.chat_template_utils import render_jinja_template

    spec = FAMILIES[family]
    variables = {"bos_token": spec.bos or "", "eos_token": spec.eos}
    modes = [{}, {"enable_thinking": False}] if family == "qwen3" else [{}]
    for name in (spec.template, spec.tagged):
        template = template_text(name)
        for mode in modes:
            renderer = chat.renderer(template, {**variables, **mode})
            for messages in conversations(family):
                prefixes = [(n, prompt) for n in range(1, len(messages) + 1) for prompt in (False, True)]
                ours = renderer.render(messages, prefixes)
                for (n, prompt), text in zip(prefixes, ours, strict=True):
                    try:
                        reference = render_jinja_template(
                            conversations=[messages[:n]],
                            chat_template=template,
                            add_generation_prompt=prompt,
                            **variables,
                            **mode,
                        )[0][0]
                    except Exception:  # e.g. Mistral's alternation check on a prefix ending with a user turn
                        continue
                    assert text == reference, (name, mode, n, prompt)


HOSTILE = [
    "{{ messages.append(1) }}",  # mutating a list
    "{{ messages[0].__class__.__mro__ }}",  # reaching the class hierarchy
    # a dict's method before its key, a key, a missing key
    "{% for m in messages %}{{ m.items is callable }}|{{ m.role }}|{{ m.nothing }}|{{ m.get('content') }}{% endfor %}",
    "{{ ''.__class__ }}{{ namespace(a=1).a }}{{ 'x'.upper() }}",
    "{{ messages[0].content.format('x') }}{{ messages[0].content.format('{0.__class__}', 1) }}",
    # a str's methods, again once decided (and the unsafe ones each time)
    "{% for i in range(3) %}{{ 'a,b'.split(',') }}{{ 'q'.startswith('q') }}{{ 'x'.__len__() }}{{ 'y'.format_map }}"
    "{% endfor %}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_the_quickened_sandbox_allows_and_refuses_what_jinjas_does(template: str) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "user", "content": "hi {0}"}, {"role": "assistant", "content": "yo"}]
    try:
        expected: object = render_jinja_template(conversations=[messages], chat_template=template)[0][0]
    except Exception as e:
        expected = (type(e), str(e))
    try:
        got: object = chat.renderer(template, {}).render(messages, [(2, False)])[0]
    except Exception as e:
        got = (type(e), str(e))
    assert got == expected


def test_the_sandbox_decides_each_attribute_of_a_type_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most of a render's time was jinja's attribute check, made for every attribute read of every message: the
    renderer's sandbox makes it once per (type, name), however many conversations it renders."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    checked: list[tuple[type, str]] = []
    check = ImmutableSandboxedEnvironment.is_safe_attribute

    def counted(self, obj, attr, value):
        checked.append((type(obj), attr))
        return check(self, obj, attr, value)

    monkeypatch.setattr(ImmutableSandboxedEnvironment, "is_safe_attribute", counted)
    monkeypatch.setattr(chat, "_renderers", {})
    renderer = chat.renderer(template_text("qwen3.jinja"), {"eos_token": "<|im_end|>"})
    for messages in conversations("qwen3") * 20:
        renderer.render(messages, [(len(messages), False), (1, True)])
    assert checked and len(checked) == len(set(checked))


# Contents a template may render otherwise than a placeholder: ends it trims, its own markers, a role's name, a
# placeholder's characters; each must take the renders of its own conversation. And contents that start as the
# template's own text does.
TRICKY_CONTENTS = [
    "  padded  ",
    "line\n",
    "<think>\nSeven is odd.\n</think>\n\nYes.",
    "<tool_response>42</tool_response>",
    "user",
    "\ue0001\ue001",
    "<thin ice>",  # what a template's own text begins with: the partial and whole renderings agree a while longer
    "<b>bold</b>",
]


def _generated_conversations(rng: random.Random, count: int) -> list[list[dict]]:
    """Alternating turns (as Mistral's and Gemma's templates require), an optional system message first, words of
    the module's doc; one content in twenty tricky."""
    words = __doc__.split()

    def content() -> str:
        if rng.random() < 0.05:
            return rng.choice(TRICKY_CONTENTS)
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))

    chats = []
    for _ in range(count):
        messages = [{"role": "system", "content": content()}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": content()}, {"role": "assistant", "content": content()}]
        chats.append(messages)
    return chats


@pytest.mark.parametrize("family", ["qwen3", "llama3_1", "mistral", "gemma3"])
def test_spans_by_shape_equal_the_spans_of_every_prefix_rendered(family: str) -> None:
    """The renderer renders one placeholder conversation per shape (its roles) and each conversation once, whole:
    its text and spans equal those of rendering it prefix by prefix, for ordinary and tricky contents (and the
    suite's conversations: reasoning fields, whitespace); and it renders far less."""
    spec = FAMILIES[family]
    template = template_text(spec.template)
    variables = {"bos_token": spec.bos or "", "eos_token": spec.eos}
    rng = random.Random(0)
    chats = [chat._clean(m) for m in conversations(family) + _generated_conversations(rng, 300)]
    by_shape, every_prefix = chat.Renderer(template, variables), chat.Renderer(template, variables)
    every_prefix.by_shape = False
    rendered = {"by_shape": 0, "every_prefix": 0}
    for name, ours in (("by_shape", by_shape), ("every_prefix", every_prefix)):
        render = ours.render

        def counted(messages, prefixes, plain=False, *, render=render, name=name):
            rendered[name] += len(prefixes)
            return render(messages, prefixes, plain)

        ours.render = counted
    for messages in chats:
        assert by_shape.spans(messages) == every_prefix.spans(messages), messages
    assert by_shape.by_shape  # no conversation's check disagreed
    assert rendered["by_shape"] < 0.5 * rendered["every_prefix"], rendered


def test_a_content_the_template_looks_into_takes_its_own_renders() -> None:
    """A template whose generation prompt depends on what the last message holds ('#'), which its whole rendering
    does not show: a conversation holding '#' after its shape's checked ones gets the spans of its own renders
    (the answer from after "A:"), not the placeholders' (from after "A")."""
    template = (
        "{%- for m in messages %}{{ (m.role[0] | upper) ~ (':' if m.role == 'assistant' else '=') ~ m.content ~ '\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ 'A:' if '#' in messages[-1].content else 'A' }}{%- endif %}"
    )
    renderer = chat.Renderer(template, {})

    def trained(content: str) -> list[str]:
        full, spans = renderer.spans(
            [{"role": "user", "content": content}, {"role": "assistant", "content": "yes"}]
        )
        assert full == f"U={content}\nA:yes\n"
        return [full[start:end] for start, end in spans]

    assert [trained(f"q{k}") for k in range(3)] == [[":yes\n"]] * 3  # two checked, one by its shape
    assert trained("q#") == ["yes\n"]
