"""The embedded default assets: a generated English-like corpus and its byte-level BPE tokenizer.

The "tiny-qwen3" preset has to train offline on a laptop, so its data and tokenizer ship inside the
package. Both are produced by code from fixed seeds (pure ``random.Random``, no external data, so no
licensing questions), which lets ``python tools/embedded_assets.py`` rebuild the committed files
byte-for-byte; the tests check exactly that.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

from model_utils.assets import ASSETS_DIR, CORPUS_PATH, TOKENIZER_DIR

# One special token doubles as EOS (document separator when packing) and as pad token: padded
# positions are masked out of the loss anyway, so a separate pad id would only waste a row.
EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 2048
DEFAULT_SEED = 0
DEFAULT_TARGET_BYTES = 2_500_000
# The training loader packs/chunks documents itself; the tokenizer must never truncate or warn.
MODEL_MAX_LENGTH = 1_000_000_000


# --------------------------------------------------------------------------------------------------
# Lexicon. Tuples (not sets) everywhere: iteration order must not depend on string hashing.


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_ONES = _words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen"
)
_TENS = _words("_ _ twenty thirty forty fifty sixty seventy eighty ninety")


def number_word(n: int) -> str:
    """English words for 0 <= n <= 999 ("forty-two", "one hundred forty-four")."""
    if n >= 100:
        hundreds, rest = divmod(n, 100)
        return f"{_ONES[hundreds]} hundred" + (f" {number_word(rest)}" if rest else "")
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] if ones == 0 else f"{_TENS[tens]}-{_ONES[ones]}"


@dataclass(frozen=True)
class Character:
    name: str
    kind: str  # "girl", "cat", ...
    he: str
    him: str
    his: str


def _nouns(text: str) -> tuple[tuple[str, str], ...]:
    """``"ball box:boxes"`` -> ``(("ball", "balls"), ("box", "boxes"))``: singular and plural forms."""
    pairs = (w.split(":") if ":" in w else (w, w + "s") for w in text.split())
    return tuple((one, many) for one, many in pairs)


# Word lists are long (the BPE trainer needs enough distinct words to fill 2048 tokens) but sampled
# with a Zipf-like bias (`_pick`), so most text uses the first few entries and is quickly learnable.
_GIRLS = _words(
    "Lily Mia Anna Sue Emma Lucy Kate Rose Ella Amy Nora Ruby Grace Sara Ivy Maya Zoë Renée Chloe Hannah "
    "Olivia Sophie Alice Jane Molly Daisy Clara Julia Nina Tess Bella Lena Hazel Iris Wendy Holly Fiona "
    "Greta Heidi Paula Rita Vera Wanda Yara Elsa Freya Gemma Jenny Laura Megan Naomi Penny Sally Tara "
    "Ursula Violet Willow Abby Betty Cora Dora Erin Flora Gina Helen Ingrid Joy Kira Lola Martha Nell"
)
_BOYS = _words(
    "Tom Ben Sam Max Leo Jack Tim Finn Noah Luke Jake Adam Oscar Henry Felix Hugo José Ethan Liam Owen "
    "Peter Danny Oliver Harry Simon Mark Toby Eric Ryan Victor Arthur Bruno Carl David Edgar Frank George "
    "Isaac Jonas Kevin Lewis Martin Nathan Otto Philip Quinn Robin Steve Theo Umar Walter Xavier Yusuf "
    "Zack Albert Boris Caleb Dylan Elliot Fred Gabe Ivan Joel Kurt Louis Miles Neil Omar Paul Rex Seth"
)
_ANIMALS = _nouns(
    "cat dog bird rabbit fox:foxes bear duck frog mouse:mice owl turtle squirrel horse pig lion monkey "
    "sheep:sheep goat cow elephant penguin bee fish:fish deer:deer wolf:wolves hen butterfly:butterflies "
    "snail kitten puppy:puppies tiger zebra giraffe camel hippo whale dolphin crab seal parrot donkey "
    "hedgehog beaver badger otter spider ant bat goose:geese swan crow robin lamb pony:ponies chick "
    "koala panda kangaroo raccoon mole lizard snake ladybug:ladybugs moose:moose"
)
_PLACES = _words(
    "park forest beach garden kitchen school river market farm hill library lake zoo playground "
    "village city meadow castle cave field pond shop bakery museum station harbor island mountain "
    "valley orchard attic barn yard street bridge tower jungle desert swamp lighthouse circus "
    "airport hospital theater greenhouse cellar treehouse classroom stable mill fountain square "
    "canyon glacier volcano waterfall cottage palace temple garage workshop"
)
_OBJECTS = _nouns(
    "ball kite hat box:boxes book cup key boat flower car drum shell stone bell balloon crayon blanket "
    "ribbon spoon map feather coin shoe bucket lamp puzzle robot doll train star ring leaf:leaves pencil "
    "basket whistle umbrella candle clock mirror wagon sled bottle button marble jar necklace scarf "
    "teapot trumpet violin guitar piano sword shield crown wand compass ladder rope hammer brush "
    "paintbrush backpack pillow sock glove jewel acorn pinecone seashell postcard envelope ticket "
    "lantern bicycle scooter helmet tent globe telescope magnet"
)
_FOODS = _nouns(
    "apple banana cookie orange sandwich:sandwiches cake egg carrot pear cherry:cherries muffin "
    "peach:peaches grape pie tomato:tomatoes potato:potatoes lemon plum strawberry:strawberries "
    "pancake cupcake donut pretzel cracker pepper onion melon mango:mangoes biscuit waffle pumpkin "
    "cucumber radish turnip berry:berries apricot coconut walnut peanut olive bagel noodle dumpling "
    "meatball taco burrito"
)
_COLORS = _words("red blue green yellow pink purple orange brown white black gray gold silver violet")
_SIZES = _words(
    "big small little tiny huge long short tall round soft shiny old new heavy light bright dark "
    "smooth fluffy sparkly wooden striped spotted"
)
_FEELINGS = _words(
    "happy sad scared angry tired excited surprised proud worried calm sleepy curious lonely grateful "
    "nervous cheerful grumpy jolly brave hopeful puzzled"
)
_ANIMAL_ADJS = _words(
    "friendly funny clever brave shy kind silly lazy busy gentle wise grumpy playful noisy quiet "
    "hungry sleepy curious polite proud clumsy speedy"
)
_WEATHER = _words("sunny rainy windy cold warm cloudy snowy foggy stormy hot chilly")
_HIDING = (
    "under the tree",
    "behind a rock",
    "next to the door",
    "in the tall grass",
    "under the bed",
    "near the water",
    "on the table",
    "inside an old box",
    "behind the fence",
    "under a big leaf",
    "on top of the shelf",
    "between two flowers",
    "beside the old well",
    "in a pile of leaves",
)
_CLOTHES = _words("coat hat scarf boots sweater jacket gloves dress shirt raincoat mittens pajamas cap")
_MATERIALS = _words("sand blocks sticks paper snow boxes stones leaves clay cardboard pillows branches")
_BUILT = _words("castle house tower boat bridge car rocket nest wall fort snowman sandcastle robot kite")
_ACTIVITIES = (
    "sing songs",
    "read books",
    "paint pictures",
    "bake cookies",
    "plant seeds",
    "climb trees",
    "ride bikes",
    "fly kites",
    "play games",
    "draw animals",
    "build towers",
    "dance",
    "swim",
    "jump rope",
    "collect shells",
    "tell jokes",
    "pick berries",
    "watch the clouds",
    "play hide and seek",
    "feed the ducks",
    "look at the stars",
    "skip stones",
    "make puppets",
    "water the flowers",
)
_DAYS = _words("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
_SEASONS = (
    ("spring", "was full of flowers"),
    ("summer", "was warm and bright"),
    ("autumn", "was covered in red and yellow leaves"),
    ("winter", "was white with snow"),
)
_PARENTS = (
    ("mom", "she"),
    ("dad", "he"),
    ("grandma", "she"),
    ("grandpa", "he"),
    ("aunt", "she"),
    ("uncle", "he"),
)
_OPENINGS = ("Once upon a time", "One day", "Long ago", "One morning", "One sunny day", "Once")
_FACTS = (
    ("the sky", "blue"),
    ("the grass", "green"),
    ("snow", "white"),
    ("the sun", "yellow"),
    ("a banana", "yellow"),
    ("an orange", "orange"),
    ("a lemon", "yellow"),
    ("coal", "black"),
    ("a strawberry", "red"),
    ("a carrot", "orange"),
    ("a frog", "green"),
    ("milk", "white"),
    ("chocolate", "brown"),
    ("the sea", "blue"),
    ("a cherry", "red"),
    ("a pig", "pink"),
    ("a tomato", "red"),
    ("a plum", "purple"),
    ("a crow", "black"),
    ("a polar bear", "white"),
)
_ANIMAL_SOUNDS = (
    ("cat", "meow"),
    ("dog", "woof"),
    ("cow", "moo"),
    ("duck", "quack"),
    ("sheep", "baa"),
    ("pig", "oink"),
    ("owl", "hoot"),
    ("lion", "roar"),
    ("frog", "croak"),
    ("bee", "buzz"),
    ("hen", "cluck"),
    ("mouse", "squeak"),
    ("horse", "neigh"),
    ("goat", "maa"),
    ("snake", "hiss"),
    ("wolf", "howl"),
)


T = TypeVar("T")


@cache
def _zipf_cum_weights(n: int) -> list[float]:
    return list(itertools.accumulate(1.0 / (i + 1) for i in range(n)))


def _pick(rng: random.Random, items: Sequence[T]) -> T:
    return rng.choices(items, cum_weights=_zipf_cum_weights(len(items)))[0]


def _an(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _character(rng: random.Random, exclude: Sequence[str] = ()) -> Character:
    """A named child or animal; ``exclude`` keeps two characters of one story apart."""
    while True:
        girl = rng.random() < 0.5
        name = _pick(rng, _GIRLS if girl else _BOYS)
        if name not in exclude:
            break
    if rng.random() < 0.75:
        kind = rng.choice(("girl", "little girl") if girl else ("boy", "little boy"))
    else:
        kind = _pick(rng, _ANIMALS)[0]
    if girl:
        return Character(name, kind, "she", "her", "her")
    return Character(name, kind, "he", "him", "his")


# --------------------------------------------------------------------------------------------------
# Stories: a hero, a friend, a place and an object stay fixed for a whole story, so names, pronouns
# and references are consistent and a model can learn to copy them from context.


@dataclass
class _Scene:
    hero: Character
    friend: Character
    place: str
    obj: tuple[str, str]
    color: str


def _episode_find(rng: random.Random, s: _Scene) -> str:
    h, o = s.hero, s.obj[0]
    return (
        f"{h.name} went to the {s.place}. There {h.he} found {_an(s.color)} {o} {rng.choice(_HIDING)}. "
        f"{_cap(h.he)} was very {_pick(rng, _FEELINGS)}. {_cap(h.he)} picked up the {o} and held it tight."
    )


def _episode_show(rng: random.Random, s: _Scene) -> str:
    h, f, o = s.hero, s.friend, s.obj[0]
    return (
        f'{h.name} ran to {f.name}. "Look at my {s.color} {o}!" {h.he} said. '
        f'"It is so {rng.choice(("pretty", "nice", "cool", "beautiful"))}," said {f.name}. '
        f'"Can I play with it?" {h.name} said, "Yes, we can play with it together."'
    )


def _episode_lose(rng: random.Random, s: _Scene) -> str:
    h, f, o = s.hero, s.friend, s.obj[0]
    cause = rng.choice(
        (
            f"the wind blew hard and the {o} flew away",
            f"the {o} fell into the water",
            f"{_an(_pick(rng, _ANIMALS)[0])} took the {o} and ran away",
            f"{h.he} dropped the {o} and it rolled away",
        )
    )
    lost = f"But then {cause}. {h.name} was sad. {_cap(h.he)} looked for the {o} everywhere."
    if rng.random() < 0.3:
        return f"{lost} At last, {h.he} found it {rng.choice(_HIDING)}. {h.name} was happy again."
    return (
        f"{lost} {f.name} saw that {h.name} was sad. {_cap(f.he)} said, "
        f'"Do not be sad, {h.name}. I will help you." '
        f"They looked {rng.choice(_HIDING)} and found the {s.color} {o}. "
        f'{h.name} smiled and said, "Thank you, {f.name}!"'
    )


def _episode_weather(rng: random.Random, s: _Scene) -> str:
    h = s.hero
    weather = _pick(rng, _WEATHER)
    return (
        f"The day was {weather}. {h.name} put on {h.his} {_pick(rng, _COLORS)} {_pick(rng, _CLOTHES)} "
        f"and went to the {s.place}."
    )


def _episode_eat(rng: random.Random, s: _Scene) -> str:
    h = s.hero
    parent, parent_he = _pick(rng, _PARENTS)
    food_one, food_many = _pick(rng, _FOODS)
    n = rng.randint(2, 6)
    return (
        f"{h.name} was hungry. {_cap(h.his)} {parent} gave {h.him} {number_word(n)} {food_many}. "
        f'{_cap(h.he)} ate every {food_one} and said, "Thank you, {parent}!" '
        f"{_cap(parent_he)} smiled."
    )


def _episode_meet(rng: random.Random, s: _Scene) -> str:
    h = s.hero
    animal = _pick(rng, _ANIMALS)[0]
    other = _character(rng, exclude=(h.name, s.friend.name))
    return (
        f"In the {s.place}, {h.name} met {_an(_pick(rng, _ANIMAL_ADJS))} {animal}. "
        f'The {animal} said, "Hello! My name is {other.name}." '
        f'{h.name} said, "Hello, {other.name}. Do you want to be my friend?" '
        f'"Yes!" said {other.name}.'
    )


def _episode_count(rng: random.Random, s: _Scene) -> str:
    h = s.hero
    one, many = _pick(rng, _ANIMALS + _OBJECTS)
    n = rng.randint(2, 12)
    return (
        f"{h.name} counted the {many} in the {s.place}. "
        f"There were {number_word(n)} {many if n > 1 else one}. "
        f'"{_cap(number_word(n))} {many}!" said {h.name}.'
    )


def _episode_build(rng: random.Random, s: _Scene) -> str:
    h, f = s.hero, s.friend
    thing = _pick(rng, _BUILT)
    return (
        f"{h.name} and {f.name} built {_an(thing)} out of {_pick(rng, _MATERIALS)}. "
        f"It was very {_pick(rng, _SIZES)}. They were proud of their {thing}."
    )


def _episode_walk(rng: random.Random, s: _Scene) -> str:
    h = s.hero
    new_place = _pick(rng, _PLACES)
    animal = _pick(rng, _ANIMALS)[0]
    line = (
        f"{h.name} walked from the {s.place} to the {new_place}. "
        f"On the way, {h.he} saw {_an(_pick(rng, _SIZES))} {animal}."
    )
    s.place = new_place
    return line


def _episode_sleep(rng: random.Random, s: _Scene) -> str:
    h = s.hero
    return (
        f"At night, {h.name} was {rng.choice(('tired', 'sleepy'))}. {_cap(h.he)} went to bed "
        f"and dreamed about the {s.color} {s.obj[0]}."
    )


def _episode_hobby(rng: random.Random, s: _Scene) -> str:
    h, f = s.hero, s.friend
    activity = _pick(rng, _ACTIVITIES)
    return (
        f"{h.name} and {f.name} liked to {activity}. Every {rng.choice(_DAYS)}, they would {activity} "
        f'in the {s.place}. {h.name} said, "I love to {activity} with you, {f.name}."'
    )


def _episode_season(rng: random.Random, s: _Scene) -> str:
    h = s.hero
    season, looks = rng.choice(_SEASONS)
    return (
        f"It was {season}, and the {s.place} {looks}. "
        f"{h.name} loved the {season} because {h.he} could {_pick(rng, _ACTIVITIES)}."
    )


_EPISODES: tuple[Callable[[random.Random, _Scene], str], ...] = (
    _episode_find,
    _episode_show,
    _episode_lose,
    _episode_weather,
    _episode_eat,
    _episode_meet,
    _episode_count,
    _episode_build,
    _episode_walk,
    _episode_sleep,
    _episode_hobby,
    _episode_season,
)


def _new_scene(rng: random.Random, hero: Character | None = None, friend: Character | None = None) -> _Scene:
    hero = hero or _character(rng)
    friend = friend or _character(rng, exclude=(hero.name,))
    return _Scene(hero, friend, _pick(rng, _PLACES), _pick(rng, _OBJECTS), _pick(rng, _COLORS))


def _story_body(rng: random.Random, s: _Scene, n_episodes: int, intro: bool = True) -> list[str]:
    h, f = s.hero, s.friend
    if intro:
        opening = (
            f"{rng.choice(_OPENINGS)}, there was {_an(h.kind)} named {h.name}. "
            f"{_cap(h.he)} liked to play in the {s.place}. "
            f"{_cap(h.his)} best friend was {_an(f.kind)} named {f.name}."
        )
    else:
        opening = f"{rng.choice(_OPENINGS)}, {h.name} and {f.name} went to the {s.place}."
    parts = [opening] + [rng.choice(_EPISODES)(rng, s) for _ in range(n_episodes)]
    parts.append(
        rng.choice(
            (
                f"From that day on, {h.name} and {f.name} were best friends.",
                f"{h.name} learned that it is good to share.",
                f"{h.name} and {f.name} played in the {s.place} until the sun went down.",
                f"{h.name} was happy, and {h.he} kept the {s.color} {s.obj[0]} forever.",
            )
        )
    )
    return parts


def _story(rng: random.Random) -> str:
    return " ".join(_story_body(rng, _new_scene(rng), rng.randint(1, 10)))


def _storybook(rng: random.Random) -> str:
    """A long document (several thousand tokens): many chapters about the same hero and friend."""
    first = _new_scene(rng)
    chapters = []
    for i in range(rng.randint(14, 24)):
        scene = first if i == 0 else _new_scene(rng, first.hero, first.friend)
        body = " ".join(_story_body(rng, scene, rng.randint(4, 8), intro=i == 0))
        chapters.append(f"Chapter {number_word(i + 1)}.\n\n{body}")
    return f"The Adventures of {first.hero.name}\n\n" + "\n\n".join(chapters) + "\n\nThe end."


# --------------------------------------------------------------------------------------------------
# Other document kinds: exact facts (arithmetic, colors, sounds) are the most learnable signal.


_SYMBOLS = {"plus": "+", "minus": "-", "times": "x"}


def _arithmetic_fact(rng: random.Random, digits: bool = False) -> str:
    """A true fact, "seven plus five is twelve." or "7 + 5 = 12"."""
    op = rng.choice(("plus", "minus", "times"))
    if op == "plus":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        c = a + b
    elif op == "minus":
        c, b = rng.randint(0, 20), rng.randint(0, 20)
        a = b + c
    else:
        a, b = rng.randint(1, 12), rng.randint(1, 12)
        c = a * b
    if digits:
        return f"{a} {_SYMBOLS[op]} {b} = {c}"
    return f"{number_word(a)} {op} {number_word(b)} is {number_word(c)}."


def _arithmetic(rng: random.Random) -> str:
    h = _character(rng)
    digits = rng.random() < 0.4
    facts = [_arithmetic_fact(rng, digits) for _ in range(rng.randint(10, 50))]
    lines = [f"{h.name} is learning math. {_cap(h.he)} writes down some facts.", *map(_cap, facts)]
    lines.append(rng.choice((f"{h.name} got them all right!", "Math is fun.", f"{_cap(h.he)} was proud.")))
    return "\n".join(lines)


def _times_table(rng: random.Random) -> str:
    n = rng.randint(2, 12)
    rows = [f"{i} x {n} = {i * n}" for i in range(1, 13)]
    words = [f"{_cap(number_word(i))} times {number_word(n)} is {number_word(i * n)}." for i in range(1, 9)]
    return f"The {number_word(n)} times table\n\n" + "\n".join(rows) + "\n\n" + " ".join(words)


def _counting(rng: random.Random) -> str:
    start = rng.randint(0, 30)
    stop = start + rng.randint(30, 70)
    step = rng.choice((1, 1, 1, 2, 5, 10)) if stop <= 100 else 1
    nums = [number_word(n) for n in range(start, min(stop, 100) + 1, step)]
    h = _character(rng)
    return f"{h.name} can count. Listen: {', '.join(nums)}. {_cap(h.he)} counted to {nums[-1]}!"


def _qa(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(6, 30)):
        kind = rng.random()
        if kind < 0.4:
            thing, color = rng.choice(_FACTS)
            lines += [f"Q: What color is {thing}?", f"A: {_cap(thing)} is {color}."]
        elif kind < 0.7:
            animal, sound = rng.choice(_ANIMAL_SOUNDS)
            lines += [f"Q: What does {_an(animal)} say?", f'A: {_cap(_an(animal))} says "{sound}".']
        else:
            fact = _arithmetic_fact(rng)  # "<question> is <answer>."
            lines += [f"Q: What is {fact.split(' is ')[0]}?", f"A: {_cap(fact)}"]
    return "\n".join(lines)


def _dialogue(rng: random.Random) -> str:
    s = _new_scene(rng)
    h, f, o = s.hero, s.friend, s.obj[0]
    lines = [f"{h.name} and {f.name} are talking."]
    for _ in range(rng.randint(2, 8)):
        place = _pick(rng, _PLACES)
        one, many = _pick(rng, _OBJECTS)
        n = rng.randint(1, 9)
        feel_f, feel_h = _pick(rng, _FEELINGS), _pick(rng, _FEELINGS)
        lines += rng.choice(
            (
                [
                    f"{h.name}: Where is my {s.color} {o}?",
                    f"{f.name}: Your {s.color} {o} is in the {place}.",
                    f"{h.name}: Thank you, {f.name}!",
                ],
                [
                    f"{f.name}: How many {many} do you have?",
                    f"{h.name}: I have {number_word(n)} {one if n == 1 else many}.",
                    f"{f.name}: That is a lot of {many}!" if n > 4 else f"{f.name}: Can I have one?",
                ],
                [
                    f"{h.name}: How do you feel today?",
                    f"{f.name}: I feel {feel_f}. How about you?",
                    f"{h.name}: I feel {feel_h} too." if feel_h == feel_f else f"{h.name}: I feel {feel_h}.",
                ],
                [
                    f"{f.name}: Do you want to go to the {place}?",
                    f"{h.name}: Yes! Let us go to the {place} and play.",
                ],
            )
        )
    lines.append(f"{h.name} and {f.name} went to play.")
    return "\n".join(lines)


def _shopping(rng: random.Random) -> str:
    h = _character(rng)
    items = []
    for _ in range(rng.randint(5, 15)):
        one, many = _pick(rng, _FOODS)
        n = rng.randint(1, 9)
        items.append(f"- {number_word(n)} {one if n == 1 else many}")
    return (
        f"{h.name} went to the market with {h.his} {_pick(rng, _PARENTS)[0]}. "
        f"This is {h.his} shopping list:\n"
        + "\n".join(items)
        + f"\n{_cap(h.he)} bought everything on the list."
    )


_DOC_KINDS: tuple[tuple[float, Callable[[random.Random], str]], ...] = (
    (0.52, _story),
    (0.08, _arithmetic),
    (0.03, _times_table),
    (0.11, _dialogue),
    (0.08, _qa),
    (0.07, _shopping),
    (0.06, _counting),
    (0.05, _storybook),
)


def generate_corpus(seed: int = DEFAULT_SEED, target_bytes: int = DEFAULT_TARGET_BYTES) -> list[str]:
    """Deterministic English-like documents totalling about ``target_bytes`` of UTF-8 text.

    Mostly 50-400 word stories and exercises; a few percent are multi-chapter storybooks longer than
    2000 tokens so that tests can check long documents are not truncated.
    """
    rng = random.Random(seed)
    cum_weights = list(itertools.accumulate(w for w, _ in _DOC_KINDS))
    docs: list[str] = []
    total = 0
    while total < target_bytes:
        kind = rng.choices(_DOC_KINDS, cum_weights=cum_weights)[0][1]
        doc = kind(rng)
        docs.append(doc)
        total += len(doc.encode("utf-8"))
    return docs


def write_corpus(path: Path = CORPUS_PATH, seed: int = DEFAULT_SEED) -> Path:
    """Write the corpus as JSON Lines (``{"text": ...}``), byte-for-byte reproducible."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for text in generate_corpus(seed):
            f.write(json.dumps({"text": text}, ensure_ascii=False, sort_keys=True) + "\n")
    return path


def build_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a GPT-2/Qwen-style byte-level BPE on ``texts``.

    No BOS token and no post-processor: ``tokenizer(text)`` returns only the text's tokens, and the
    data pipeline appends ``<|endoftext|>`` (EOS, also used as pad) between documents.
    """
    # Imported here so that reading the asset paths does not pay for importing transformers.
    # BpeTrainer breaks count ties deterministically, with or without Rayon threads (checked across
    # processes; tests compare a fresh build against the committed tokenizer.json).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x
    )


def write_tokenizer(out_dir: Path = TOKENIZER_DIR, seed: int = DEFAULT_SEED) -> Path:
    """Build the tokenizer from the default corpus and save it (tokenizer.json + config)."""
    out_dir = Path(out_dir)
    build_tokenizer(generate_corpus(seed)).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the embedded corpus and tokenizer.")
    parser.add_argument("--out-dir", type=Path, default=ASSETS_DIR, help="directory to write the assets to")
    args = parser.parse_args(argv)
    corpus = write_corpus(args.out_dir / CORPUS_PATH.name)
    tokenizer_dir = write_tokenizer(args.out_dir / TOKENIZER_DIR.name)
    print(f"wrote {corpus} and {tokenizer_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
