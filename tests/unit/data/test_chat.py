"""Loss masks of prompt/completion and conversation rows: the same tokens and the same trained-on tokens as TRL's
SFTTrainer (assistant_only_loss, completion_only_loss) for the Qwen3, Llama-3.1, Mistral, Gemma-3 and the shipped
tiny templates, from the stock templates (no generation tags) by the prefix renders; the same as transformers'
return_assistant_tokens_mask of their tagged renderings on generated conversations; only public APIs of other
libraries; and a bad row in one line. Preference pairs: the same prompt, chosen and rejected ids as TRL's
DPOTrainer in its standard, conversational and implicit-prompt formats, and each bad pair in one line."""

from __future__ import annotations

import random

import numpy as np
import pytest

from model_utils.config.arguments import DataArgs
from model_utils.data import chat
from model_utils.data.token_shards import TokenizerSpec
from model_utils.errors import ConfigError
from support.chat_data import FAMILIES, chat_tokenizer, conversations, template_text
from support.preference_data import dpo_tokenized


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


@pytest.mark.parametrize("family", ["qwen3", "llama3_1", "mistral", "gemma3", "tiny"])
def test_assistant_masks_equal_trls(family: str, tmp_path) -> None:
    spec = FAMILIES[family]
    stock = chat_tokenizer(spec, tmp_path / "stock")
    chats = conversations(family)
    ours = _ours(stock, chats)
    # TRL swaps its training template in for the stock Qwen3 and Gemma-3 ones; it has none for Llama-3.1, Mistral
    # or the tiny one, so it is given the stock template with generation tags added (the same rendering).
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


def test_a_row_the_template_cannot_render_is_one_line_naming_it_in_its_batch(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["mistral"], tmp_path / "tok")
    two_users = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    good = conversations("mistral")[:2]
    for data_format, rows in (
        (chat.MESSAGES, [*good, two_users]),
        (chat.PROMPT_COMPLETION, [{"prompt": c[:-1], "completion": c[-1:]} for c in [*good, two_users]]),
    ):
        with pytest.raises(ConfigError) as raised:
            _encoder(tokenizer, data_format).encode(rows, lambda i: f"data.jsonl row {i}")
        line = str(raised.value)
        assert line.startswith("data.jsonl row 2: the chat template cannot render") and "alternate" in line
        assert "\n" not in line


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


