"""Where documents come from: a source (local files, a save_to_disk dir, S3 objects, a hub dataset) planned as
work units, each read as a stream of texts in bounded memory.

A unit is a piece of the source that one process tokenizes into one pair of shards: a byte range of a JSON
lines file, a run of parquet row groups, one Arrow file of a save_to_disk dataset, one CSV/text file, one S3
object, or one shard of a streamed hub dataset. Units are listed in a fixed order, so the prepared token stream
is the same whichever process (or SLURM array task) tokenizes which unit. Nothing here holds more than one
batch of documents at a time.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gzip
import hashlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from model_utils.errors import ConfigError, first_line

EMBEDDED = "embedded"
TEXT_FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# Compressed corpora as they are published (C4, Dolma): read as a stream, so one file is one unit.
TEXT_FORMATS |= {".json.gz": "json.gz", ".jsonl.gz": "json.gz", ".txt.gz": "text.gz", ".csv.gz": "csv.gz"}
BATCH_DOCS = 1000  # documents read at a time
# Text tokenized per call: the tokenizer's output is ~50x the text (ids, tokens, masks per token), so this, not
# the document count, is what bounds a worker's memory (1,000 source files of 15 kB each held 1.4 GB).
BATCH_TEXT = 2**20
DEFAULT_UNIT_BYTES = 64 * 2**20  # a JSON lines file is split into byte ranges of about this size

TRAIN, VALIDATION, SPLIT = (
    "train",
    "validation",
    "split",
)  # a unit's role: all train, all validation, or held out


@dataclass(frozen=True)
class Unit:
    """One piece of work. `location`: a file path, an S3 key or a hub dataset name; `start`/`end`: a byte range
    (json), row-group range (parquet) or shard index (hub); `size`: bytes of source it covers, for progress."""

    kind: str  # json | text | csv | parquet | arrow | hub
    location: str
    start: int
    end: int
    size: int
    role: str
    s3_bucket: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Unit:
        return cls(**d)

    @property
    def name(self) -> str:
        """The file or S3 object this unit is a piece of, as a person names it."""
        return f"s3://{self.s3_bucket}/{self.location}" if self.s3_bucket else self.location

    def describe(self) -> str:
        return f"{self.name} [{self.start}:{self.end}]"


@dataclass(frozen=True)
class Plan:
    """The units of a source, in order, and what identifies the source's content."""

    units: tuple[Unit, ...]
    fingerprint: str
    total_bytes: int | None  # None for a hub dataset: its size is known only after reading it


def _digest(items: list[Any]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()[:20]


# --- planning -------------------------------------------------------------------------------------------


def format_suffix(name: str) -> str:
    """'.jsonl' of 'a.jsonl', '.jsonl.gz' of 'a.jsonl.gz': the key into TEXT_FORMATS (or an unknown one)."""
    suffixes = Path(name).suffixes
    return "".join(suffixes[-2:]) if suffixes[-1:] == [".gz"] else "".join(suffixes[-1:])


def data_files(path: Path) -> list[Path]:
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if format_suffix(p.name) in TEXT_FORMATS)
    )
    suffixes = {format_suffix(p.name) for p in files}
    if not files or not suffixes <= set(TEXT_FORMATS):
        raise ConfigError(
            f"dataset {path} is not a save_to_disk dir nor .txt/.json/.jsonl/.parquet/.csv data: "
            "point --dataset at one of those"
        )
    kinds = {TEXT_FORMATS[s] for s in suffixes}
    if len(kinds) > 1:
        raise ConfigError(
            f"dataset dir {path} mixes file types {sorted(suffixes)}: keep one kind per dataset"
        )
    return files


