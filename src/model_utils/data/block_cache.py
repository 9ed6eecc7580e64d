"""The token blocks a run reads: a dataset prepared by `dskit prepare-data` (token shards + manifest, see token_shards.py) is read
as it is; any other dataset small enough (--unprepared_limit_mb) is prepared the same way, in this process, into
--data_cache_dir, keyed by its content, the tokenizer and the options, so a second run neither reads nor
tokenizes it again. Documents are concatenated with an EOS after each and cut into blocks of --seq_length
tokens: nothing is padded, no document truncated, only the final partial block of the stream is unused.
The order in which ranks read them is sampler.py's.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model_utils.config.presets import PRESETS
from model_utils.data import documents, token_shards
from model_utils.data.documents import EMBEDDED
from model_utils.data.token_shards import PreparedDataset, TokenizerSpec
from model_utils.errors import ConfigError
from model_utils.observe.log import print0


def _prepared_dir(data: Any) -> Path | None:
    if data.dataset == EMBEDDED or data.dataset.startswith("s3://") or not documents.is_local(data):
        return None
    path = Path(data.dataset).expanduser()
    return path if path.is_dir() and token_shards.state(path) is not None else None


def _prepare_command(data: Any, tokenizer_name: str) -> str:
    """The `dskit prepare-data` command for this run's data: its data flags that differ from the defaults."""
    tokenizer_flag = "--model" if tokenizer_name in PRESETS else "--tokenizer"  # a preset names its tokenizer
    args = [
        "dskit",
        "prepare-data",
        "PREPARED_DIR",
        "--dataset",
        data.dataset,
        tokenizer_flag,
        tokenizer_name,
    ]
    defaults = type(data)()
    for flag in _PREPARATION_FLAGS:
        value = getattr(data, flag)
        if value != getattr(defaults, flag):
            args += [f"--{flag}", str(value).lower() if isinstance(value, bool) else str(value)]
    return shlex.join(args)


def _hub_size(data: Any) -> int | None:
    import datasets

    try:
        info = datasets.load_dataset_builder(data.dataset, data.dataset_config_name).info
    except Exception:  # offline, unknown, gated, a loading script's error: the size is then unknown
        return None
    split = (info.splits or {}).get(data.train_split)
    return getattr(split, "num_bytes", None) or info.dataset_size


def _check_size(data: Any, tokenizer_name: str) -> None:
    """Refuse to tokenize a large dataset on the batch host while the GPU nodes wait: that is prepare-data's job."""
    limit = data.unprepared_limit_mb * 2**20
    name = data.dataset
    if name == EMBEDDED:
        return
    if name.startswith("s3://"):
        from model_utils.storage import s3

        size: int | None = sum(size for _, size, _ in s3.list_objects(name)[1])
    elif documents.is_local(data):
        path = Path(name).expanduser()
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else None
        size = path.stat().st_size if path.is_file() else size
        if size is None:
            return  # missing: planning says so
    else:
        size = _hub_size(data)
    command = _prepare_command(data, tokenizer_name)
    if size is None:
        raise ConfigError(
            f"hub dataset {name}: its size is unknown before reading it, so it is not tokenized here: prepare it "
            f"once with `{command}` and pass --dataset PREPARED_DIR (or raise --unprepared_limit_mb past its size)"
        )
    if size > limit:
        raise ConfigError(
            f"dataset {name} is {size / 2**20:,.0f} MB, over --unprepared_limit_mb {data.unprepared_limit_mb}: "
            f"prepare it once, in parallel, with `{command}` and pass --dataset PREPARED_DIR"
        )


def _cache_key(record: dict[str, Any]) -> str:
    identity = {k: v for k, v in record.items() if k not in ("kit_version", "units")}
    identity["tokenizer"] = record["tokenizer"]["fingerprint"]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


# The data flags a preparation reads (besides --dataset), and those a prepared dir fixed when it was made: giving
# one of the latter with a prepared dir would be silently ignored. (--local_dataset true may point at one.)
_PREPARATION_FLAGS = ("dataset_config_name", "local_dataset", "text_field", "train_split")
_PREPARATION_FLAGS += ("validation_split", "validation_dataset", "validation_fraction")
_PREPARATION_FLAGS += ("data_format", "chat_template", "train_on_prompt", "enable_thinking")
_FIXED_AT_PREPARATION = (*(f for f in _PREPARATION_FLAGS if f != "local_dataset"), "unprepared_limit_mb")


def prepared(
    data: Any,
    explicit: frozenset[str],
    tokenizer: Any,
    tokenizer_name: str,
    run_first: Callable[[Callable[[], Any]], Any],
    from_run_file: Callable[[str], str | None] = lambda flag: None,
) -> PreparedDataset:
    """The prepared dataset a run reads: --dataset itself, or the cache of a small unprepared dataset.
    `from_run_file(flag)`: how to name a setting the run file gave (None: typed as a flag): a prepared dir ignores
    those of its preparation's settings with one line (a shipped SFT run file serves prepared data too), and
    refuses the typed ones, which would be silently ignored."""
    spec = TokenizerSpec.of(tokenizer, tokenizer_name)
    given = _prepared_dir(data)
    if given is not None:
        fixed = [f for f in _FIXED_AT_PREPARATION if f in explicit]
        typed = sorted(f"--{f}" for f in fixed if from_run_file(f) is None)
        if typed:
            raise ConfigError(
                f"{' and '.join(typed)} apply when data is prepared, and {given} is prepared already: "
                "drop them (or give them to `dskit prepare-data` for a new preparation)"
            )
        ignored = [name for f in fixed if (name := from_run_file(f)) is not None]
        if ignored:
            print0(
                f"Data: {' and '.join(ignored)} apply when data is prepared, and {given} is prepared already: "
                "ignored (it keeps the settings `dskit prepare-data` gave it)"
            )
        # Its shards are verified on opening: on rank 0 first, then the other ranks find them in its record.
        dataset = run_first(lambda: token_shards.open_prepared(given))
        if dataset.tokenizer_fingerprint != spec.fingerprint:
            made_with = dataset.manifest["tokenizer"]["name"]
            raise ConfigError(
                f"prepared data {given} was tokenized with another tokenizer ({made_with}, not {tokenizer_name}): "
                "train with that tokenizer (--tokenizer), or prepare the data again with this one"
            )
        return dataset
    _check_size(data, tokenizer_name)

    def build() -> PreparedDataset:
        local = data
        if data.dataset.startswith("s3://"):  # mirrored: a save_to_disk dir in S3 works like a local one
            import dataclasses

            from model_utils.storage import s3

            path = s3.fetch_dataset(data.dataset, Path(data.data_cache_dir))
            local = dataclasses.replace(data, dataset=str(path), local_dataset=True)
        plan = documents.plan(local)
        rows = token_shards.rows_record(local, plan, tokenizer, print0)
        record = token_shards.plan_record(local, plan, spec, None, rows=rows)
        out = Path(data.data_cache_dir) / "prepared" / _cache_key(record)
        manifest = None
        if token_shards.state(out) != "prepared":
            manifest = token_shards.prepare_in_process(out, record, spec)
        if manifest is not None:
            print0(
                f"Data: tokenized {sum(manifest['documents'].values()):,} documents of {data.dataset} into "
                f"{manifest['tokens']['train']:,} train and {manifest['tokens']['validation']:,} validation "
                f"tokens in {out}"
            )
        else:
            print0(f"Data: {data.dataset} prepared in {out}")
        return token_shards.open_prepared(out)

    return run_first(build)
