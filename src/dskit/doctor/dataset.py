"""The dataset: the embedded corpus, a local path (save_to_disk data or data files, with the text column), a
Hugging Face hub dataset (or its local cache when offline) or an S3 URI, each checked without loading it in full.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from model_utils.config.arguments import DataArgs
from model_utils.errors import ConfigError, first_line

from .context import _size
from .report import Result, Status


def _hub_offline() -> bool:
    return any(
        os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _peek_columns(path: Path, builder: str) -> list[str] | None:
    """Column names of a data file from its first record or schema, without loading it; None if unknown."""
    if builder == "text":
        return ["text"]
    if builder == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with path.open("r", encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    if builder == "csv":
        import csv

        return next(csv.reader([first]), [])
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return None  # a pretty-printed JSON document: only a full load can tell
    return list(record) if isinstance(record, dict) else None


def _check_prepared(path: Path, found: str) -> Result:
    from model_utils.data import token_shards

    if found == "unfinished":
        left = len(token_shards.missing_units(path))
        return Result(
            "dataset",
            Status.FAIL,
            f"{path} is an unfinished preparation ({left} units not done)",
            "re-run the same `dskit prepare-data` command to finish it",
        )
    manifest = token_shards.open_prepared(path).manifest
    tokens = manifest["tokens"]
    return Result(
        "dataset",
        Status.PASS,
        f"prepared dataset {path}: {tokens['train']:,} train, {tokens['validation']:,} validation tokens "
        f"({manifest['tokenizer']['name']} tokenizer)",
    )


def _check_local_dataset(path: Path, data: DataArgs) -> Result:
    from model_utils.data import documents, token_shards

    name = "dataset"
    if not path.exists():
        return Result(
            name,
            Status.FAIL,
            f"dataset path {path} does not exist",
            "check --dataset (or --local_dataset false for a hub name)",
        )
    if not os.access(path, os.R_OK):
        return Result(name, Status.FAIL, f"{path} is not readable", f"fix the permissions of {path}")
    if path.is_dir() and (found := token_shards.state(path)) is not None:
        return _check_prepared(path, found)
    if path.is_dir() and documents.is_saved_dataset(path):
        import datasets

        try:  # memory-mapped Arrow: opening it reads no rows
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError, FileNotFoundError) as e:
            return Result(
                name, Status.FAIL, f"{path} does not load ({first_line(e)})", "re-save it with save_to_disk"
            )
        if isinstance(loaded, datasets.DatasetDict):
            if data.train_split not in loaded:
                return Result(
                    name,
                    Status.FAIL,
                    f"{path} has no split {data.train_split!r} (splits: {', '.join(loaded)})",
                    "pass --train_split",
                )
            loaded = loaded[data.train_split]
        elif data.train_split != "train":
            return Result(
                name, Status.FAIL, f"{path} is a single split, not {data.train_split!r}", "drop --train_split"
            )
        columns, rows = loaded.column_names, f"{loaded.num_rows:,} rows"
        found = f"save_to_disk dataset {path}: {rows}"
    else:
        if data.train_split != "train":
            return Result(
                name,
                Status.FAIL,
                f"local files {path} form one split, not {data.train_split!r}",
                "drop --train_split",
            )
        try:
            files = documents.data_files(path)
            builder = documents.TEXT_FORMATS[files[0].suffix]
        except ConfigError as e:
            return Result(name, Status.FAIL, str(e).split(":")[0], "point --dataset at supported data")
        sizes = [Path(f).stat().st_size for f in files]
        if not any(sizes):
            return Result(
                name, Status.FAIL, f"dataset {path} is empty", "point --dataset at files with documents"
            )
        first = next(Path(f) for f, s in zip(files, sizes, strict=True) if s)
        try:
            columns = _peek_columns(first, builder)
        except (OSError, ValueError) as e:
            return Result(
                name,
                Status.FAIL,
                f"{first} is not readable {builder} ({first_line(e)})",
                "check the file format",
            )
        found = f"{len(files)} {builder} file{'s' if len(files) > 1 else ''} ({_size(sum(sizes))}) in {path}"
        if columns is None:
            return Result(name, Status.PASS, f"{found} (columns known only after loading)")
    needed = _columns_read(data, list(columns))
    missing = [c for c in needed if c not in columns]
    if missing:
        return Result(
            name,
            Status.FAIL,
            f"{found}, no column {missing[0]!r} (columns: {', '.join(columns)})",
            "pass --text_field with the column holding the text"
            if data.data_format in ("text", "auto")
            else "pass --data_format naming what the rows hold",
        )
    shown = " and ".join(repr(c) for c in needed)
    return Result(name, Status.PASS, f"{found}, column{'s' if len(needed) > 1 else ''} {shown}")


def _columns_read(data: DataArgs, columns: list[str]) -> list[str]:
    """The columns preparation reads for --data_format (auto: as chat.decide_format decides from a row holding
    these columns; a column's values are unknown here, so a present --text_field reads as text)."""
    from model_utils.data import chat

    if data.data_format == "auto" and data.text_field in columns:
        return [data.text_field]
    row: dict[str, list] = {column: [] for column in columns}  # any column might hold conversations
    _, fields, _ = chat.decide_format(data, row)
    return list(fields) if isinstance(fields, tuple) else [fields]


def _check_hub_dataset(data: DataArgs) -> Result:
    name = "dataset"
    repo = data.dataset
    if _hub_offline():
        import datasets
        from huggingface_hub import constants

        caches = [
            Path(constants.HF_HUB_CACHE) / f"datasets--{repo.replace('/', '--')}",
            Path(datasets.config.HF_DATASETS_CACHE) / repo.replace("/", "___"),
        ]
        cached = [str(c) for c in caches if c.exists()]
        if cached:
            return Result(
                name, Status.PASS, f"hub dataset {repo}: offline, found in the local cache {cached[0]}"
            )
        return Result(
            name,
            Status.WARN,
            f"hub dataset {repo}: offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE), and not in the local caches",
            "download it once with network access, unset the offline variables, or pass a local path",
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        info = HfApi().dataset_info(repo, timeout=10)
    except GatedRepoError:
        return Result(
            name,
            Status.FAIL,
            f"hub dataset {repo} is gated",
            "accept its terms on huggingface.co and set HF_TOKEN (or `hf auth login`)",
        )
    except RepositoryNotFoundError:
        return Result(
            name,
            Status.FAIL,
            f"no dataset {repo!r} on the Hugging Face hub (or it is private)",
            "check --dataset (or --local_dataset true for a local path); set HF_TOKEN for a private one",
        )
    except (HfHubHTTPError, OSError, ValueError) as e:
        return Result(
            name,
            Status.WARN,
            f"could not reach the hub for {repo} ({first_line(e)})",
            "check the network (HF_ENDPOINT, proxy), or download it once and pass a local path",
        )
    return Result(name, Status.PASS, f"hub dataset {info.id} exists (not downloaded by the doctor)")


def _check_s3_dataset(uri: str, cache_dir: Path) -> Result:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    from model_utils.storage.s3 import describe_error, error_kind, parse_s3_uri

    name = "dataset"
    bucket, prefix = parse_s3_uri(uri)
    mirror = cache_dir / "s3" / bucket / prefix
    cached = f"; a copy from an earlier run is in {mirror}" if mirror.exists() else ""
    config = Config(connect_timeout=5, read_timeout=10, retries={"total_max_attempts": 2})
    client = boto3.session.Session().client("s3", config=config)
    try:
        listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=10)
        count = listing.get("KeyCount", 0)
        if count == 0 and prefix:  # s3://bucket/file.jsonl names one object
            client.head_object(Bucket=bucket, Key=prefix)
            count = 1
    except (BotoCoreError, ClientError) as e:
        kind = error_kind(e)
        if kind == "credentials":
            return Result(
                name,
                Status.FAIL,
                f"no AWS credentials to read {uri}",
                "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or attach an instance role",
            )
        if kind == "not_found":
            return Result(name, Status.FAIL, f"no objects under {uri}", "check the dataset URI")
        if kind == "no_bucket":
            return Result(name, Status.FAIL, f"S3 bucket {bucket} does not exist", "fix the dataset URI")
        if kind == "unreachable":
            return Result(
                name,
                Status.FAIL,
                f"cannot reach S3 for {uri} ({describe_error(e)}){cached}",
                "check the network and AWS_ENDPOINT_URL",
            )
        return Result(
            name, Status.FAIL, f"no access to {uri} ({describe_error(e)})", "check the credentials/role"
        )
    more = "+" if count >= 10 else ""
    return Result(name, Status.PASS, f"{uri}: {count}{more} objects readable{cached}")


def check_dataset(data: DataArgs) -> Result:
    from model_utils.assets import CORPUS_PATH
    from model_utils.data.documents import EMBEDDED

    name = data.dataset
    if name == EMBEDDED:
        if not CORPUS_PATH.is_file():
            return Result(
                "dataset", Status.FAIL, f"embedded corpus {CORPUS_PATH} is missing", "git checkout it"
            )
        return Result("dataset", Status.PASS, f"embedded corpus ({_size(CORPUS_PATH.stat().st_size)})")
    if name.startswith("s3://"):
        return _check_s3_dataset(name, Path(data.data_cache_dir))
    from model_utils.data.documents import is_local

    path = Path(name).expanduser()
    return _check_local_dataset(path, data) if is_local(data) else _check_hub_dataset(data)
