"""The shipped example preference pairs (src/model_utils/assets/tiny_preferences.jsonl): 64 short questions in
TRL's conversational preference format ({"prompt": messages, "chosen": [assistant], "rejected": [assistant]}),
written from the word lists of tools/example_conversations.py and a fixed seed (no external data), regenerated
byte for byte by `python tools/example_preferences.py`; a test checks exactly that.

The chosen answer is the right one, in the shipped conversations' style ("Two plus four is six."); the rejected
one is always wrong and always in one other style ("um, i think two plus four is nine"): a preference a tiny model
fine-tuned on the conversations learns in a few dozen DPO steps."""

from __future__ import annotations

import random

from example_conversations import _ANIMALS, _COLORS, _NUMBERS, _SYSTEMS, render
from model_utils.assets import PREFERENCES_PATH

SEED = 0
COUNT = 64
_WORDS = ["cat", "sun", "tree", "book", "milk", "bird"]


def _wrong(rng: random.Random, right: str, choices: list[str]) -> str:
    return rng.choice([c for c in choices if c != right])


def _sum(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randrange(7), rng.randrange(6)
    wrong = _wrong(rng, _NUMBERS[a + b], _NUMBERS)
    return (
        f"What is {_NUMBERS[a]} plus {_NUMBERS[b]}?",
        f"{_NUMBERS[a].capitalize()} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}.",
        f"um, i think {_NUMBERS[a]} plus {_NUMBERS[b]} is {wrong}",
    )


def _color(rng: random.Random) -> tuple[str, str, str]:
    thing = rng.choice(sorted(_COLORS))
    wrong = _wrong(rng, _COLORS[thing], sorted(set(_COLORS.values())))
    return (
        f"What color is {thing}?",
        f"{thing[0].upper() + thing[1:]} is {_COLORS[thing]}.",
        f"um, i think {thing} is {wrong}",
    )


def _animal(rng: random.Random) -> tuple[str, str, str]:
    animal = rng.choice(sorted(_ANIMALS))
    wrong = _wrong(rng, _ANIMALS[animal], sorted(_ANIMALS.values()))
    return (
        f"What does a {animal} say?",
        f"A {animal} says {_ANIMALS[animal]}.",
        f"um, i think a {animal} says {wrong}",
    )


def _spell(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(_WORDS)
    letters = list(word.upper())
    rng.shuffle(letters)
    if letters == list(word.upper()):
        letters.reverse()
    return (
        f"How do you spell {word}?",
        f"{word.capitalize()} is spelled {'-'.join(word.upper())}.",
        f"um, i think {word} is spelled {'-'.join(letters)}",
    )


_TOPICS = (_sum, _color, _animal, _spell)


def preferences(seed: int = SEED, count: int = COUNT) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = []
        if rng.random() < 0.25:
            prompt.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        if rng.random() < 0.25:  # an earlier exchange, answered well
            question, answer, _ = rng.choice(_TOPICS)(rng)
            prompt += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        question, chosen, rejected = rng.choice(_TOPICS)(rng)
        prompt.append({"role": "user", "content": question})
        rows.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return rows


def main() -> None:
    PREFERENCES_PATH.write_text(render(preferences()))
    print(f"wrote {PREFERENCES_PATH}")


if __name__ == "__main__":
    main()
