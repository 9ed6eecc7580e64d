"""Run files: `--config run.yaml`, the training flags as YAML sections, with DeepSpeed's config embedded.

    model: {model: Qwen/Qwen3-0.6B}
    data: {dataset: data/train.parquet, seq_length: 1024}
    optim: {lr: 2.0e-5, gradient_accumulation_steps: 8}
    loop: {epochs: 3}
    deepspeed:                     # a mapping replaces the JSON file; a string names one (like --deepspeed_config)
      zero_optimization: {stage: 3}

Each section holds the flags of that section of the config tree (arguments.SECTIONS); a key is checked like a
flag: an unknown or misplaced one is an error naming the closest valid key and its section. A null value means
"not given". Values are converted by the field's type, so PyYAML's YAML 1.1 strings for numbers without a dot
(`5e8`, `1e-4`) become numbers, and inside `deepspeed:` such strings become numbers too: DeepSpeed never sees a
number as a string. Flags on the command line override the file.

The YAML is read strictly (`load_yaml`, shared with `dskit sagemaker`'s values file): a key given twice, a
non-finite number or one past LARGEST_NUMBER, aliases that expand past MAX_NODES, and bytes that are not UTF-8
are each refused in one line naming the file and line, instead of the last key silently winning or a 3 GB
expansion.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils.errors import ConfigError

DEEPSPEED = "deepspeed"
# A number PyYAML (YAML 1.1) leaves as a string: an exponent without a dot in the mantissa, e.g. 5e8, 1e-4.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
# No count, size or rate in a run comes near this (DeepSpeed's bucket sizes are ~1e9); past it a value is a typo
# (max_steps: 1e30), and as an int it would overflow the C longs that torch and DeepSpeed keep counts in.
LARGEST_NUMBER = 1e15
# Nodes of a file with its aliases expanded: a real run file has a few hundred; an alias bomb has billions.
MAX_NODES = 100_000


@dataclass(frozen=True)
class RunFile:
    path: str
    values: dict[str, Any]  # flag name -> value, for the keys given (not null)
    deepspeed: dict[str, Any] | None  # an embedded DeepSpeed config


def _closest(name: str, options: list[str]) -> str | None:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return close[0] if close else None


def _number(value: str) -> int | float | None:
    if not _EXPONENT_NUMBER.fullmatch(value.strip()):
        return None
    number = float(value)
    return int(number) if number.is_integer() and "." not in value.split("e")[0].lower() else number


def value_kinds(hint: Any) -> tuple[list[Any], tuple[str, ...]]:
    """A field's value types (None left out) and the words it takes besides a count: `int | str` is a count or
    'auto' (--micro_batch_size), `int | Literal["all"]` a count or 'all' (--validation_batches)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    words = tuple(w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a))
    args = [a for a in args if typing.get_origin(a) is not typing.Literal]
    if set(args) == {int, str}:
        return [int], ("auto",)
    return args, words


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def typed(hint: Any, value: Any, where: str) -> Any:
    """`value` as the field's type (int, float, bool, str, a count or a word, optional of these)."""
    args, words = value_kinds(hint)
    names = [a.__name__ for a in args] + [repr(w) for w in words]
    bad = ConfigError(f"{where}: {value!r} is not a valid {' or '.join(names)}: fix the value")
    if words and isinstance(value, str) and value.strip().lower() in words:
        return value.strip().lower()
    base = args[0]
    if base is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if base in (int, float):
        if isinstance(value, bool):
            raise bad
        if isinstance(value, str):
            parsed = _number(value)
            if parsed is None:
                try:
                    parsed = base(value)
                except ValueError:
                    raise bad from None
            value = parsed
        if not isinstance(value, int | float):
            raise bad
        if not math.isfinite(value) or abs(value) > LARGEST_NUMBER:  # 'inf', 'nan', '1e400' as text
            raise ConfigError(
                f"{where}: {value!r} is not a finite number up to {LARGEST_NUMBER:.0e}: fix the value"
            )
        if base is int and isinstance(value, float) and not value.is_integer():
            raise bad
        return base(value)
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)  # e.g. a dataset config name written as 2020
    raise bad


