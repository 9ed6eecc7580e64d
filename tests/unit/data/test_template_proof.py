"""The proof that lets a conversation's spans and text come from its shape's placeholder renderings without
rendering it (model_utils/data/template_proof.py): the stock templates are proven; a template that reads a content
in a way the guard does not cover is not, and its conversations still get the text and spans of their own
renderings, where a proof taken for granted would give others."""

from __future__ import annotations

import pytest

from model_utils.assets import CHAT_TEMPLATE_PATH
from model_utils.data import chat
from support.chat_data import FAMILIES, conversations, template_text

SHAPES = [
    ("user", "assistant"),
    ("system", "user", "assistant"),
    ("user", "assistant", "user", "assistant"),
    ("system", "user", "assistant", "user", "assistant", "user", "assistant"),
]


def _conversation(shape: tuple[str, ...], contents: list[str]) -> list[dict]:
    return [{"role": role, "content": contents[k % len(contents)]} for k, role in enumerate(shape)]


def _skeleton(renderer: chat.Renderer, shape: tuple[str, ...]):
    assistant = [i for i, role in enumerate(shape) if role == "assistant"]
    return renderer._skeleton(shape, assistant)


@pytest.mark.parametrize(
    ("template", "variables"),
    [
        pytest.param(
            template_text(f.template),
            {"bos_token": f.bos or "", "eos_token": f.eos, **thinking},
            id=f"{name}{tag}",
        )
        for name, f in FAMILIES.items()
        for tag, thinking in (("", {}), ("-no-thinking", {"enable_thinking": False}))
        if name == "qwen3" or not thinking
    ]
    + [pytest.param(CHAT_TEMPLATE_PATH.read_text(), {"eos_token": "</s>"}, id="tiny")],
)
def test_the_stock_templates_are_proven_for_every_shape(template: str, variables: dict) -> None:
    renderer = chat.Renderer(template, variables)
    for shape in SHAPES:
        skeleton = _skeleton(renderer, shape)
        assert skeleton is not None and skeleton.proven, (shape, renderer._proof and renderer._proof.unproven)


# Each template reads a content where the guard does not look, and the contents render differently there.
UNPROVEN = {
    "length": "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.content|length > 8 %}(long){% endif %}\n"
    "{% endfor %}",
    "index": "{% for m in messages %}{{ m.role }}:{{ m.content }}[{{ m.content[0] }}]\n{% endfor %}",
    "upper": "{% for m in messages %}{{ m.role }}:{{ m.content|upper }}\n{% endfor %}",
    "joined-then-trimmed": "{% set t = 'x ' %}{% for m in messages %}{% set x = m.role ~ ':' ~ m.content ~ '  x' %}"
    "{{ x|trim(t) }}\n{% endfor %}",
    "tojson": "{% for m in messages %}{{ m.role }}:{{ m.content|tojson }}\n{% endfor %}",
    "map-join": "{{ messages|map(attribute='content')|join|length }}{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "\n{% endfor %}",
    "characters": "{% for m in messages %}{{ m.role }}:{% for c in m.content %}{{ c }}.{% endfor %}\n{% endfor %}",
    "replace": "{% set h = 'h' %}{% for m in messages %}{{ m.role }}:{{ m.content.replace(h, 'H') }}\n{% endfor %}",
    "split-words": "{% for m in messages %}{{ m.role }}:{{ m.content }}{{ m.content.split()|length }}\n{% endfor %}",
    "two-contents": "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.content == messages[0].content %}="
    "{% endif %}\n{% endfor %}",
    "format": "{% for m in messages %}{{ m.role }}:{{ '%-12s|' | format(m.content) }}\n{% endfor %}",
    "percent": "{% for m in messages %}{{ m.role }}:{{ '%.3s' % m.content }}\n{% endfor %}",
    "ordering": "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.content < 'm' %}<{% endif %}\n"
    "{% endfor %}",
    "computed-marker": "{% set p = 'lo' ~ 'ng' %}{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% if m.content.startswith(p) %}!{% endif %}\n{% endfor %}",
    "in-a-variable": "{% set text = 'a long answer' %}{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% if m.content in text %}?{% endif %}\n{% endfor %}",
    "macro": "{% macro size(x) %}{{ x|length }}{% endmacro %}{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{{ size(m.content) }}\n{% endfor %}",
    "set-block": "{% for m in messages %}{% set x %}{{ m.content }}{% endset %}{{ m.role }}:{{ x }}{{ x|length }}\n"
    "{% endfor %}",
    "message-json": "{% for m in messages %}{{ m|tojson }}\n{% endfor %}",
    "items": "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v|length }};{% endfor %}\n{% endfor %}",
    "wordcount": "{% for m in messages %}{{ m.role }}:{{ m.content }}{{ m.content|wordcount }}\n{% endfor %}",
    "markup": "{% for m in messages %}{{ m.role }}:{{ '<b>'|safe + m.content }}\n{% endfor %}",
    "is-lower": "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.content is lower %}_{% endif %}\n"
    "{% endfor %}",
}
GENERATION = "{% if add_generation_prompt %}assistant:{% endif %}"
CONTENTS = [
    ["hi", "ok"],
    ["a long answer", "short"],
    ["long story here", "Yes, said A"],
    ["zebra", "apple pie"],
    ["box", 'say "hi"'],
]


