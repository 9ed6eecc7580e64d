"""Preparing data: sources read as documents, token shards written crash-safely, blocks read by memory map,
the preflight's small-data path and its refusals, and `dskit prepare-data` (parallel, resumable, a prefix)."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dskit import prepare_data
from embedded_assets import TOKENIZER_DIR
from model_utils.config.arguments import DataArgs
from model_utils.data import block_cache, documents, token_shards
from model_utils.data.token_shards import TokenBlocks, TokenizerSpec
from model_utils.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def ids_of(tokenizer, texts: list[str]) -> list[int]:
    eos = tokenizer.eos_token_id
    return [t for d in texts for t in [*tokenizer(d, add_special_tokens=False)["input_ids"], eos]]


def here(fn):
    return fn()


def run_data(data: DataArgs, tokenizer, explicit: frozenset[str] = frozenset()):
    return block_cache.prepared(data, explicit, tokenizer, "tiny-qwen3", here)


def stream(dataset, split: str) -> list[int]:
    blocks = dataset.blocks(split, 1)  # one-token blocks: the whole token stream, in order
    return blocks[np.arange(len(blocks))].reshape(-1).tolist()


DOCS = [
    "The cat sat on the mat.",
    "Seven plus five is twelve. " * 40,  # longer than a block: must not be truncated
    "A short one.",
    "Zoë and José went to the market to buy bread and milk.",
]


def test_packing_loses_no_token_and_puts_eos_after_every_document(tmp_path: Path, tokenizer) -> None:
    data = DataArgs(
        dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)),
        validation_fraction=0,
        data_cache_dir=str(tmp_path / "c"),
    )
    dataset = run_data(data, tokenizer)
    expected = ids_of(tokenizer, DOCS)
    seq = 16
    blocks = dataset.blocks("train", seq)
    rows = blocks[np.arange(len(blocks))]
    assert rows.shape == (len(expected) // seq, seq)
    # The blocks are the exact token stream, in document order, cut only at the end: no padding, no truncation.
    assert rows.reshape(-1).tolist() == expected[: rows.size]
    assert len(expected) - rows.size < seq
    eos_positions = [i for i, t in enumerate(expected) if t == tokenizer.eos_token_id]
    assert len(eos_positions) == len(DOCS)
    assert tokenizer.decode(expected[: eos_positions[0]]) == DOCS[0]
    assert dataset.manifest["dtype"] == "uint16" and dataset.manifest["tokens"]["train"] == len(expected)


def test_second_run_reads_the_cache_at_any_block_length(tmp_path: Path, tokenizer, monkeypatch) -> None:
    data = DataArgs(
        dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)),
        validation_fraction=0,
        data_cache_dir=str(tmp_path / "c"),
    )
    first = run_data(data, tokenizer).blocks("train", 8)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(token_shards, "write_unit", no_tokenizing)
    again = run_data(data, tokenizer)
    assert np.array_equal(again.blocks("train", 8)[np.arange(len(first))], first[np.arange(len(first))])
    assert len(again.blocks("train", 9)) == len(ids_of(tokenizer, DOCS)) // 9  # blocks are cut at read time
    write_jsonl(tmp_path / "d.jsonl", [*DOCS, "one more"])  # changed content: a new preparation
    with pytest.raises(AssertionError, match="tokenized again"):
        run_data(data, tokenizer)


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


def test_validation_is_held_out_at_document_level(tmp_path: Path, tokenizer) -> None:
    texts = [f"document number {i}" for i in range(100)]
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    data = DataArgs(dataset=str(path), validation_fraction=0.1, data_cache_dir=str(tmp_path / "c"))
    dataset = run_data(data, tokenizer)
    assert dataset.manifest["documents"] == {"train": 90, "validation": 10}
    eos = tokenizer.eos_token_id

    def decode(ids: list[int]) -> set[str]:
        return {
            tokenizer.decode(d) for d in np.split(ids, np.where(np.array(ids) == eos)[0] + 1) if len(d) > 1
        }

    val = {t.replace("<|endoftext|>", "") for t in decode(stream(dataset, "validation"))}
    train = {t.replace("<|endoftext|>", "") for t in decode(stream(dataset, "train"))}
    assert len(val) == 10 and len(train) == 90 and not val & train
    assert val | train == set(texts)
    again = run_data(
        DataArgs(dataset=str(path), validation_fraction=0.1, data_cache_dir=str(tmp_path / "c2")), tokenizer
    )
    assert stream(again, "validation") == stream(dataset, "validation")  # deterministic


def test_a_separate_validation_dataset(tmp_path: Path, tokenizer) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", DOCS)
    held = write_jsonl(tmp_path / "valid.jsonl", ["A held out document.", "And another one."])
    data = DataArgs(dataset=str(train), validation_dataset=str(held), data_cache_dir=str(tmp_path / "c"))
    dataset = run_data(data, tokenizer)
    assert stream(dataset, "train") == ids_of(tokenizer, DOCS)  # nothing held out of the training data
    assert stream(dataset, "validation") == ids_of(tokenizer, ["A held out document.", "And another one."])
    assert dataset.manifest["validation"] == {"dataset": str(held)}
    with pytest.raises(ConfigError, match="--validation_dataset and --validation_fraction both given"):
        prep(
            tmp_path / "p",
            "--dataset",
            str(train),
            "--validation_dataset",
            str(held),
            "--validation_fraction",
            "0.1",
        )


def test_blocks_run_across_shards() -> None:
    a, b, c = np.arange(0, 7), np.arange(7, 9), np.arange(9, 20)
    blocks = TokenBlocks(
        [a.astype(np.uint16), b.astype(np.uint16), np.zeros(0, np.uint16), c.astype(np.uint16)], 5
    )
    assert len(blocks) == 4  # 20 tokens: 4 blocks of 5, none lost at shard ends
    assert blocks[np.array([1, 3, 0])].tolist() == [[5, 6, 7, 8, 9], [15, 16, 17, 18, 19], [0, 1, 2, 3, 4]]
    assert blocks[np.array([[1], [2]])].shape == (2, 1, 5)
    with pytest.raises(IndexError):
        blocks[np.array([4])]


def corpus(tmp_path: Path, n: int = 400) -> Path:
    texts = [
        f"Document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 7) for i in range(n)
    ]
    return write_jsonl(tmp_path / "corpus.jsonl", texts)


def prep(out: Path, *args: str) -> int:
    return prepare_data.main([str(out), *args])


def test_prepare_data_is_the_same_with_one_or_two_processes_and_trains_as_prepared(
    tmp_path: Path, tokenizer
) -> None:
    source = corpus(tmp_path)
    common = ["--dataset", str(source), "--unit_mb", "0.02", "--validation_fraction", "0.05"]
    assert prep(tmp_path / "one", *common, "--num_proc", "1") == 0
    assert prep(tmp_path / "two", *common, "--num_proc", "2") == 0
    one = token_shards.open_prepared(tmp_path / "one")
    two = token_shards.open_prepared(tmp_path / "two")
    assert one.manifest["units"] > 2
    assert one.manifest["shards"] == two.manifest["shards"]  # same bytes, whichever process made which unit
    assert stream(one, "train") + stream(one, "validation") != []
    texts = [json.loads(line)["text"] for line in source.read_text().splitlines()]
    assert sorted(stream(one, "train") + stream(one, "validation")) == sorted(ids_of(tokenizer, texts))
    # A run trains on it as it is: no tokenizing, and the flags fixed at preparation are refused.
    data = DataArgs(dataset=str(tmp_path / "one"))
    assert stream(run_data(data, tokenizer), "train") == stream(one, "train")
    with pytest.raises(ConfigError, match="--validation_fraction apply when data is prepared"):
        run_data(data, tokenizer, frozenset({"validation_fraction"}))


def test_interrupted_preparation_is_refused_then_resumed(tmp_path: Path, tokenizer, monkeypatch) -> None:
    source = corpus(tmp_path)
    args = ["--dataset", str(source), "--num_proc", "1", "--unit_mb", "0.03"]
    assert prep(tmp_path / "whole", *args) == 0
    real_read = documents.read
    calls = []

    def crash_in_unit_2(unit, field, scratch):
        calls.append(unit.start)
        for i, item in enumerate(real_read(unit, field, scratch)):
            if len(calls) == 3 and i == 0:
                yield item
                raise KeyboardInterrupt  # killed mid-unit
            yield item

    monkeypatch.setattr(documents, "read", crash_in_unit_2)
    with pytest.raises(KeyboardInterrupt):
        prep(tmp_path / "cut", *args)
    out = tmp_path / "cut"
    assert token_shards.state(out) == "unfinished" and not (out / "manifest.json").exists()
    assert sorted(p.name for p in (out / "units").iterdir()) == ["00000.json", "00001.json"]
    assert not [p for p in (out / ".staging").rglob("*") if p.is_file()]  # the cut shard is gone
    with pytest.raises(ConfigError, match=r"unfinished preparation .* re-run the same `dskit prepare-data`"):
        run_data(DataArgs(dataset=str(out)), tokenizer)
    monkeypatch.setattr(documents, "read", real_read)
    tokenized = []
    monkeypatch.setattr(token_shards, "write_unit", _counting(token_shards.write_unit, tokenized))
    assert prep(out, *args) == 0
    units = token_shards.open_prepared(out).manifest["units"]
    assert tokenized == list(range(2, units))  # only the units not done
    assert (
        token_shards.open_prepared(out).manifest["shards"]
        == token_shards.open_prepared(tmp_path / "whole").manifest["shards"]
    )


def _counting(fn, seen: list[int]):
    def wrapped(out, index, *args, **kwargs):
        seen.append(index)
        return fn(out, index, *args, **kwargs)

    return wrapped


def test_max_tokens_prepares_a_prefix(tmp_path: Path, tokenizer, monkeypatch) -> None:
    source = corpus(tmp_path)
    args = ["--dataset", str(source), "--validation_fraction", "0", "--unit_mb", "0.02"]
    assert prep(tmp_path / "all", *args, "--num_proc", "1") == 0
    assert prep(tmp_path / "some", *args, "--num_proc", "2", "--max_tokens", "5000") == 0
    some = token_shards.open_prepared(tmp_path / "some")
    assert some.manifest["tokens"]["train"] == 5000
    assert len(list((tmp_path / "some" / "units").iterdir())) < some.manifest["units"]  # stopped early
    assert stream(some, "train") == stream(token_shards.open_prepared(tmp_path / "all"), "train")[:5000]


def test_progress_lines_in_logs(tmp_path: Path, capsys) -> None:
    source = corpus(tmp_path)
    assert prep(tmp_path / "p", "--dataset", str(source), "--unit_mb", "0.02", "--progress_every", "0") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " units, " in line]
    assert lines, "a line per update when not on a terminal"  # (stdout is captured: no bar)
    assert re.fullmatch(r"prepare-data: \d+/\d+ units, [\d,]+ MB of [\d,]+ MB read, [\d.,]+M tokens, "
                        r"[\d.]+M tokens/s, eta [\d.]+ min", lines[-1]), lines[-1]  # fmt: skip


def test_other_tokenizer_or_options_are_refused(tmp_path: Path, tokenizer) -> None:
    source = corpus(tmp_path, 20)
    assert prep(tmp_path / "p", "--dataset", str(source)) == 0
    other = TokenizerSpec("other", tokenizer.backend_tokenizer.to_str(), 1, 2048)
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"], manifest["tokenizer"]["name"] = other.fingerprint, "other-tok"
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="tokenized with another tokenizer \\(other-tok, not tiny-qwen3\\)"):
        run_data(DataArgs(dataset=str(tmp_path / "p")), tokenizer)
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "plan.json").write_text((tmp_path / "p" / "plan.json").read_text())
    with pytest.raises(
        ConfigError, match="holds a preparation of other data or options \\(differs in: text_field\\)"
    ):
        prep(tmp_path / "q", "--dataset", str(source), "--text_field", "body")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty and holds no preparation"):
        prep(tmp_path / "r", "--dataset", str(source))
    assert (tmp_path / "r" / "notes.txt").read_text() == "mine"


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
            "is not valid JSON",
        ),
        (
            lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", ["a", "b"])), validation_split="test"),
            "single split",
        ),
        (
            lambda p: DataArgs(dataset=str(write_jsonl(p / "d.jsonl", ["one " * 1000]))),
            "validation data of .* fewer than one block",
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


def test_a_field_missing_in_one_file_names_it(tmp_path: Path, tokenizer) -> None:
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", ["fine"] * 3)
    write_jsonl(tmp_path / "d" / "b.jsonl", ["oops"], field="content")
    with pytest.raises(
        ConfigError, match=r"record at byte 0 of .*b.jsonl has no field 'text' \(fields: content\)"
    ):
        prep(tmp_path / "p", "--dataset", str(tmp_path / "d"))
    assert token_shards.state(tmp_path / "p") == "unfinished"


def test_a_large_unprepared_dataset_is_refused_with_the_command(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "big.jsonl", ["x" * 1000] * 1200)  # 1.2 MB
    data = DataArgs(
        dataset=str(path), unprepared_limit_mb=1, text_field="text", data_cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(ConfigError) as refused:
        run_data(data, tokenizer)
    line = str(refused.value)
    assert "is 1 MB, over --unprepared_limit_mb 1" in line and "\n" not in line
    assert not (tmp_path / "c").exists()  # nothing tokenized, nothing written
    # The command it gives runs as it is, and the run then trains on what it prepared.
    command = shlex.split(re.search(r"`(dskit prepare-data [^`]+)`", line).group(1))
    assert command[:4] == ["dskit", "prepare-data", "PREPARED_DIR", "--dataset"]
    assert prepare_data.main([str(tmp_path / "prepared"), *command[3:]]) == 0
    dataset = run_data(DataArgs(dataset=str(tmp_path / "prepared")), tokenizer)
    assert dataset.tokens("train") + dataset.tokens("validation") == 1200 * len(
        ids_of(tokenizer, ["x" * 1000])
    )


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


@contextlib.contextmanager
def tiny_filesystem(path: Path, size: str):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs to fill needs root")
def test_disk_full_is_one_line_and_leaves_nothing_looking_complete(tmp_path: Path) -> None:
    texts = [f"{i} " + "lorem ipsum dolor sit amet " * 50 for i in range(3000)]  # ~4 MB, ~1.7M tokens
    source = write_jsonl(tmp_path / "d.jsonl", texts)
    with tiny_filesystem(tmp_path / "small", "1m") as small:
        with pytest.raises(
            ConfigError, match=r"disk full writing unit \d+ in .*: free space or pass another output dir"
        ):
            prep(small / "p", "--dataset", str(source), "--num_proc", "1", "--unit_mb", "0.2")
        out = small / "p"
        assert token_shards.state(out) == "unfinished"
        for record in (out / "units").glob("*.json"):  # every unit with a record is whole
            assert token_shards.unit_done(out, int(record.stem)) is not None
        assert not [p for p in (out / ".staging").rglob("*") if p.is_file()]
