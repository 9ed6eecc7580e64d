"""--sources / the run file's `data.sources:` list: several datasets trained as one weighted mixture.

Two spellings of one list. The run file's, every key of a single dataset available per source:

    data:
      sources:
        - {name: web, dataset: data/web-prepared, share: 0.7}
        - {name: code, dataset: data/code.jsonl, share: 0.3, max_repeat: 2, text_field: content}

and the flag's, compact (or that list as JSON, when a source needs more than its path):

    --sources 'web=data/web-prepared@0.7,code=data/code.jsonl@0.3x2'

An entry is NAME=DATASET@SHARE, optionally xMAX_REPEAT. It is read unambiguously: the name runs to the first '=',
the share (and repeat) start after the last '@', and entries are split on ','; a dataset whose path holds a ',' or
an '@' is written in the JSON form. The config keeps the text as given (frozen, printable, written back by
`dskit config --format yaml`); `parse` reads it, and the mixture (data/mixture.py) decides what the shares and
repeats mean.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from model_utils.errors import ConfigError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")  # names metric keys (val_loss/NAME, share/NAME)
_SHARE = re.compile(r"(?P<share>[0-9.eE+-]+)(?:x(?P<repeat>[0-9.eE+-]+))?")
REQUIRED = ("name", "dataset", "share")
FORMS = (
    "NAME=DATASET@SHARE[xMAX_REPEAT],... (e.g. web=data/web@0.7,code=data/code.jsonl@0.3x2) or a JSON list of "
    '{"name", "dataset", "share", "max_repeat", and any data key of a single dataset}'
)


@dataclass(frozen=True)
class SourceSpec:
    """One source of a mixture: its name, dataset, target share (not yet normalised), the most times its blocks
    may repeat per epoch on average, and its own values of the other data keys (the rest come from the data
    section)."""

    name: str
    dataset: str
    share: float
    max_repeat: float = 1.0
    options: tuple[tuple[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dataset": self.dataset,
            "share": self.share,
            "max_repeat": self.max_repeat,
            **dict(self.options),
        }


def _bad(what: str, fix: str) -> ConfigError:
    return ConfigError(f"--sources: {what}: fix: {fix}")


def _number(value: Any, key: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _bad(f"source {name!r} has {key} {value!r}, not a number", f"give {key} as a number")
    try:
        number = float(value)
    except ValueError:
        raise _bad(f"source {name!r} has {key} {value!r}, not a number", f"give {key} as a number") from None
    if not math.isfinite(number) or number <= 0:
        fix = "give it a positive share (shares are normalised to sum to 1)"
        if key == "max_repeat":
            fix = "use 1 for no repetition, 2 to allow each block twice per epoch"
        raise _bad(f"source {name!r} has {key} {value}, not a positive number", fix)
    return number


def _compact(text: str) -> list[dict[str, Any]]:
    entries = []
    for entry in text.split(","):
        name, equals, rest = entry.strip().partition("=")
        dataset, at, numbers = rest.rpartition("@")
        match = _SHARE.fullmatch(numbers.strip())
        if not equals or not at or not dataset.strip() or match is None:
            raise _bad(
                f"entry {entry.strip()!r} is not NAME=DATASET@SHARE[xMAX_REPEAT]",
                f"write {FORMS}; a path with ',' or '@' goes in the JSON form",
            )
        entry_dict: dict[str, Any] = {
            "name": name.strip(),
            "dataset": dataset.strip(),
            "share": match["share"],
        }
        if match["repeat"] is not None:
            entry_dict["max_repeat"] = match["repeat"]
        entries.append(entry_dict)
    return entries


@functools.lru_cache(maxsize=16)
def parse(text: str, options: tuple[str, ...]) -> tuple[SourceSpec, ...]:
    """The sources of a --sources value; `options`: the data keys a source may set for itself. ConfigError, one
    line, on anything else."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            raw = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise _bad(f"not valid JSON ({e.msg} at character {e.pos})", f"write {FORMS}") from None
    else:
        raw = _compact(stripped) if stripped else []
    return entries(raw, options)


def entries(raw: Any, options: tuple[str, ...]) -> tuple[SourceSpec, ...]:
    """The sources of a list of mappings (the JSON form, the run file's list), checked."""
    if not isinstance(raw, list) or not raw:
        raise _bad("no sources given", f"write {FORMS}")
    known = (*REQUIRED, "max_repeat", *options)
    specs: list[SourceSpec] = []
    for position, item in enumerate(raw, 1):
        if not isinstance(item, dict):
            raise _bad(f"source {position} is a {type(item).__name__}, not a mapping", f"write {FORMS}")
        name = str(item.get("name", f"#{position}"))
        for key in item:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
                hint = f"did you mean {close[0]}?" if close else f"use {', '.join(known)}"
                raise _bad(f"source {name!r} has an unknown key {key!r}", hint)
        missing = [key for key in REQUIRED if item.get(key) in (None, "")]
        if missing:
            raise _bad(
                f"source {name!r} has no {' or '.join(missing)}", f"give each source {', '.join(REQUIRED)}"
            )
        if not isinstance(item["name"], str) or not NAME.fullmatch(item["name"]):
            raise _bad(
                f"source name {item['name']!r} is not a short name of letters, digits, '_', '.', '-'",
                "name it like web or code_v2 (it names the source's metrics)",
            )
        if any(spec.name == item["name"] for spec in specs):
            raise _bad(f"two sources are named {item['name']!r}", "give each source its own name")
        specs.append(
            SourceSpec(
                name=item["name"],
                dataset=str(item["dataset"]),
                share=_number(item["share"], "share", name),
                max_repeat=_number(item.get("max_repeat", 1.0), "max_repeat", name),
                options=tuple(sorted((k, v) for k, v in item.items() if k in options and v is not None)),
            )
        )
    return tuple(specs)


def run_file_value(value: Any, options: tuple[str, ...]) -> str:
    """The run file's `data.sources:` (a list of mappings, or the flag's text) as the config keeps it: text."""
    if isinstance(value, str):
        parse(value, options)
        return value
    specs = entries(value, options)
    return json.dumps([spec.to_dict() for spec in specs])
