"""The prepared-dataset format: token shards plus a manifest, written crash-safely, read by memory map.

    DIR/plan.json          what is being prepared (source, tokenizer, options, units); a re-run must match it
    DIR/units/NNNNN.json   a finished unit: its shards' token and document counts and checksums (commit point)
    DIR/train/NNNNN.bin    the unit's training tokens: documents each followed by EOS, uint16 or uint32
    DIR/validation/NNNNN.bin  the documents of the unit held out for validation
    DIR/SPLIT/NNNNN.mask   prompt/completion, conversation and preference data only: a flag byte per token
                           beside the .bin (chat.TRAINED: trained on; chat.DOC_START: a document starts, or a
                           pair's rejected sequence), written, committed, checksummed and verified with its shard
    DIR/manifest.json      written last, when every unit is done: only then is DIR a prepared dataset
    DIR/.verified.json     the shards whose checksums were verified, by size, mtime, ctime and inode: a second
                           open hashes only what changed (verify_shards)

A shard is written under DIR/.staging and renamed into place when complete, then its unit record is written
atomically, so a killed preparation leaves finished units and nothing that looks finished but is not; a re-run
tokenizes only the units without a record. Blocks are cut at read time, so one preparation serves any
--seq_length: the shards in unit order form one token stream, block b is tokens [b*seq, (b+1)*seq) of it, and
only the stream's final partial block is unused.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import shlex
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from model_utils.config.presets import PRESETS
from model_utils.data import chat, documents
from model_utils.data.documents import SPLIT, TRAIN, VALIDATION, Plan, Unit
from model_utils.data.packing import PackedBlocks
from model_utils.data.pairs import PairBlocks
from model_utils.data.rows import Rows
from model_utils.errors import ConfigError
from model_utils.launch import startup
from model_utils.observe.log import print0
from model_utils.storage import file_lock, file_manifest

FORMAT_VERSION = 1
MASK_SUFFIX = ".mask"
MANIFEST = "manifest.json"
LOCK = ".prepare-data.lock"  # held while a process writes units (preparing)
PLAN = "plan.json"
SPLITS = (TRAIN, VALIDATION)
VERIFIED = ".verified.json"
_STAGING = ".staging"


# --- the tokenizer as the workers see it ----------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerSpec:
    """What tokenizing needs, picklable for worker processes: the Rust tokenizer's JSON and the EOS id."""

    name: str
    json: str
    eos_id: int
    vocab_size: int

    @classmethod
    def of(cls, tokenizer: Any, name: str) -> TokenizerSpec:
        backend = tokenizer.backend_tokenizer
        return cls(name, backend.to_str(), int(tokenizer.eos_token_id), backend.get_vocab_size(True))

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.json}|eos={self.eos_id}".encode()).hexdigest()[:16]

    @property
    def dtype(self) -> str:
        return "uint16" if max(self.vocab_size, self.eos_id + 1) <= 2**16 else "uint32"


class _Encoder:
    def __init__(self, spec: TokenizerSpec) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(spec.json)
        self.eos = spec.eos_id
        self.dtype = np.dtype(spec.dtype)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids with EOS appended, as the training tokenizer gives them (no special tokens added)."""
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [
            np.fromiter(itertools.chain(e.ids, (self.eos,)), self.dtype, len(e.ids) + 1) for e in encodings
        ]


_encoders: dict[str, _Encoder] = {}


def _encoder(spec: TokenizerSpec) -> _Encoder:
    """One per process and tokenizer: a large tokenizer's JSON takes a while to load, and a worker runs many units."""
    if spec.fingerprint not in _encoders:
        _encoders[spec.fingerprint] = _Encoder(spec)
    return _encoders[spec.fingerprint]


# --- the plan record ------------------------------------------------------------------------------------


def kit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dskit")
    except PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