def numbers_in(tree: Any) -> Any:
    """The DeepSpeed mapping with YAML 1.1's number strings turned into numbers ('auto' and names stay)."""
    if isinstance(tree, dict):
        return {k: numbers_in(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [numbers_in(v) for v in tree]
    if isinstance(tree, str):
        number = _number(tree)
        return tree if number is None else number
    return tree


def _strict_loader(path: str) -> type:
    """yaml.SafeLoader that refuses duplicate keys and non-finite or absurd numbers, with the line."""
    import yaml

    def refuse(node: Any, what: str, fix: str) -> ConfigError:
        return ConfigError(f"{path}:{node.start_mark.line + 1}: {what}: fix: {fix}")

    def checked(node: Any, number: float) -> None:
        if number != number or number in (float("inf"), float("-inf")):
            raise refuse(node, f"{node.value!r} is not a finite number", "give a finite value")
        if abs(number) > LARGEST_NUMBER:
            raise refuse(
                node,
                f"{node.value} is past the largest number a run takes ({LARGEST_NUMBER:.0e})",
                "correct the value",
            )

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, list | dict) and key in seen:
                    raise refuse(
                        key_node,
                        f"key {key!r} is given twice (first at line {seen[key]}; the last would silently win)",
                        "keep one (merge the two)",
                    )
                if not isinstance(key, list | dict):
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_float(self, node: Any) -> float:
            number = super().construct_yaml_float(node)
            checked(node, number)
            return number

        def construct_yaml_int(self, node: Any) -> int:
            number = super().construct_yaml_int(node)
            checked(node, number)
            return number

        def construct_yaml_str(self, node: Any) -> str:
            text = super().construct_yaml_str(node)
            if node.style is None and _EXPONENT_NUMBER.fullmatch(
                text.strip()
            ):  # 1e30: read as a number later
                checked(node, float(text))
            return text

    StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
    StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
    StrictLoader.add_constructor("tag:yaml.org,2002:str", StrictLoader.construct_yaml_str)
    return StrictLoader


def _check_expansion(root: Any, path: str) -> None:
    """Refuse a node graph whose aliases expand past MAX_NODES, counted without expanding it (each distinct node
    once: an alias is the anchored node itself), or that contains itself."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in visiting:
            raise ConfigError(
                f"{path}:{node.start_mark.line + 1}: an alias refers to itself: fix: remove the alias"
            )
        visiting.add(key)
        children: list[Any] = []
        if isinstance(node.value, list):
            for item in node.value:
                children.extend(item if isinstance(item, tuple) else (item,))
        total = 1 + sum(size(child) for child in children)
        visiting.discard(key)
        if total > MAX_NODES:
            raise ConfigError(
                f"{path}:{node.start_mark.line + 1}: its aliases expand to more than {MAX_NODES:,} values (an "
                "alias bomb?): fix: write the values out, or use fewer nested aliases"
            )
        sizes[key] = total
        return total

    size(root)


def load_yaml(path: str, what: str, fix: str) -> Any:
    """A YAML file's data, read strictly (see the module's doc); `what` names the file in messages ("run file"),
    `fix` says where the file comes from ("check --config")."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{what} {path} not found: {fix}")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: {what} is not UTF-8 text (byte 0x{raw[e.start]:02x}): fix: save it as UTF-8"
        ) from None
    loader = _strict_loader(path)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(
            f"{path}{where}: {what} is not valid YAML: {problem}: fix: correct the YAML there"
        ) from None
    finally:
        loader.dispose()


def load(path: str, sections: dict[str, type]) -> RunFile:
    """Read and check a run file; values by flag name, converted to the fields' types."""
    data = load_yaml(path, "run file", "check --config")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"run file {path} holds a {type(data).__name__}, not a mapping of sections: "
            f"write sections ({', '.join([*sections, DEEPSPEED])})"
        )
    owner = {f.name: s for s, cls in sections.items() for f in _fields(cls)}
    values: dict[str, Any] = {}
    deepspeed: dict[str, Any] | None = None
    for section, body in data.items():
        if section == DEEPSPEED:
            if isinstance(body, str):
                values["deepspeed_config"] = body
            elif isinstance(body, dict):
                deepspeed = numbers_in(body)
            else:
                raise ConfigError(
                    f"run file {path}: deepspeed is a {type(body).__name__}: give a mapping (the DeepSpeed "
                    "config itself) or the path of a DeepSpeed JSON file"
                )
            continue
        if section not in sections:
            if str(section) in owner:
                raise ConfigError(
                    f"run file {path}: {section} is a key of section {owner[str(section)]}: write it there "
                    f"({owner[str(section)]}.{section})"
                )
            hint = _closest(str(section), [*sections, DEEPSPEED])
            raise ConfigError(
                f"run file {path}: unknown section {section!r}: "
                + (f"did you mean {hint}?" if hint else f"use {', '.join([*sections, DEEPSPEED])}")
            )
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"run file {path}: section {section} is a {type(body).__name__}, not a mapping")
        cls = sections[section]
        hints = typing.get_type_hints(cls)
        for key, value in body.items():
            if key not in hints:
                if key in owner:
                    raise ConfigError(
                        f"run file {path}: {section}.{key} is not a {section} key: it belongs in "
                        f"{owner[key]} ({owner[key]}.{key})"
                    )
                close = _closest(str(key), list(owner))
                hint = (
                    f"did you mean {owner[close]}.{close}?" if close else f"see the {section} flags in --help"
                )
                raise ConfigError(f"run file {path}: unknown key {section}.{key}: {hint}")
            if value is None:
                continue
            read = next(f.metadata.get("read") for f in _fields(cls) if f.name == key)
            if read is None:
                values[key] = typed(hints[key], value, f"run file {path}: {section}.{key}")
                continue
            try:  # a key of its own structure (data.sources: a list): its field reads it
                values[key] = read(value)
            except ConfigError as e:
                raise ConfigError(
                    str(e).replace(f"--{key}", f"run file {path}: {section}.{key}", 1)
                ) from None
    return RunFile(path, values, deepspeed)


def key_of(name: str, section: str) -> str:
    """The run-file key that gives flag `name` of `section`: `optim.lr`; `deepspeed` for a DeepSpeed file's path."""
    return DEEPSPEED if name == "deepspeed_config" else f"{section}.{name}"


def dumps(sections: dict[str, dict[str, Any]], header: str, deepspeed: dict[str, Any] | None = None) -> str:
    """A run file's text: `header` (comment lines), the sections in order, and the embedded DeepSpeed config
    (none: the launch picks its default). `load` reads it back to the same values."""
    import yaml

    tree: dict[str, Any] = dict(sections)
    if deepspeed is not None:
        tree[DEEPSPEED] = deepspeed
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comments + yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)


def _fields(cls: type) -> list[Any]:
    return list(dataclasses.fields(cls))