# Contents a template may treat specially: ends it trims, its own markers, a role's name, what its own text begins
# with (the partial and whole renderings agree a while longer), markup.
TRICKY_CONTENTS = [
    "  padded  ",
    "line\n",
    "<think>\nSeven is odd.\n</think>\n\nYes.",
    "<tool_response>42</tool_response>",
    "user",
    "<thin ice>",
    "<b>bold</b>",
    "Assistant: again",
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


@pytest.mark.parametrize("family", ["qwen3", "llama3_1", "mistral", "gemma3", "tiny"])
def test_stock_masks_equal_return_assistant_tokens_mask_of_the_tagged_rendering(
    family: str, tmp_path
) -> None:
    """The prefix renders against the oracle transformers gives a template with generation tags, on the suite's
    conversations and generated ones with tricky contents: the same tokens, the same trained ones. Stock Qwen3
    drops an earlier turn's <think> block and Mistral moves the system message; both are aligned."""
    spec = FAMILIES[family]
    tokenizer = chat_tokenizer(spec, tmp_path / "tok")
    tagged = template_text(spec.tagged)
    chats = conversations(family) + _generated_conversations(random.Random(0), 150)
    for messages, mine in zip(chats, _ours(tokenizer, chats), strict=True):
        reference = tokenizer.apply_chat_template(
            messages, chat_template=tagged, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, trained = _without_appended_eos(mine, reference["input_ids"])
        assert (ids, trained) == (reference["input_ids"], reference["assistant_masks"]), messages


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")  # _name, not __future__ or __name__


def test_only_public_apis_of_other_libraries() -> None:
    """Chat tokenization goes through transformers' public apply_chat_template: no underscore name of another
    library (an upgrade may change or drop it without notice), no jinja2 of its own (no patched sandbox)."""
    import ast
    import inspect

    from model_utils.data import prompts

    for module in (chat, prompts):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
                assert not any(n.split(".")[0] == "jinja2" for n in names), (
                    f"{module.__name__} imports jinja2"
                )
                private = [n for n in names if any(map(_private, n.split(".")))]
                assert not private, f"{module.__name__} imports {private}: a private API of another library"
            if isinstance(node, ast.Attribute) and _private(node.attr):
                assert isinstance(node.value, ast.Name) and node.value.id == "self", (
                    f"{module.__name__} line {node.lineno} reads .{node.attr}: a private API of another library"
                )


# --- preference pairs -----------------------------------------------------------------------------------


def _our_pairs(tokenizer, rows: list[dict], **data) -> list[tuple]:
    """Each stored pair as (prompt ids, chosen answer ids, rejected answer ids), checking its layout: the chosen
    sequence then the rejected one, each starting a document, the answers trained on, nothing else stored."""
    encoded = _encoder(tokenizer, chat.PREFERENCE, **data).encode(rows, lambda i: f"row {i}")
    assert encoded.untrained == 0
    out = []
    for ids, flags in zip(encoded.ids, encoded.flags, strict=True):
        starts = np.flatnonzero(flags & chat.DOC_START)
        assert len(starts) == 2 and starts[0] == 0
        split = int(starts[1])
        trained = (flags & chat.TRAINED) != 0
        prompt = int(np.argmax(trained[:split]))
        for sequence in (trained[:split], trained[split:]):
            assert not sequence[:prompt].any() and sequence[prompt:].all()
        chosen, rejected = ids[:split].tolist(), ids[split:].tolist()
        assert chosen[:prompt] == rejected[:prompt]
        out.append((chosen[:prompt], chosen[prompt:], rejected[prompt:]))
    return out


def _pair_rows(eos: str) -> dict[str, list[dict]]:
    """Rows of each of TRL's preference formats."""
    user = [{"role": "user", "content": "What is two plus two?"}]
    system = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a fruit."},
    ]
    earlier = [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, three."},
        {"role": "user", "content": "And back?"},
    ]

    def said(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}]

    conversational = [
        {"prompt": user, "chosen": said("Four."), "rejected": said("Five, I think.")},
        {"prompt": system, "chosen": said("A cherry."), "rejected": said("  A stone.  ")},
        {"prompt": earlier, "chosen": said("Three, two, one."), "rejected": said("No.")},
    ]
    implicit = [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in conversational
    ]
    # one a prefix of the other: TRL's loop leaves the prompt one message short of the shorter
    implicit.append({"chosen": earlier[:2], "rejected": earlier + said("Three, two, one.")})
    standard = [
        {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon, I think."},
        {"prompt": "Two plus two equals ", "chosen": "four", "rejected": "five"},  # the space merges
        {"prompt": "Q: what color is the sky?\nA:", "chosen": f" Blue.{eos}", "rejected": " Green."},
    ]
    implicit_text = [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # the space goes with the answers
        {"chosen": "Paris is the capital.", "rejected": "Paris is a town"},
        {"chosen": "abc", "rejected": "abcd"},
    ]
    return {
        "conversational": conversational,
        "implicit": implicit,
        "standard": standard,
        "implicit_text": implicit_text,
    }


def _bos_adding(tokenizer):
    """The tokenizer with Llama 3's post-processor: its __call__ adds BOS (as TRL tokenizes text pairs)."""
    from tokenizers.processors import TemplateProcessing

    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    assert tokenizer("hi")["input_ids"][0] == tokenizer.bos_token_id
    return tokenizer


@pytest.mark.parametrize("family", ["tiny", "qwen3", "llama3_1"])
def test_pairs_tokenize_as_trls_dpo_trainer_in_each_format(family: str, tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES[family], tmp_path / "tok")
    if family == "llama3_1":
        tokenizer = _bos_adding(tokenizer)
    formats = _pair_rows(tokenizer.eos_token)
    reference = dpo_tokenized(tokenizer, list(formats.values()), tmp_path)
    for (name, rows), theirs in zip(formats.items(), reference, strict=True):
        assert _our_pairs(tokenizer, rows) == theirs, name
    if (
        family == "tiny"
    ):  # "Assistant: " alone ends in a space the answer's first token takes: TRL's prompt stops short
        prompt, chosen, _ = reference[0][0]
        assert tokenizer.decode(prompt).endswith("Assistant:") and tokenizer.decode(chosen).startswith(
            " Four."
        )
    if (
        family == "llama3_1"
    ):  # text pairs start with the BOS the tokenizer adds; conversations with the template's
        assert all(p[0] == tokenizer.bos_token_id for rows in reference for p, _, _ in rows)
        assert all(p.count(tokenizer.bos_token_id) == 1 for rows in reference for p, _, _ in rows)


def _no_answer_template(tmp_path) -> str:
    path = tmp_path / "no_answers.jinja"
    path.write_text(
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}\n{% endif %}{% endfor %}"
    )
    return str(path)