def plan_record(
    data: Any,
    source: Plan,
    spec: TokenizerSpec,
    max_tokens: int | None,
    unit_mb: float | None = None,
    rows: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a preparation is of: a re-run into the same directory must produce exactly this again. `unit_mb`
    (prepare-data's, when not the default) is kept so the command that re-prepares the data can be given.
    `rows` (chat_rows: prompt/completion or conversation data): the format, its fields and the chat options;
    a text preparation's record is as it always was."""
    if data.validation_dataset is not None:
        validation: dict[str, Any] = {"dataset": data.validation_dataset}
    elif data.validation_split is not None:
        validation = {"split": data.validation_split}
    else:
        validation = {"fraction": data.validation_fraction}
    return {
        "format_version": FORMAT_VERSION,
        "kit_version": kit_version(),
        "source": {
            "dataset": data.dataset,
            "config_name": data.dataset_config_name,
            "train_split": data.train_split,
            "fingerprint": source.fingerprint,
            "bytes": source.total_bytes,
        },
        "tokenizer": {
            "name": spec.name,
            "fingerprint": spec.fingerprint,
            "eos_id": spec.eos_id,
            "vocab_size": spec.vocab_size,
        },
        "dtype": spec.dtype,
        "seq_length": None,  # blocks are cut at read time
        "text_field": data.text_field,
        "validation": validation,
        "max_tokens": max_tokens,
        **({} if unit_mb is None else {"unit_mb": unit_mb}),
        **(rows or {}),
        "units": [u.to_dict() for u in source.units],
    }


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    keys = ("source", "tokenizer", "text_field", "validation", "max_tokens", "units", "format_version")
    keys += ("data_format", "fields", "chat")
    return [k for k in keys if a.get(k) != b.get(k)]


def begin(out: Path, record: dict[str, Any]) -> None:
    """Claim `out` for this preparation, or check that the one already there is the same. SLURM array tasks
    call this at the same moment: the plan is created with link(), which exactly one of them wins."""
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / PLAN
    if not plan_path.is_file():
        content = [p for p in out.iterdir() if not p.name.startswith(".") and p.name != PLAN]
        # (what another task wrote right after winning the plan counts as a plan: look again)
        if content and not plan_path.is_file():
            raise ConfigError(f"{out} is not empty and holds no preparation: pass an empty or new output dir")
        tmp = file_manifest.temporary_path(plan_path)
        with _disk_full_in_one_line(out, "the plan"):
            file_manifest.write_durably(tmp, json.dumps(record, indent=1))
        try:
            os.link(tmp, plan_path)
        except FileExistsError:
            pass  # another task's plan won: compared below
        finally:
            tmp.unlink()
    found = json.loads(plan_path.read_text())
    changed = _differences(found, record)
    if changed:
        raise ConfigError(
            f"{out} holds a preparation of other data or options (differs in: {', '.join(changed)}): "
            "pass another output dir, or delete it to start over"
        )


def _unit_name(index: int) -> str:
    return f"{index:05d}"


def _record_path(out: Path, index: int) -> Path:
    return out / "units" / f"{_unit_name(index)}.json"


def unit_done(out: Path, index: int) -> dict[str, Any] | None:
    """The unit's record when it finished and its shards are there at their recorded size; else None."""
    path = _record_path(out, index)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for shard in record["shards"].values():
        for part in (shard, shard.get("mask")):
            if part is None:
                continue
            file = out / part["file"]
            if not file.is_file() or file.stat().st_size != part["bytes"]:
                return None
    return record


# --- writing one unit -----------------------------------------------------------------------------------


class _ShardFile:
    """One shard being written under .staging: appended to, checksummed as it goes, renamed when complete."""

    def __init__(self, out: Path, split: str, index: int, suffix: str = ".bin") -> None:
        self.rel = f"{split}/{_unit_name(index)}{suffix}"
        self.final = out / self.rel
        self.staging = _staging_dir(out) / f"{split}-{_unit_name(index)}{suffix}"
        self.staging.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.staging.open("wb")
        self.hash = xxhash.xxh3_64()
        self.tokens = 0
        self.documents = 0
        # The flag bytes of prompt/completion and conversation data, committed with the tokens (MASK_SUFFIX).
        self.mask: _ShardFile | None = None

    def with_mask(self, out: Path, split: str, index: int) -> _ShardFile:
        self.mask = _ShardFile(out, split, index, MASK_SUFFIX)
        return self

    def write(self, arrays: list[np.ndarray], flags: list[np.ndarray] | None = None) -> None:
        if not arrays:
            return
        data = np.concatenate(arrays).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.tokens += sum(len(a) for a in arrays)
        self.documents += len(arrays)
        if self.mask is not None:
            assert flags is not None and [len(f) for f in flags] == [len(a) for a in arrays]
            self.mask.write(flags)

    def commit(self) -> dict[str, Any]:
        mask = self.mask.commit() if self.mask is not None else None
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.staging.replace(self.final)
        record = {
            "file": self.rel,
            "tokens": self.tokens,
            "documents": self.documents,
            "bytes": self.final.stat().st_size,
            "xxh3": self.hash.hexdigest(),
        }
        if mask is not None:
            record["mask"] = {"file": mask["file"], "bytes": mask["bytes"], "xxh3": mask["xxh3"]}
        return record

    def discard(self) -> None:
        if self.mask is not None:
            self.mask.discard()
        self.file.close()
        self.staging.unlink(missing_ok=True)


def _staging_dir(out: Path) -> Path:
    """This process's own: another task's finish() or failure never touches a shard it is writing."""
    return out / _STAGING / f"{socket.gethostname()}-{os.getpid()}"


def _held_out(index: int, fraction: float, phase: float) -> bool:
    """Document `index` of a unit goes to validation: evenly spread, n x fraction (+-1) of any n in a row."""
    return int((index + 1) * fraction + phase) > int(index * fraction + phase)


def _phase(unit: Unit) -> float:
    """Where the unit's held-out documents start: from what the unit holds, not where its file lives (a dataset
    copied to node-local disk or moved, and prepared again, holds out the same documents: no validation leak)."""
    identity = {**unit.to_dict(), "location": unit.location.rsplit("/", 1)[-1], "s3_bucket": None}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _disk_full(out: Path, what: str) -> ConfigError:
    free = shutil.disk_usage(out).free
    shown = f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"
    return ConfigError(
        f"disk full writing {what} in {out} ({shown} free): free space or pass another output dir; "
        "a re-run keeps the units already finished"
    )


@contextlib.contextmanager
def _disk_full_in_one_line(out: Path, what: str) -> Iterator[None]:
    """A full disk while writing `what` in `out`: one line naming the dir and its space."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(out, what) from None
        raise


def _write_atomically(path: Path, text: str, what: str) -> None:
    with _disk_full_in_one_line(path.parent, what):
        file_manifest.atomic_write_text(path, text)


@contextlib.contextmanager
def _discarded_on_failure(out: Path, index: int, shards: dict[str, _ShardFile]) -> Iterator[None]:
    """A unit's staged shards are discarded when writing them fails (a full disk in one line), so a killed or
    failed unit leaves nothing that looks written."""
    try:
        yield
    except BaseException as e:
        for shard in shards.values():
            shard.discard()
        shutil.rmtree(_staging_dir(out), ignore_errors=True)  # this process's: nobody else writes there
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(out, f"unit {index}") from None
        raise


def _commit_unit(out: Path, index: int, done: dict[str, Any]) -> dict[str, Any]:
    """The unit's record, written atomically: from here the unit counts as done."""
    path = _record_path(out, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, json.dumps(done, indent=1), f"the record of unit {index}")
    return done


def _quiet(nbytes: int, tokens: int) -> None:
    pass


def write_unit(
    out: Path,
    index: int,
    record: dict[str, Any],
    spec: TokenizerSpec,
    progress: Callable[[int, int], None] = _quiet,
) -> dict[str, Any]:
    """Tokenize unit `index` of the plan `record` into its shards and commit its unit record. Memory: one batch
    of documents."""
    with startup.older_objects_frozen():
        if record.get("data_format", chat.TEXT) != chat.TEXT:
            return _write_rows_unit(out, index, record, spec, progress)
        return _write_text_unit(out, index, record, spec, progress)


def _write_text_unit(
    out: Path, index: int, record: dict[str, Any], spec: TokenizerSpec, progress: Callable[[int, int], None]
) -> dict[str, Any]:
    unit = Unit.from_dict(record["units"][index])
    text_field = record["text_field"]
    validation_fraction = record["validation"].get("fraction", 0.0)
    max_tokens = record["max_tokens"]
    encoder = _encoder(spec)
    shards = {split: _ShardFile(out, split, index) for split in SPLITS}
    phase = _phase(unit)
    empty = 0
    doc_index = 0
    with _discarded_on_failure(out, index, shards):
        for texts, nbytes in documents.read(unit, text_field, _staging_dir(out)):
            _check_text(texts, text_field, unit)
            kept = [t for t in texts if isinstance(t, str) and t]
            empty += len(texts) - len(kept)
            ids = encoder.encode(kept) if kept else []
            if unit.role == SPLIT:
                to_val = [_held_out(doc_index + i, validation_fraction, phase) for i in range(len(ids))]
                shards[TRAIN].write([a for a, v in zip(ids, to_val, strict=True) if not v])
                shards[VALIDATION].write([a for a, v in zip(ids, to_val, strict=True) if v])
            else:
                shards[unit.role].write(ids)
            doc_index += len(ids)
            progress(nbytes, sum(len(a) for a in ids))
            if max_tokens is not None and shards[TRAIN].tokens >= max_tokens:
                break  # a prefix: later units are not needed either, and the manifest cuts this one
        committed = {split: shard.commit() for split, shard in shards.items()}
    done = {"unit": unit.to_dict(), "shards": committed, "empty_documents": empty}
    return _commit_unit(out, index, done)


def _write_rows_unit(
    out: Path, index: int, record: dict[str, Any], spec: TokenizerSpec, progress: Callable[[int, int], None]
) -> dict[str, Any]:
    """write_unit for prompt/completion and conversation rows: each row one document, its flag bytes in the
    .mask beside the tokens. A bad row is one line naming it, and the unit is not committed."""
    unit = Unit.from_dict(record["units"][index])
    fields = record["fields"]
    fields = tuple(fields) if isinstance(fields, list) else fields
    validation_fraction = record["validation"].get("fraction", 0.0)
    max_tokens = record["max_tokens"]
    encoder = _chat_encoder(spec, record)
    shards = {split: _ShardFile(out, split, index).with_mask(out, split, index) for split in SPLITS}
    phase = _phase(unit)
    untrained = rows = 0
    first_untrained = None
    with _discarded_on_failure(out, index, shards):
        reading = documents.read(unit, fields, _staging_dir(out))
        for batch, nbytes in reading:
            first = rows
            encoded = encoder.encode(batch, reading.where)
            rows += len(batch)
            untrained += encoded.untrained
            first_untrained = first_untrained or encoded.first_untrained
            pairs = list(zip(encoded.ids, encoded.flags, strict=True))
            if unit.role == SPLIT:
                to_val = [_held_out(first + i, validation_fraction, phase) for i in range(len(pairs))]
                train = [pair for pair, v in zip(pairs, to_val, strict=True) if not v]
                held = [pair for pair, v in zip(pairs, to_val, strict=True) if v]
                shards[TRAIN].write([a for a, _ in train], [f for _, f in train])
                shards[VALIDATION].write([a for a, _ in held], [f for _, f in held])
            else:
                shards[unit.role].write(encoded.ids, encoded.flags)
            progress(nbytes, sum(len(a) for a in encoded.ids))
            if max_tokens is not None and shards[TRAIN].tokens >= max_tokens:
                break
        _check_untrained(untrained, rows, unit.describe(), first_untrained, record)
        committed = {split: shard.commit() for split, shard in shards.items()}
    done = {
        "unit": unit.to_dict(),
        "shards": committed,
        "empty_documents": 0,
        "untrained_documents": untrained,
    }
    return _commit_unit(out, index, done)


def _check_untrained(
    untrained: int, rows: int, where: str, first: str | None, record: dict[str, Any]
) -> None:
    """Rows with no token to train on are counted; past chat.UNTRAINED_LIMIT of a unit's (or all of them) the
    template or the data is wrong, and training on it would be a silent zero-loss run."""
    if not untrained or (untrained < rows and untrained <= chat.UNTRAINED_LIMIT * rows):
        return
    options = record["chat"]
    what = "conversations" if record["data_format"] == chat.MESSAGES else "rows"
    raise ConfigError(
        f"{untrained} of {rows} {what} in {where} have no token to train on (the first: {first}; no assistant "
        f"turn the chat template, {options['template_from']}, renders): fix the data or pass --chat_template "
        "with a template that renders the assistant turns (or --train_on_prompt to train on every token)"
    )


_chat_encoders: dict[str, chat.ChatEncoder] = {}


def _chat_encoder(spec: TokenizerSpec, record: dict[str, Any]) -> chat.ChatEncoder:
    key = f"{spec.fingerprint}|{record['data_format']}|{json.dumps(record['chat'], sort_keys=True)}"
    if key not in _chat_encoders:
        _chat_encoders[key] = chat.ChatEncoder(
            spec.json, spec.eos_id, spec.dtype, record["data_format"], record["chat"]
        )
    return _chat_encoders[key]


def rows_record(data: Any, source: Plan, tokenizer: Any, say: Callable[[str], None]) -> dict[str, Any] | None:
    """The plan record's entries for prompt/completion or conversation data (None: text), deciding
    --data_format auto by the first row's columns and saying so in one line."""
    data_format, fields, said = chat.decide_format(data, documents.first_row(source.units[0]))
    if said:
        say(f"Data: {data.dataset}: {said}")
    if data_format == chat.PREFERENCE and data.train_on_prompt:
        raise ConfigError(
            f"--train_on_prompt applies to prompt/completion and conversation rows, and {data.dataset} holds "
            "preference pairs (trained on their answers, as TRL's DPOTrainer): drop it"
        )
    if data_format == chat.TEXT:
        set_ = {"chat_template": data.chat_template is not None, "train_on_prompt": data.train_on_prompt}
        set_["enable_thinking"] = data.enable_thinking is not None
        given = [f"--{flag}" for flag, is_set in set_.items() if is_set]
        if given:  # they would change nothing: every token of a text is trained on, no template renders it
            raise ConfigError(
                f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to prompt/completion and "
                f"conversation rows, and {data.dataset} is "
                f"read as text ({data.text_field!r}): drop {'them' if len(given) > 1 else 'it'}, or pass "
                "--data_format prompt_completion or messages"
            )
        return None
    return {
        "data_format": data_format,
        "fields": list(fields) if isinstance(fields, tuple) else fields,
        "chat": chat.options(data, tokenizer, data_format),
    }


# --- finishing: the manifest ----------------------------------------------------------------------------


def _check_text(texts: list[Any], field: str, unit: Unit) -> None:
    """A field of lists or records (chat messages, say) is not text: one line naming what it holds, not a data
    set of 0 documents and a "fewer than one block" later. Missing values (None) are empty documents."""
    bad = [t for t in texts if t is not None and not isinstance(t, str)]
    if not bad:
        return
    kinds = sorted({type(t).__name__ for t in bad})
    where = unit.name
    raise ConfigError(
        f"field {field!r} of {where} holds {' and '.join(kinds)} values, not text ({len(bad)} of the first "
        f"{len(texts)} rows): pass --text_field naming a field of plain text"
    )


def finish(out: Path) -> dict[str, Any] | None:
    """Write the manifest when every unit needed is done (with --max_tokens: the units of the prefix); return
    it, or None while units are missing. Safe to call from several processes: they write the same manifest."""
    plan = json.loads((out / PLAN).read_text())
    max_tokens = plan["max_tokens"]
    shards: dict[str, list[dict[str, Any]]] = {TRAIN: [], VALIDATION: []}
    train_tokens = used = 0
    for index in range(len(plan["units"])):
        if max_tokens is not None and train_tokens >= max_tokens:
            break
        used += 1
        record = unit_done(out, index)
        if record is None:
            return None
        for split in SPLITS:
            shard = dict(record["shards"][split])
            shard["file_tokens"] = shard["tokens"]
            if split == TRAIN and max_tokens is not None:
                shard["tokens"] = min(shard["tokens"], max_tokens - train_tokens)
            if shard["tokens"]:
                shards[split].append(shard)
        train_tokens += record["shards"][TRAIN]["tokens"]
    manifest = {key: value for key, value in plan.items() if key != "units"}
    manifest |= {
        "units": len(plan["units"]),
        "shards": shards,
        "tokens": {split: sum(s["tokens"] for s in shards[split]) for split in SPLITS},
        "documents": {split: sum(s["documents"] for s in shards[split]) for split in SPLITS},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_atomically(out / MANIFEST, json.dumps(manifest, indent=1), "the manifest")
    if used == len(plan["units"]):  # nobody writes any more (killed writers' leftovers go too)
        shutil.rmtree(out / _STAGING, ignore_errors=True)
    else:  # a prefix: other tasks may still be writing units past it; they find the manifest and stop
        with contextlib.suppress(OSError):
            _staging_dir(out).rmdir()
    return manifest


def missing_units(out: Path) -> list[int]:
    plan = json.loads((out / PLAN).read_text())
    return [i for i in range(len(plan["units"])) if unit_done(out, i) is None]


# --- reading --------------------------------------------------------------------------------------------


def state(path: Path) -> str | None:
    """ "prepared" (a manifest), "unfinished" (a plan without one), or None: not a prepared-dataset dir."""
    if (path / MANIFEST).is_file():
        return "prepared"
    if (path / PLAN).is_file():
        return "unfinished"
    return None


class TokenBlocks:
    """Blocks of `seq_length` tokens over a split's shards, read by memory map: len() and rows by index.

    `document_end`: the token that ends every document (the EOS the preparation appended), for packing that keeps
    documents apart (--packing documents); None: the plain stream, one sequence per block (--packing stream).
    """

    def __init__(self, arrays: list[np.ndarray], seq_length: int, document_end: int | None = None) -> None:
        self.arrays = [a for a in arrays if len(a)]
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.seq_length = seq_length
        self.count = int(self.starts[-1]) // seq_length
        self.dtype = self.arrays[0].dtype if self.arrays else np.dtype(np.uint16)
        self.document_end = document_end

    def __len__(self) -> int:
        return self.count

    def _span(self, start: int) -> np.ndarray:
        end = start + self.seq_length
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset = start - int(self.starts[shard])
        array = self.arrays[shard]
        if offset + self.seq_length <= len(array):
            return array[offset : offset + self.seq_length]
        pieces = []  # a block that runs across shards (documents continue across them, like across blocks)
        while start < end:
            take = min(end, int(self.starts[shard + 1])) - start
            pieces.append(self.arrays[shard][offset : offset + take])
            start, shard, offset = start + take, shard + 1, 0
        return np.concatenate(pieces)

    def __getitem__(self, index: Any) -> np.ndarray:
        indices = np.asarray(index, dtype=np.int64)
        flat = indices.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.count):
            raise IndexError(f"block index out of range [0, {self.count})")
        rows = np.empty((flat.size, self.seq_length), dtype=self.dtype)
        for row, block in enumerate(flat.tolist()):
            rows[row] = self._span(block * self.seq_length)
        return rows.reshape(*indices.shape, self.seq_length)

    def rows(self, indices: np.ndarray) -> Rows:
        """The plain-text stream: every token but a row's first is trained on, attention across the row. With a
        `document_end`, a document starts at each row's start and after each end token: positions restart there
        and its first token is not a target (nothing of its own document comes before it)."""
        tokens = np.asarray(self[np.asarray(indices).reshape(-1)], dtype=np.int64)
        if self.document_end is None:
            return Rows(tokens)
        starts = np.zeros(tokens.shape, dtype=bool)
        starts[:, 0] = True
        starts[:, 1:] = tokens[:, :-1] == self.document_end
        columns = np.broadcast_to(np.arange(self.seq_length), tokens.shape)
        # Each token's position: its column less the column of the latest document start at or before it.
        latest_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
        return Rows(tokens, targets=~starts, positions=columns - latest_start)


@dataclass(frozen=True)
class PreparedDataset:
    path: Path
    manifest: dict[str, Any]

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.manifest["tokenizer"]["fingerprint"]

    @property
    def holds_validation(self) -> bool:
        """Documents were held out (a validation split or a fraction above 0), whether or not any fell out."""
        return self.manifest["validation"] != {"fraction": 0.0} and self.manifest["validation"] != {
            "fraction": 0
        }

    def tokens(self, split: str) -> int:
        return int(self.manifest["tokens"][split])

    @property
    def document_end(self) -> int:
        """The token the preparation appended to every document (the tokenizer's EOS)."""
        return int(self.manifest["tokenizer"]["eos_id"])

    @property
    def data_format(self) -> str:
        return self.manifest.get("data_format", chat.TEXT)

    def _map(self, rel: str, tokens: int, dtype: np.dtype) -> np.ndarray:
        file = self.path / rel
        if not file.is_file() or file.stat().st_size < tokens * dtype.itemsize:
            raise ConfigError(
                f"prepared data {self.path}: shard {rel} is missing or shorter than its manifest "
                "says: prepare the data again"
            )
        return np.memmap(file, dtype=dtype, mode="r", shape=(tokens,))

    def blocks(
        self, split: str, seq_length: int, documents_apart: bool = False, truncation_mode: str = "keep_start"
    ) -> TokenBlocks | PackedBlocks | PairBlocks:
        """The text stream cut into blocks (`documents_apart`: rows whose documents are kept apart, --packing
        documents); prompt/completion and conversation documents packed whole, always kept apart; preference
        pairs as pairs of rows (`truncation_mode`: --truncation_mode)."""
        dtype = np.dtype(self.manifest["dtype"])
        shards = [s for s in self.manifest["shards"][split] if s["tokens"]]
        if self.data_format == chat.PREFERENCE:
            return self._pairs(split, shards, dtype, seq_length, truncation_mode)
        arrays = [self._map(shard["file"], shard["tokens"], dtype) for shard in shards]
        if self.data_format == chat.TEXT:
            return TokenBlocks(arrays, seq_length, self.document_end if documents_apart else None)
        flags = [self._map(shard["mask"]["file"], shard["tokens"], np.dtype(np.uint8)) for shard in shards]
        return PackedBlocks(arrays, flags, seq_length, self.document_end)

    def _pairs(
        self, split: str, shards: list[dict[str, Any]], dtype: np.dtype, seq_length: int, truncation_mode: str
    ) -> PairBlocks:
        """The split's pairs. A shard --max_tokens cut (fewer tokens than its file holds) ends with its last whole
        pair: a pair the cut runs through is not part of the prefix."""
        arrays, flags = [], []
        for shard in shards:
            tokens, held = shard["tokens"], shard.get("file_tokens", shard["tokens"])
            if tokens < held:
                whole = self._map(shard["mask"]["file"], held, np.dtype(np.uint8))
                pair_starts = np.flatnonzero(whole & chat.DOC_START)[::2]
                ends = np.append(pair_starts[1:], held)
                tokens = int(ends[ends <= tokens][-1]) if (ends <= tokens).any() else 0
            if tokens:
                arrays.append(self._map(shard["file"], tokens, dtype))
                flags.append(self._map(shard["mask"]["file"], tokens, np.dtype(np.uint8)))
        return PairBlocks(arrays, flags, seq_length, self.document_end, truncation_mode, split)


# --- verifying the shards -------------------------------------------------------------------------------

_HASH_CHUNK = 8 << 20
_SAY_FROM_BYTES = 2**30  # hashing less takes under a second or so: not worth a line


def prepare_command(path: Path, record: dict[str, Any]) -> str:
    """The `dskit prepare-data` command that made `path` (its plan or manifest `record`): run again, it
    tokenizes only the units not done, so it re-prepares the units whose shards fail their checksums."""
    source = record["source"]
    args = ["dskit", "prepare-data", str(path), "--dataset", source["dataset"]]
    if source.get("config_name") is not None:
        args += ["--dataset_config_name", source["config_name"]]
    args += ["--train_split", source["train_split"], "--text_field", record["text_field"]]
    ((held_out, value),) = record["validation"].items()  # one of dataset, split, fraction (plan_record)
    args += [f"--validation_{held_out}", str(value)]
    name = record["tokenizer"]["name"]
    args += ["--model" if name in PRESETS else "--tokenizer", name]  # a preset names its tokenizer
    if record.get("data_format") is not None:
        args += ["--data_format", record["data_format"]]
        if record["chat"]["template_from"] != chat.TOKENIZER_TEMPLATE:
            args += ["--chat_template", record["chat"]["template_from"]]
        if record["chat"]["train_on_prompt"]:
            args += ["--train_on_prompt", "true"]
        for name, value in record["chat"].get(chat.TEMPLATE_KWARGS, {}).items():
            args += [f"--{name}", str(value).lower()]
    if record.get("max_tokens") is not None:
        args += ["--max_tokens", str(record["max_tokens"])]
    if record.get("unit_mb") is not None:
        args += ["--unit_mb", f"{record['unit_mb']:g}"]
    return shlex.join(args)


def shard_digest(file: Path) -> str:
    """xxh3-64 of a shard, as _ShardFile recorded it while writing."""
    digest = xxhash.xxh3_64()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with file.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _identity(file: Path) -> dict[str, int]:
    """What changes when a shard's bytes are written, copied or replaced (ctime: not even `touch` sets it back)."""
    st = file.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _read_verified(path: Path) -> dict[str, Any]:
    try:
        found = json.loads((path / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: everything is hashed (and the file written again)
    shards = found.get("shards") if isinstance(found, dict) else None
    return shards if isinstance(shards, dict) else {}


@dataclass(frozen=True)
class Verification:
    """What verify_shards found: `failed` maps a shard file to what is wrong with it (empty: all verify)."""

    failed: dict[str, str]
    shards: int
    hashed: int  # shards hashed this time: those without a current entry in .verified.json
    hashed_bytes: int
    seconds: float


def verify_shards(path: Path, manifest: dict[str, Any], say: Callable[[str], None] = print0) -> Verification:
    """Every shard of the manifest at its recorded size and xxh3. A shard verified before and not changed since
    (same size, mtime, ctime and inode in .verified.json) is not read again, so a resume or a second launch
    costs a stat per shard. The others are read by a thread per core (up to 8): reads release the GIL, so they
    overlap each other and the hashing, which holds it (xxh3 runs at ~10 GB/s: the read is the cost)."""
    started = time.perf_counter()
    verified = _read_verified(path)
    shards = {s["file"]: s for split in SPLITS for s in manifest["shards"][split]}
    shards |= {
        s["mask"]["file"]: s["mask"] for split in SPLITS for s in manifest["shards"][split] if "mask" in s
    }
    failed: dict[str, str] = {}
    current: dict[str, Any] = {}
    todo: list[tuple[str, dict[str, int]]] = []
    for rel, shard in shards.items():
        try:
            identity = _identity(path / rel)
        except OSError:
            failed[rel] = "is missing"
            continue
        if identity["size"] != shard["bytes"]:
            failed[rel] = f"is {identity['size']:,} bytes, not the {shard['bytes']:,} its unit recorded"
        elif verified.get(rel) == {**identity, "xxh3": shard["xxh3"]}:
            current[rel] = verified[rel]
        else:
            todo.append((rel, identity))
    total = sum(identity["size"] for _, identity in todo)
    if total >= _SAY_FROM_BYTES:
        say(
            f"Data: verifying {len(todo):,} shards ({total / 2**30:,.1f} GiB) of {path} against their checksums"
        )
    workers = max(1, min(8, len(os.sched_getaffinity(0)), len(todo)))
    with ThreadPoolExecutor(workers) as pool:
        digests = pool.map(lambda item: shard_digest(path / item[0]), todo)
        for (rel, identity), digest in zip(todo, digests, strict=True):
            if digest == shards[rel]["xxh3"]:
                current[rel] = {**identity, "xxh3": digest}
            else:
                failed[rel] = (
                    f"does not match its checksum (xxh3 {digest}, its unit recorded {shards[rel]['xxh3']})"
                )
    seconds = time.perf_counter() - started
    if todo and current:  # something newly verified: recorded for the next open
        _record_verified(path, current, say)
    if total >= _SAY_FROM_BYTES:
        say(
            f"Data: {total / 2**30:,.1f} GiB verified in {seconds:.1f} s ({total / 2**20 / seconds:,.0f} MB/s)"
        )
    return Verification(failed, len(shards), len(todo), total, seconds)


def _record_verified(path: Path, shards: dict[str, Any], say: Callable[[str], None]) -> None:
    try:
        _write_atomically(
            path / VERIFIED, json.dumps({"version": 1, "shards": shards}), "the verification record"
        )
    except (OSError, ConfigError) as e:  # a read-only or full dataset dir: correct, only slower next time
        reason = e.strerror if isinstance(e, OSError) else "disk full"
        say(
            f"Data: could not record the verified shards in {path / VERIFIED} ({reason}): each open hashes them"
        )


def damaged_units(path: Path, manifest: dict[str, Any]) -> dict[int, str]:
    """The units whose shards fail verification, each with its first failing shard's line."""
    units: dict[int, str] = {}
    for rel, why in verify_shards(path, manifest).failed.items():
        units.setdefault(int(Path(rel).stem), f"{rel} {why}")
    return units


def discard_units(path: Path, indices: list[int]) -> None:
    """Make `path` unfinished again with these units not done: the manifest first, so nothing trains on it."""
    (path / MANIFEST).unlink(missing_ok=True)
    for index in indices:
        _record_path(path, index).unlink(missing_ok=True)


def open_prepared(path: Path, say: Callable[[str], None] = print0) -> PreparedDataset:
    """The prepared dataset at `path`, its shards verified (verify_shards): a corrupted or partly copied shard is
    one line naming it and the command that re-prepares it, before anything reads it."""
    found = state(path)
    if found == "unfinished":
        left = len(missing_units(path))
        raise ConfigError(
            f"{path} is an unfinished preparation ({left} units not done): re-run the same "
            "`dskit prepare-data` command to finish it"
        )
    if found is None:
        raise ConfigError(f"{path} is not a prepared dataset (no {MANIFEST}): run `dskit prepare-data`")
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"{path} was prepared in format {manifest.get('format_version')}, this kit reads {FORMAT_VERSION}: "
            "prepare it again"
        )
    failed = verify_shards(path, manifest, say).failed
    if failed:
        rel, why = next(iter(failed.items()))
        more = f" (and {len(failed) - 1} more shards)" if len(failed) > 1 else ""
        raise ConfigError(
            f"prepared data {path}: shard {rel} {why}{more}: the data is corrupted or partly copied; re-prepare "
            f"the units that fail with `{prepare_command(path, manifest)}`"
        )
    return PreparedDataset(path, manifest)


def write_units(
    out: Path,
    record: dict[str, Any],
    spec: TokenizerSpec,
    indices: list[int],
    progress: Callable[[int, int], None] = _quiet,
    unit_done: Callable[[], None] = lambda: None,
) -> None:
    """Units `indices` in this process, in order. Stops once the dataset is prepared: a --max_tokens prefix
    complete, here or by another array task (the manifest is written as soon as the prefix is)."""
    for index in indices:
        if state(out) == "prepared":
            return
        write_unit(out, index, record, spec, progress)
        unit_done()
        if record["max_tokens"] is not None:
            finish(out)


@contextlib.contextmanager
def preparing(
    out: Path, lock: str = LOCK, say: Callable[[str], None] = lambda line: print0(f"Data: {line}")
) -> Iterator[None]:
    """One preparation of `out` at a time (`lock`: a lock file in it): two launches that start together on the
    same new data (a sweep, two jobs on one --data_cache_dir) or two `dskit prepare-data` of it; the second says
    whose it waits for, and finds the units done."""
    with file_lock.exclusive(
        out / lock,
        lambda holder: say(
            f"{out} is being prepared by another process ({holder}, {lock}): waiting for it to finish"
        ),
    ):
        yield


def prepare_in_process(out: Path, record: dict[str, Any], spec: TokenizerSpec) -> dict[str, Any] | None:
    """Prepare (or finish preparing) `out` in this process: the small-data path of the preflight. None when
    another process prepared it meanwhile (its lock waited for)."""
    begin(out, record)
    with preparing(out):
        if state(out) == "prepared":
            return None
        write_units(out, record, spec, missing_units(out))
        manifest = finish(out)
    assert manifest is not None, "every unit of the plan (or of its prefix) is done"
    return manifest


def content_fingerprint(manifest: dict[str, Any], split: str = TRAIN) -> str:
    """What a split's blocks hold, from the manifest's per-shard checksums in stream order (not where the dataset
    lives: a moved or copied one keeps it): a checkpoint records the training split's, and a resume on other data
    is refused (checkpoint/launch_record.py); DPO's reference log-probabilities are named by both splits'."""
    shards = [
        (shard["xxh3"], shard["tokens"], *([shard["mask"]["xxh3"]] if "mask" in shard else []))
        for shard in manifest["shards"][split]
    ]
    identity = {"dtype": manifest["dtype"], f"{split}_shards": shards}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