class _AlwaysChecked(dict):
    def get(self, key, default=None):
        return chat.CHECKED_PER_SHAPE


@pytest.mark.parametrize("name", sorted(UNPROVEN))
def test_a_template_reading_contents_unguarded_is_not_proven_and_renders_each_conversation(name: str) -> None:
    template = UNPROVEN[name] + GENERATION
    ours, every_prefix, taken_for_granted = (chat.Renderer(template, {}) for _ in range(3))
    every_prefix.by_shape = False
    # what a proof that let everything through would give, without the checks of a shape's first conversations
    taken_for_granted._proven = lambda *args: True
    taken_for_granted.checked = _AlwaysChecked()
    wrong = 0
    for contents in CONTENTS * 2:  # past the first conversations of a shape, which are checked
        for shape in SHAPES[:2]:
            messages = _conversation(shape, contents)
            expected = every_prefix.spans(messages)
            assert ours.spans(messages) == expected, (messages, ours._proof and ours._proof.unproven)
            wrong += taken_for_granted.spans(messages) != expected
    assert not any(s.proven for s in ours.skeletons.values() if s), name
    assert wrong, "these contents would not show a wrong proof"


def test_a_guarded_read_is_proven_and_exact() -> None:
    """What the guard covers is proven: a strip of characters it keeps off the ends, a search for and a split at
    a marker it keeps out, a comparison with a text it keeps contents from equalling or being inside; contents
    that have those render by their own renderings."""
    template = (
        "{% for m in messages %}{{ m.role }}:{% set c = m.content.strip('x') %}"
        "{% if '#' in c %}{% set c = c.split('#')[-1] %}{% endif %}{{ c }}"
        "{% if c in 'yes no' or c == 'maybe' %}?{% endif %}{% if c.endswith('!!') %}!{% endif %}\n{% endfor %}"
        + GENERATION
    )
    ours, every_prefix = chat.Renderer(template, {}), chat.Renderer(template, {})
    every_prefix.by_shape = False
    for contents in [
        ["hi", "ok"],
        ["xhix", "a#b"],
        ["no", "maybe"],
        ["es", "wow!!"],
        ["\u00a0pad", "ok\u3000"],
    ] * 2:
        for shape in SHAPES:
            messages = _conversation(shape, contents)
            assert ours.spans(messages) == every_prefix.spans(messages), messages
    assert all(s.proven for s in ours.skeletons.values()), ours._proof.unproven
    assert ours.by_shape


def test_a_content_starting_with_a_unicode_space_is_not_taken_for_its_placeholder() -> None:
    """`trim` strips every Unicode space (a no-break space, an ideographic one), not only the ASCII ones."""
    renderer = chat.Renderer(template_text("gemma3.jinja"), {"bos_token": "<bos>", "eos_token": "<eos>"})
    assert renderer.guard.passes("hello")
    assert not renderer.guard.passes("\u00a0hello")
    assert not renderer.guard.passes("hello\u3000")


def test_lipsum_is_not_proven() -> None:
    template = "{% for m in messages %}{{ m.role }}:{{ m.content }}{{ lipsum(1) }}\n{% endfor %}" + GENERATION
    renderer = chat.Renderer(template, {})
    skeleton = _skeleton(renderer, ("user", "assistant"))
    assert skeleton is not None and not skeleton.proven
    assert "lipsum" in renderer._proof.unproven


def test_the_suites_conversations_render_as_transformers_renders_them_by_proof() -> None:
    """The qwen3 conversations of the suite (reasoning fields, tool turns, whitespace) through a proven template:
    text and spans equal those of every prefix rendered."""
    spec = FAMILIES["qwen3"]
    variables = {"eos_token": spec.eos}
    ours, every_prefix = (
        chat.Renderer(template_text(spec.template), variables),
        chat.Renderer(template_text(spec.template), variables),
    )
    every_prefix.by_shape = False
    for messages in conversations("qwen3") * 3:
        messages = chat._clean(messages)
        assert ours.spans(messages) == every_prefix.spans(messages)
    assert any(s is not None and s.proven for s in ours.skeletons.values())