def is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _json_is_array(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _file_units(path: Path, role: str, unit_bytes: int) -> list[Unit]:
    kind = TEXT_FORMATS[format_suffix(path.name)]
    size = path.stat().st_size
    if size == 0:
        return []
    if kind.endswith(".gz"):  # no seeking into a compressed stream: end -1 = to its end
        return [Unit(kind, str(path), 0, -1, size, role)]
    if kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        units, first, acc = [], 0, 0
        for g in range(meta.num_row_groups):
            acc += meta.row_group(g).total_byte_size
            if acc >= unit_bytes or g == meta.num_row_groups - 1:
                units.append(Unit(kind, str(path), first, g + 1, acc, role))
                first, acc = g + 1, 0
        return units
    if kind == "json" and not _json_is_array(path):
        return [
            Unit(kind, str(path), a, min(a + unit_bytes, size), min(unit_bytes, size - a), role)
            for a in range(0, size, unit_bytes)
        ]
    if kind == "json" and size > unit_bytes:
        raise ConfigError(
            f"{path} is one JSON array of {size / 2**20:.0f} MB, read whole into memory: "
            "write it as JSON lines (one object per line)"
        )
    return [Unit("jsonarray" if kind == "json" else kind, str(path), 0, size, size, role)]


def _saved_split_dir(path: Path, split: str) -> Path:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if split not in splits:
            raise ConfigError(
                f"dataset {path} has no split {split!r} (splits: {', '.join(splits)}): "
                "pass --train_split/--validation_split"
            )
        return path / split
    if split != TRAIN:
        raise ConfigError(f"dataset {path} is a single split, so split {split!r} does not exist")
    return path


def _saved_units(path: Path, split: str, role: str) -> list[Unit]:
    folder = _saved_split_dir(path, split)
    state = json.loads((folder / "state.json").read_text())
    files = [folder / f["filename"] for f in state["_data_files"]]
    return [Unit("arrow", str(f), 0, 0, f.stat().st_size, role) for f in files if f.stat().st_size]


def _local_units(path: Path, split: str, role: str, unit_bytes: int) -> tuple[list[Unit], list[Any]]:
    if not path.exists():
        raise ConfigError(
            f"dataset path {path} does not exist: check --dataset (or --local_dataset false for a hub name)"
        )
    if path.is_dir() and is_saved_dataset(path):
        units = _saved_units(path, split, role)
    else:
        if split != TRAIN:
            raise ConfigError(f"local files {path} form a single split, so split {split!r} does not exist")
        units = [u for f in data_files(path) for u in _file_units(f, role, unit_bytes)]
    identity = [[u.location, os.stat(u.location).st_size, os.stat(u.location).st_mtime_ns] for u in units]
    return units, identity


def _s3_units(uri: str, role: str) -> tuple[list[Unit], list[Any]]:
    from model_utils.storage import s3

    bucket, objects = s3.list_objects(uri)
    units = []
    for key, size, _etag in objects:
        suffix = format_suffix(key)
        if suffix not in TEXT_FORMATS:
            continue
        kind = TEXT_FORMATS[suffix]
        if kind == "parquet" or kind.endswith(".gz"):  # end -1: all its row groups, or to its end
            units.append(Unit(kind, key, 0, -1, size, role, bucket))
        else:
            units.append(Unit("jsonl-or-array" if kind == "json" else kind, key, 0, size, size, role, bucket))
    if not units:
        raise ConfigError(
            f"no .txt/.json/.jsonl/.parquet/.csv objects under {uri}: check the URI (it is a prefix)"
        )
    return units, [list(o) for o in objects]


def _hub_dataset(name: str, config_name: str | None, split: str) -> Any:
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(name, config_name, split=split, streaming=True)
    except (ValueError, OSError, ConnectionError) as e:  # datasets wraps network and missing-split errors
        raise ConfigError(
            f"could not open dataset {name!r} split {split!r} from the Hugging Face hub ({first_line(e)}): "
            "check the name and network access, or give a local path with --local_dataset true"
        ) from None


def _hub_units(name: str, config_name: str | None, split: str, role: str) -> tuple[list[Unit], list[Any]]:
    stream = _hub_dataset(name, config_name, split)
    n = max(1, stream.num_shards)
    location = json.dumps([name, config_name, split])
    return [Unit("hub", location, i, n, 0, role) for i in range(n)], [name, config_name, split, n]


def is_local(data: Any) -> bool:
    """--dataset names a local path (--local_dataset true, or it exists, or it looks like a path), not a hub
    dataset. ('embedded' and s3:// URIs are decided before this.)"""
    if data.local_dataset is not None:
        return bool(data.local_dataset)
    return Path(data.dataset).expanduser().exists() or data.dataset.startswith(("/", ".", "~"))


def _split_units(data: Any, split: str, role: str, unit_bytes: int) -> tuple[list[Unit], list[Any]]:
    from model_utils.assets import CORPUS_PATH

    name = data.dataset
    if name == EMBEDDED:
        if split != TRAIN:
            raise ConfigError(f"dataset {name!r} has only a train split, so {split!r} does not exist")
        return _local_units(CORPUS_PATH, split, role, unit_bytes)
    if name.startswith("s3://"):
        if split != TRAIN:
            raise ConfigError(f"S3 data {name} forms a single split, so split {split!r} does not exist")
        return _s3_units(name, role)
    if is_local(data):
        return _local_units(Path(name).expanduser(), split, role, unit_bytes)
    return _hub_units(name, data.dataset_config_name, split, role)


def plan(data: Any, unit_bytes: int = DEFAULT_UNIT_BYTES) -> Plan:
    """The units of the configured dataset: its train split (with --validation_fraction held out of each unit)
    and, with --validation_split or --validation_dataset, the validation documents' units after them."""
    separate = data.validation_split is not None or data.validation_dataset is not None
    train_role = SPLIT if not separate and data.validation_fraction > 0 else TRAIN
    units, identity = _split_units(data, data.train_split, train_role, unit_bytes)
    if not units:
        raise ConfigError(f"dataset {data.dataset} is empty: point --dataset at files with documents")
    if separate:
        if data.validation_dataset is not None:  # another dataset, read whole (its train split) as validation
            source = dataclasses.replace(data, dataset=data.validation_dataset, local_dataset=None)
            val_units, val_identity = _split_units(source, TRAIN, VALIDATION, unit_bytes)
        else:
            val_units, val_identity = _split_units(data, data.validation_split, VALIDATION, unit_bytes)
        if not val_units:
            raise ConfigError(f"the validation data of {data.dataset} is empty: point it at documents")
        units, identity = units + val_units, identity + val_identity
    sizes = [u.size for u in units]
    total = None if any(u.kind == "hub" for u in units) else sum(sizes)
    return Plan(tuple(units), _digest([data.dataset, data.dataset_config_name, identity]), total)


# --- reading --------------------------------------------------------------------------------------------


Fields = str | tuple[str, ...]  # one column's values, or several columns' as a mapping per row
# A reader's batch: the documents or rows, the bytes of the unit they covered, and what names row i of them.
Batch = tuple[list[Any], int, Callable[[int], str]]


def _missing(field: Fields, where: str, present: Any) -> ConfigError:
    columns = ", ".join(map(str, present)) if present else "none"
    if isinstance(field, tuple):
        return ConfigError(
            f"{where} has no field {' or '.join(repr(f) for f in field if f not in (present or ()))} "
            f"(fields: {columns}): fix the row, or pass --data_format naming what the rows hold"
        )
    return ConfigError(f"{where} has no field {field!r} (fields: {columns}): pass --text_field")


def _has(record: Any, field: Fields) -> bool:
    if not isinstance(record, dict):
        return False
    return all(f in record for f in field) if isinstance(field, tuple) else field in record


def _pick(record: dict, field: Fields) -> Any:
    return {f: record[f] for f in field} if isinstance(field, tuple) else record[field]


def _columns(field: Fields) -> list[str]:
    return list(field) if isinstance(field, tuple) else [field]


@contextlib.contextmanager
def _binary(path: str, kind: str) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """The file's bytes (decompressed for .gz) and the position read so far in the file itself (progress)."""
    with open(path, "rb") as raw:
        yield (gzip.GzipFile(fileobj=raw) if kind.endswith(".gz") else raw), raw.tell  # type: ignore[misc]


@contextlib.contextmanager
def _text(path: str, kind: str, **options: Any) -> Iterator[tuple[io.TextIOWrapper, Callable[[], int]]]:
    with _binary(path, kind) as (f, position):
        text = io.TextIOWrapper(f, encoding="utf-8", errors="replace", **options)
        try:
            yield text, position
        finally:
            text.detach()  # the file is closed by _binary, and its position is read until then


def _line_at(path: str, kind: str, offset: int) -> int:
    """The 1-based line of a file (decompressed, for .gz) that byte `offset` is on: read again to count, only
    for a message."""
    with _binary(path, kind) as (f, _):
        lines = 1
        while offset > 0 and (chunk := f.read(min(offset, 2**20))):
            lines += chunk.count(b"\n")
            offset -= len(chunk)
    return lines


def _numbered(where: str, numbers: Any) -> Callable[[int], str]:
    """Names row i of a batch by its 1-based line, row or record number in `numbers` (`where`: "FILE line")."""
    return lambda i: f"{where} {numbers[i]}"


def _not_json(where: str, e: json.JSONDecodeError | UnicodeDecodeError) -> ConfigError:
    if isinstance(e, UnicodeDecodeError):
        return ConfigError(
            f"{where} is not UTF-8 text (byte {e.object[e.start]:#04x}: {e.reason}): write the file as UTF-8, "
            "or drop that line"
        )
    return ConfigError(f"{where} is not valid JSON ({e.msg} at column {e.colno}): fix that line, or drop it")


def _json_lines(unit: Unit, path: str, field: Fields) -> Iterator[Batch]:
    """Lines whose first byte lies in [start, end): a line straddling `start` belongs to the unit before."""
    batch: list[Any] = []
    starts: list[int] = []  # the byte each row's line starts at (its number is counted for a message only)
    end = unit.end if unit.end >= 0 else sys.maxsize

    def where(at: int) -> str:
        return f"{unit.name} line {_line_at(path, unit.kind, at)}"

    with _binary(path, unit.kind) as (f, position):
        pos = unit.start
        if pos > 0:
            f.seek(pos - 1)
            pos += len(f.readline()) - 1  # the rest of the line that began before this unit
        reported = position()
        while pos < end:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _not_json(where(pos - len(line)), e) from None
            if not _has(record, field):
                present = list(record)[:8] if isinstance(record, dict) else []
                raise _missing(field, where(pos - len(line)), present)
            batch.append(_pick(record, field))
            starts.append(pos - len(line))
            if len(batch) >= BATCH_DOCS:
                yield batch, position() - reported, lambda i, starts=starts: where(starts[i])
                batch, starts, reported = [], [], position()
        yield batch, min(position(), unit.start + unit.size) - reported, lambda i: where(starts[i])


def _json_array(unit: Unit, path: str, field: Fields) -> Iterator[Batch]:
    data = Path(path).read_bytes()
    try:
        records = json.loads(data)
    except json.JSONDecodeError as e:
        raise _not_json(f"{unit.name} line {e.lineno}", e) from None
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise _not_json(f"{unit.name} line {line}", e) from None
    if not isinstance(records, list):
        raise ConfigError(f"{unit.name} is one JSON object, not documents: write one JSON object per line")
    texts = []
    for i, r in enumerate(records):
        if not _has(r, field):
            raise _missing(field, f"{unit.name} record {i + 1}", list(r)[:8] if isinstance(r, dict) else [])
        texts.append(_pick(r, field))
    for i in range(0, len(texts), BATCH_DOCS):
        numbered = _numbered(f"{unit.name} record", range(i + 1, i + 1 + BATCH_DOCS))
        yield texts[i : i + BATCH_DOCS], unit.size if i + BATCH_DOCS >= len(texts) else 0, numbered


def _paragraphs(unit: Unit, path: str) -> Iterator[Batch]:
    """Plain text: blank-line separated paragraphs are the documents (one line each would cut sentences)."""
    batch: list[str] = []
    firsts: list[int] = []  # each paragraph's first line
    lines: list[str] = []
    with _text(path, unit.kind) as (f, position):
        reported = 0
        for n, line in enumerate(f, 1):
            if line.strip():
                if not lines:
                    firsts.append(n)
                lines.append(line.rstrip("\n"))
                continue
            if lines:
                batch.append("\n".join(lines))
                lines = []
            if len(batch) >= BATCH_DOCS:
                yield batch, position() - reported, _numbered(f"{unit.name} line", firsts)
                batch, firsts, reported = [], [], position()
        if lines:
            batch.append("\n".join(lines))
        yield batch, position() - reported, _numbered(f"{unit.name} line", firsts)


def _csv_rows(unit: Unit, path: str, field: Fields) -> Iterator[Batch]:
    csv.field_size_limit(sys.maxsize)  # documents are long
    with _text(path, unit.kind, newline="") as (f, position):
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not _has(dict.fromkeys(reader.fieldnames), field):
            raise _missing(field, f"CSV file {unit.name}", reader.fieldnames)
        batch: list[Any] = []
        firsts: list[int] = []  # each row's first line (a quoted field may hold line breaks)
        read_lines = reader.line_num  # the header's
        reported = 0
        for row in reader:
            batch.append(_pick(row, field))
            firsts.append(read_lines + 1)
            read_lines = reader.line_num
            if len(batch) >= BATCH_DOCS:
                yield batch, position() - reported, _numbered(f"{unit.name} line", firsts)
                batch, firsts, reported = [], [], position()
        yield batch, position() - reported, _numbered(f"{unit.name} line", firsts)


def _record_batches(unit: Unit, path: str, field: Fields) -> Iterator[Batch]:
    import pyarrow as pa

    seen = 0  # rows of the file before the batch
    if unit.kind == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if not _has(dict.fromkeys(parquet.schema_arrow.names), field):
            raise _missing(field, f"parquet file {unit.name}", parquet.schema_arrow.names)
        groups = list(range(parquet.num_row_groups if unit.end < 0 else unit.end))[unit.start :]
        rows = sum(parquet.metadata.row_group(g).num_rows for g in groups) or 1
        seen = sum(parquet.metadata.row_group(g).num_rows for g in range(unit.start))
        batches = parquet.iter_batches(batch_size=BATCH_DOCS, row_groups=groups, columns=_columns(field))
    else:  # a save_to_disk Arrow file (IPC stream format)
        reader = pa.ipc.open_stream(pa.memory_map(path))
        if not _has(dict.fromkeys(reader.schema.names), field):
            raise _missing(field, f"Arrow file {unit.name}", reader.schema.names)
        rows = None
        batches = (b.select(_columns(field)) for b in reader)
    for record_batch in batches:
        column = record_batch if isinstance(field, tuple) else record_batch.column(0)
        for i in range(0, record_batch.num_rows, BATCH_DOCS):
            part = column.slice(i, BATCH_DOCS).to_pylist()
            numbers = range(seen + 1, seen + 1 + len(part))
            seen += len(part)
            yield part, (unit.size * len(part) // rows) if rows else 0, _numbered(f"{unit.name} row", numbers)
    if rows is None:
        yield [], unit.size, _numbered(f"{unit.name} row", ())


def _hub_rows(unit: Unit, field: Fields) -> Iterator[Batch]:
    name, config_name, split = json.loads(unit.location)
    shard = _hub_dataset(name, config_name, split)
    if shard.num_shards > 1:
        shard = shard.shard(num_shards=unit.end, index=unit.start)
    where = f"hub dataset {name} shard {unit.start}"
    batch: list[Any] = []
    size = seen = 0
    for row in shard:
        if not _has(row, field):
            raise _missing(field, where, list(row))
        text = _pick(row, field)
        batch.append(text)
        size += _size(text)
        if len(batch) >= BATCH_DOCS:
            yield batch, size, _numbered(f"{where} row", range(seen + 1, seen + 1 + len(batch)))
            seen += len(batch)
            batch, size = [], 0
    yield batch, size, _numbered(f"{where} row", range(seen + 1, seen + 1 + len(batch)))


def _local_texts(unit: Unit, path: str, field: Fields) -> Iterator[Batch]:
    kind = unit.kind
    if kind == "jsonl-or-array":  # an S3 object: which JSON layout it has is known once it is here
        kind = "jsonarray" if _json_is_array(Path(path)) else "json"
        unit = dataclasses.replace(unit, kind=kind)
    if kind in ("json", "json.gz"):
        return _json_lines(unit, path, field)
    if kind == "jsonarray":
        return _json_array(unit, path, field)
    if kind in ("text", "text.gz"):
        return _paragraphs(unit, path)
    if kind in ("csv", "csv.gz"):
        return _csv_rows(unit, path, field)
    return _record_batches(unit, path, field)


def _size(value: Any) -> int:
    """Characters of text in a value: a document, a row of columns, a conversation."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list):
        return 0
    total = 0
    for v in value:
        if type(v) is str:
            total += len(v)
        elif type(v) is dict:  # a message: its str fields without a call each
            for field in v.values():
                total += len(field) if type(field) is str else _size(field)
        else:
            total += _size(v)
    return total


def _parts(batch: list[Any]) -> Iterator[tuple[int, list[Any]]]:
    """A batch in parts of at most BATCH_TEXT characters (or one longer document), each with its first's index."""
    first, part, size = 0, [], 0
    for i, text in enumerate(batch):
        length = _size(text)
        if part and size + length > BATCH_TEXT:
            yield first, part
            first, part, size = i, [], 0
        part.append(text)
        size += length
    yield first, part


class Reading:
    """A unit's documents being read (read()): iterated, batches of bounded size, each with how many bytes of the
    unit it covered; `where(i)` names document (row) i of the batch last given as a person finds it: its file
    and 1-based line (JSON lines, CSV, text), row (parquet, Arrow, a hub shard) or record (a JSON array)."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self._batches = batches
        # What names the rows of the batch being read, and where in it the part last given starts.
        self._names: Callable[[int], str] = str
        self._first = 0

    def __iter__(self) -> Iterator[tuple[list[Any], int]]:
        for batch, nbytes, names in self._batches:
            self._names = names
            parts = list(_parts(batch))
            for k, (self._first, part) in enumerate(parts):
                yield part, nbytes if k == len(parts) - 1 else 0  # the progress goes with the last part

    def where(self, i: int) -> str:
        return self._names(self._first + i)


def read(unit: Unit, field: Fields, scratch_dir: Path) -> Reading:
    """The unit's documents in batches of bounded size, each with how many bytes of the unit it covered; the
    Reading's `where(i)` names a bad one.

    An S3 object is downloaded into `scratch_dir` for the time it is read, then deleted: disk use is one
    object per process, whatever the dataset's size.
    """
    return Reading(_read(unit, field, scratch_dir))


def _read(unit: Unit, field: Fields, scratch_dir: Path) -> Iterator[Batch]:
    if unit.kind == "hub":
        yield from _hub_rows(unit, field)
        return
    if unit.s3_bucket is None:
        yield from _local_texts(unit, unit.location, field)
        return
    from model_utils.storage import s3

    scratch_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=scratch_dir, suffix=format_suffix(unit.location))
    os.close(fd)
    try:
        s3.download_object(unit.s3_bucket, unit.location, Path(tmp))
        yield from _local_texts(unit, tmp, field)
    finally:
        Path(tmp).unlink(missing_ok=True)


# --- what the rows hold ---------------------------------------------------------------------------------


def first_row(unit: Unit) -> dict[str, Any] | None:
    """The unit's first row as a mapping of its columns (None: plain text files, S3 objects, an empty unit), read
    without reading the rest: what --data_format auto decides by."""
    if unit.s3_bucket is not None or unit.kind in ("text", "text.gz"):
        return None
    if unit.kind == "hub":
        name, config_name, split = json.loads(unit.location)
        return next(iter(_hub_dataset(name, config_name, split)), None)
    if unit.kind in ("json", "json.gz"):
        with _binary(unit.location, unit.kind) as (f, _):
            for line in f:
                if line.strip():
                    try:
                        record = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        return None  # reading says where, in one line
                    return record if isinstance(record, dict) else None
        return None
    if unit.kind == "jsonarray":
        try:
            records = json.loads(Path(unit.location).read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return records[0] if isinstance(records, list) and records and isinstance(records[0], dict) else None
    if unit.kind in ("csv", "csv.gz"):
        with _text(unit.location, unit.kind, newline="") as (f, _):
            return next(csv.DictReader(f), None)
    import pyarrow as pa

    if unit.kind == "parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(unit.location).iter_batches(batch_size=1), None)
    else:
        batch = next(iter(pa.ipc.open_stream(pa.memory_map(unit.location))), None)
    rows = batch.slice(0, 1).to_pylist() if batch is not None else []
    return rows[0] if rows else None