def _said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


BAD_PAIRS = [
    ({"prompt": "Q:", "chosen": 3, "rejected": " b"}, "'chosen' is int, not text or a list of messages"),
    ({"prompt": None, "chosen": " a", "rejected": " b"}, "'prompt' is null, not text or a list of messages"),
    ({"prompt": "Q:", "chosen": "  ", "rejected": " b"}, "'chosen' is empty"),
    ({"prompt": "Q:", "chosen": " b", "rejected": ""}, "'rejected' is empty"),
    ({"prompt": "Q:", "chosen": " same", "rejected": " same"}, "'chosen' and 'rejected' are identical"),
    (
        {"prompt": "Q:", "chosen": " same", "rejected": " same<|im_end|>"},
        "'chosen' and 'rejected' tokenize identically",
    ),
    (
        {"prompt": "Q:", "chosen": _said("a"), "rejected": _said("b")},
        "'prompt' is text and 'chosen' a list of messages",
    ),
    (
        {"prompt": [{"role": "user", "content": "Q"}], "chosen": _said(""), "rejected": _said("b")},
        "'chosen' message 0 is an empty assistant turn",
    ),
    (
        {"prompt": [{"role": "user", "content": "Q"}], "chosen": [], "rejected": _said("b")},
        "'chosen' is an empty list, not a list of messages",
    ),
    (
        {
            "chosen": [{"role": "user", "content": "Q"}, *_said("a")],
            "rejected": [{"role": "user", "content": "R"}, *_said("a")],
        },
        "'chosen' and 'rejected' share no prompt (they differ from their first message)",
    ),
    (
        {"chosen": "Yes.", "rejected": "No."},
        "'chosen' and 'rejected' share no prompt (they differ from their first character)",
    ),
    (
        {"chosen": "It is ", "rejected": "It is blue."},
        "'chosen' is empty past the prompt it shares with the other answer",
    ),
]


@pytest.mark.parametrize(("row", "wrong"), BAD_PAIRS)
def test_a_bad_pair_is_one_line_naming_the_row(row: dict, wrong: str, tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["qwen3"], tmp_path / "tok")
    good = {"prompt": "Q:", "chosen": " yes", "rejected": " no"}
    if "prompt" not in row:
        good = {"chosen": "Q: yes", "rejected": "Q: no"}
    with pytest.raises(ConfigError) as raised:
        _encoder(tokenizer, chat.PREFERENCE).encode([good, good, row], lambda i: f"prefs.jsonl line {i + 1}")
    line = str(raised.value)
    assert line.startswith(f"prefs.jsonl line 3: {wrong}") and "\n" not in line


def test_an_answer_the_template_renders_as_nothing_is_one_line(tmp_path) -> None:
    tokenizer = chat_tokenizer(FAMILIES["qwen3"], tmp_path / "tok")
    row = {"prompt": [{"role": "user", "content": "Q"}], "chosen": _said("a"), "rejected": _said("b")}
    encoder = _encoder(tokenizer, chat.PREFERENCE, chat_template=_no_answer_template(tmp_path))
    with pytest.raises(
        ConfigError, match=r"^f.jsonl line 1: the chosen answer adds no token to the prompt's"
    ):
        encoder.encode([row], lambda i: f"f.jsonl line {i + 1}")


def test_auto_reads_chosen_and_rejected_as_preference_pairs() -> None:
    line = "columns 'chosen' and 'rejected': --data_format preference (auto)"
    messages = [{"role": "user", "content": "a"}]
    for first, fields in (
        ({"prompt": "a", "chosen": "b", "rejected": "c"}, ("prompt", "chosen", "rejected")),
        ({"prompt": messages, "chosen": messages, "rejected": messages}, ("prompt", "chosen", "rejected")),
        ({"chosen": messages, "rejected": messages}, ("chosen", "rejected")),  # the prompt implicit
        ({"chosen": "a b", "rejected": "a c", "score": 1}, ("chosen", "rejected")),
    ):
        assert chat.decide_format(DataArgs(), first) == ("preference", fields, line)
    explicit = DataArgs(data_format="preference")
    assert chat.decide_format(explicit, {"chosen": "a", "rejected": "b"}) == (
        "preference",
        ("chosen", "rejected"),
        None,
    )
    assert chat.decide_format(explicit, None)[1] == ("prompt", "chosen", "rejected")  # S3: columns unknown
    assert chat.decide_format(DataArgs(), {"prompt": "a", "completion": "b"})[0] == "prompt_completion"
