"""Where documents come from: every local format, a directory of files, S3 objects, a streamed hub dataset's
shards, and the refusals of bad datasets (one line naming the file, the field or the split)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from model_utils.config.arguments import DataArgs
from model_utils.data import documents, token_shards
from model_utils.data.token_shards import TokenizerSpec
from model_utils.errors import ConfigError
from support.prepared_data import DOCS, ids_of, prep, run_data, stream, write_jsonl


@pytest.mark.parametrize(
    "kind", ["txt", "txt.gz", "jsonl", "jsonl.gz", "json-array", "csv", "parquet", "saved", "dir"]
)
def test_local_dataset_formats(tmp_path: Path, kind: str, tokenizer) -> None:
    import datasets

    texts = ["first document", "second document, with a comma", "third"]
    ds = datasets.Dataset.from_dict({"text": texts})
    if kind == "txt":
        path = tmp_path / "d.txt"
        path.write_text("\n\n".join(texts) + "\n")  # blank-line separated paragraphs are the documents
    elif kind == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", texts)
    elif kind.endswith(".gz"):  # compressed corpora as published (C4's .json.gz)
        plain = tmp_path / f"d.{kind[:-3]}"
        if kind == "txt.gz":
            plain.write_text("\n\n".join(texts) + "\n")
        else:
            write_jsonl(plain, texts)
        path = tmp_path / f"d.{kind}"
        path.write_bytes(gzip.compress(plain.read_bytes()))
        plain.unlink()
    elif kind == "json-array":
        path = tmp_path / "d.json"
        path.write_text(json.dumps([{"text": t} for t in texts]))
    elif kind == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(str(path), index=False)
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif kind == "saved":
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds, "validation": ds.select([0])}).save_to_disk(str(path))
    else:
        path = tmp_path / "files"
        path.mkdir()
        write_jsonl(path / "a.jsonl", texts[:2])
        write_jsonl(path / "b.jsonl", texts[2:])
    data = DataArgs(dataset=str(path), validation_fraction=0, data_cache_dir=str(tmp_path / "c"))
    assert stream(run_data(data, tokenizer), "train") == ids_of(tokenizer, texts)
    if kind == "saved":
        data = DataArgs(dataset=str(path), validation_split="validation", data_cache_dir=str(tmp_path / "c"))
        assert stream(run_data(data, tokenizer), "validation") == ids_of(tokenizer, texts[:1])


def test_hub_streaming_path_reads_shards(tmp_path: Path, tokenizer) -> None:
    # A directory given as a hub name goes through the same streamed load_dataset(..., streaming=True) path as
    # a hub dataset (the hub itself cannot be reached here): its files are the shards.
    (tmp_path / "hubby").mkdir()
    write_jsonl(tmp_path / "hubby" / "a.jsonl", DOCS[:2])
    write_jsonl(tmp_path / "hubby" / "b.jsonl", DOCS[2:])
    data = DataArgs(dataset=str(tmp_path / "hubby"), local_dataset=False, validation_fraction=0)
    plan = documents.plan(data)
    assert [u.kind for u in plan.units] == ["hub", "hub"] and plan.total_bytes is None
    record = token_shards.plan_record(data, plan, TokenizerSpec.of(tokenizer, "t"), None)
    token_shards.prepare_in_process(tmp_path / "p", record, TokenizerSpec.of(tokenizer, "t"))
    assert stream(token_shards.open_prepared(tmp_path / "p"), "train") == ids_of(tokenizer, DOCS)


def test_a_field_missing_in_one_file_names_it(tmp_path: Path, tokenizer) -> None:
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", ["fine"] * 3)
    b = tmp_path / "d" / "b.jsonl"
    b.write_text('{"text": "fine"}\n' * 2 + '{"content": "oops"}\n')
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(b))} line 3 has no field 'text' \(fields: content\)"
    ):
        prep(tmp_path / "p", "--dataset", str(tmp_path / "d"))
    assert token_shards.state(tmp_path / "p") == "unfinished"


def _names(data: DataArgs, unit_bytes: int, field: documents.Fields = "text") -> list[str]:
    """Every row's name, as read() gives it, unit by unit."""
    names = []
    for unit in documents.plan(data, unit_bytes).units:
        reading = documents.read(unit, field, Path("unused"))
        for batch, _ in reading:
            names += [reading.where(i) for i in range(len(batch))]
    return names


def test_each_row_is_named_by_its_1_based_line_or_row(tmp_path: Path) -> None:
    import datasets
    import pyarrow.parquet as pq

    lines = [json.dumps({"text": f"document {i}"}) for i in range(40)]
    lines[5:5] = ["", "  "]  # blank lines count as lines, not rows
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    numbers = [*range(1, 6), *range(8, 43)]
    assert len(documents.plan(DataArgs(dataset=str(jsonl)), 200).units) > 3  # units inside the file
    assert _names(DataArgs(dataset=str(jsonl)), 200) == [f"{jsonl} line {n}" for n in numbers]
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    assert _names(DataArgs(dataset=str(gz)), 200) == [f"{gz} line {n}" for n in numbers]
    csv = tmp_path / "d.csv"
    csv.write_text('text\nfirst\n"two\nlines"\nthird\n')  # a quoted line break: the row starts on line 3
    assert _names(DataArgs(dataset=str(csv)), 200) == [f"{csv} line {n}" for n in (2, 3, 5)]
    parquet = tmp_path / "d.parquet"
    pq.write_table(datasets.Dataset.from_dict({"text": ["x"] * 12}).data.table, parquet, row_group_size=5)
    assert len(documents.plan(DataArgs(dataset=str(parquet)), 1).units) == 3  # a unit per row group
    assert _names(DataArgs(dataset=str(parquet)), 1) == [f"{parquet} row {n}" for n in range(1, 13)]
    array = tmp_path / "d.json"
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert _names(DataArgs(dataset=str(array)), 200) == [f"{array} record {n}" for n in (1, 2)]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b'{"text": "caf\xe9"}', r"is not UTF-8 text \(byte 0xe9: invalid continuation byte\)"),
        (b'{"text": "a" "b"}', r"is not valid JSON \(Expecting ',' delimiter at column 14\)"),
    ],
)
@pytest.mark.parametrize("at", [0, 10])
@pytest.mark.parametrize("num_proc", ["1", "2"])
def test_a_bad_line_is_one_line_naming_it(
    tmp_path: Path, bad: bytes, message: str, at: int, num_proc
) -> None:
    lines = [json.dumps({"text": f"document {i}"}).encode() for i in range(20)]
    lines[at] = bad  # the first line (which --data_format auto reads too), or one in a later unit
    source = tmp_path / "d.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    args = ["--dataset", str(source), "--unit_mb", "0.0001", "--num_proc", num_proc]  # the workers read it
    with pytest.raises(ConfigError) as raised:
        prep(tmp_path / "p", *args)
    line = str(raised.value)
    assert re.fullmatch(rf"{re.escape(str(source))} line {at + 1} {message}: [^\n]+", line), line
    assert token_shards.state(tmp_path / "p") == "unfinished"


def test_s3_source_is_read_object_by_object(tmp_path: Path, tokenizer, s3) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": DOCS[2:]}).to_parquet(str(tmp_path / "b.parquet"))
    body = "".join(json.dumps({"text": t}) + "\n" for t in DOCS[:2])
    s3.client.put_object(Bucket=s3.bucket, Key="data/a.jsonl", Body=body)
    s3.client.put_object(Bucket=s3.bucket, Key="data/b.parquet", Body=(tmp_path / "b.parquet").read_bytes())
    assert (
        prep(tmp_path / "p", "--dataset", s3.uri("data"), "--validation_fraction", "0", "--num_proc", "2")
        == 0
    )
    prepared = token_shards.open_prepared(tmp_path / "p")
    assert stream(prepared, "train") == ids_of(tokenizer, DOCS)
    assert not (tmp_path / "p" / ".staging").exists()  # the downloaded objects are gone
    s3.client.put_object(Bucket=s3.bucket, Key="bad/c.jsonl", Body=body + "{oops\n")
    bad = s3.uri("bad/c.jsonl")  # as it is named in S3, not its downloaded copy
    with pytest.raises(ConfigError, match=rf"^{bad} line 3 is not valid JSON"):
        prep(tmp_path / "bad", "--dataset", s3.uri("bad"), "--num_proc", "1")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: DataArgs(dataset=str(p / "missing.jsonl")), "does not exist"),
        (
            lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", ["x"], field="body"))),
            "has no field 'text' \\(fields: body\\)",
        ),
        (lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", []))), "is empty"),
        (lambda p: DataArgs(dataset=str(p)), "is not a save_to_disk dir nor"),
        (
            lambda p: DataArgs(dataset=str((p / "bad.jsonl").write_text("{oops\n") and p / "bad.jsonl")),
            "bad.jsonl line 1 is not valid JSON",
        ),
        (  # the preflight's reading, in one line
            lambda p: DataArgs(
                dataset=str((p / "b.jsonl").write_bytes(b'{"text": "\xff"}\n') and p / "b.jsonl")
            ),
            "b.jsonl line 1 is not UTF-8 text",
        ),
        (
            lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", ["a", "b"])), validation_split="test"),
            "single split",
        ),
        (
            lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", ["one " * 1000]))),
            "validation data held out of .*d.jsonl \\(--validation_fraction 0.02\\) has 0 tokens, fewer than one block",
        ),
    ],
)
def test_bad_datasets(tmp_path: Path, setup, message: str, tokenizer) -> None:
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import resolver

    data = setup(tmp_path)
    args = [
        "--dataset",
        data.dataset,
        "--data_cache_dir",
        str(tmp_path / "c"),
        "--checkpoint_dir",
        str(tmp_path / "ck"),
    ]
    if data.validation_split:
        args += ["--validation_split", data.validation_split]
    with pytest.raises(ConfigError, match=message):
        resolver.prepare(parse_args(args))
