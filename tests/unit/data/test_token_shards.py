"""The prepared-dataset format: documents packed with an EOS after each and nothing lost, validation held out
per document, blocks across shards, a killed preparation refused then resumed, another tokenizer or other options
refused, and a full disk. Documents from each source: test_documents.py; the cache a run reads: test_block_cache.py;
the command: tests/unit/dskit/test_prepare_data.py."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest

from model_utils.config.arguments import DataArgs
from model_utils.data import documents, token_shards
from model_utils.data.token_shards import TokenBlocks, TokenizerSpec
from model_utils.errors import ConfigError
from support.prepared_data import DOCS, corpus, ids_of, prep, run_data, stream, write_jsonl


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
    # The same file elsewhere (copied to node-local disk, a moved dataset) holds out the same documents.
    (tmp_path / "elsewhere" / "deeper").mkdir(parents=True)
    moved = write_jsonl(tmp_path / "elsewhere" / "deeper" / "d.jsonl", texts)
    copy = run_data(
        DataArgs(dataset=str(moved), validation_fraction=0.1, data_cache_dir=str(tmp_path / "c3")), tokenizer
    )
    assert stream(copy, "validation") == stream(dataset, "validation")


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


def _zero(file: Path, offset: int, length: int) -> None:
    """Bit rot or a torn copy: bytes zeroed in place, the size unchanged (every id still in range)."""
    with file.open("r+b") as f:
        f.seek(offset)
        f.write(bytes(length))


def test_a_corrupted_shard_is_one_line_naming_it_and_the_command_that_re_prepares_it(
    tmp_path: Path, tokenizer, monkeypatch, capsys
) -> None:
    source = corpus(tmp_path, 3000)
    out = tmp_path / "p"
    assert prep(out, "--dataset", str(source), "--num_proc", "1", "--unit_mb", "0.2") == 0
    prepared = token_shards.open_prepared(out)
    before = stream(prepared, "train")
    shard = out / "train" / "00001.bin"
    assert shard.stat().st_size > 64 * 1024
    size = shard.stat().st_size
    _zero(shard, 4096, 64 * 1024)
    assert shard.stat().st_size == size
    with pytest.raises(ConfigError) as refused:
        run_data(DataArgs(dataset=str(out)), tokenizer)
    line = str(refused.value)
    assert "\n" not in line
    assert re.fullmatch(
        rf"prepared data {out}: shard train/00001\.bin does not match its checksum \(xxh3 \w+, its unit recorded "
        rf"\w+\): the data is corrupted or partly copied; re-prepare the units that fail with `(.*)`",
        line,
    ), line
    # The preflight's `dskit prepare` (what the launchers run before any rank starts): that line, exit status 2.
    from dskit import cli

    capsys.readouterr()
    checkpoints = ["--checkpoint_dir", str(tmp_path / "ck"), "--max_steps", "1"]
    assert cli.main(["prepare", "--dataset", str(out), *checkpoints]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {line}"]
    command = re.search(r"`(.*)`", line).group(1)
    assert command == (
        f"dskit prepare-data {out} --dataset {source} --train_split train --text_field text "
        "--validation_fraction 0.02 --model tiny-qwen3 --unit_mb 0.2"
    )
    # The command, as printed, re-tokenizes the damaged unit alone and gives the bytes prepared first.
    tokenized: list[int] = []
    monkeypatch.setattr(token_shards, "write_unit", _counting(token_shards.write_unit, tokenized))
    argv = shlex.split(command)
    assert argv[:2] == ["dskit", "prepare-data"]
    assert prep(Path(argv[2]), *argv[3:]) == 0
    assert tokenized == [1]
    assert stream(token_shards.open_prepared(out), "train") == before


def test_an_untouched_dataset_opened_twice_is_hashed_once(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "p"
    assert prep(out, "--dataset", str(corpus(tmp_path)), "--num_proc", "1", "--unit_mb", "0.02") == 0
    manifest = token_shards.open_prepared(out).manifest
    shards = {s["file"]: s["xxh3"] for split in token_shards.SPLITS for s in manifest["shards"][split]}
    assert len(shards) > 2
    recorded = json.loads((out / token_shards.VERIFIED).read_text())["shards"]
    assert {rel: entry["xxh3"] for rel, entry in recorded.items()} == shards  # every shard, verified

    hashed: list[str] = []
    real_digest = token_shards.shard_digest

    def counting_digest(file: Path) -> str:
        hashed.append(str(file.relative_to(out)))
        return real_digest(file)

    monkeypatch.setattr(token_shards, "shard_digest", counting_digest)
    token_shards.open_prepared(out)
    assert hashed == []  # the second open: a stat per shard, no byte read
    rewritten = next(iter(shards))
    (out / rewritten).write_bytes((out / rewritten).read_bytes())  # the same bytes, written again
    token_shards.open_prepared(out)
    assert hashed == [rewritten]  # only what changed since it was verified
    (out / token_shards.VERIFIED).write_text("{not json")  # a damaged record is only a cold cache
    token_shards.open_prepared(out)
    assert sorted(hashed[1:]) == sorted(shards)


def _fill(directory: Path) -> Path:
    """Fill the filesystem of `directory` to the last byte."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, bytes(1 << 16))
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0")
    finally:
        os.close(fd)
    return filler


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs to fill needs root")
def test_disk_full_writing_the_manifest_or_the_plan_is_one_line_and_leaves_no_temporary_file(
    tmp_path: Path, capsys
) -> None:
    from dskit import cli

    source = corpus(tmp_path)
    args = ["--dataset", str(source), "--num_proc", "1"]
    with tiny_filesystem(tmp_path / "small", "4m") as small:
        out = small / "p"
        assert prep(out, *args) == 0
        (out / "manifest.json").unlink()  # every unit done, the manifest still to write
        filler = _fill(small)
        capsys.readouterr()
        assert cli.main(["prepare-data", str(out), *args]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        assert re.fullmatch(
            rf"error: disk full writing the manifest in {out} \(0\.0 MiB free\): free space or pass another "
            r"output dir; a re-run keeps the units already finished",
            lines[0],
        ), lines[0]
        assert not (out / "manifest.json").exists()
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
        # A new preparation's plan: one line too, and the new dir left empty.
        assert cli.main(["prepare-data", str(small / "q"), *args]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"error: disk full writing the plan in {small / 'q'} ("
        ), lines
        assert list((small / "q").iterdir()) == []
        # Space freed, the same command finishes it.
        filler.unlink()
        assert prep(out, *args) == 0
        assert token_shards.state(out) == "prepared"


@pytest.mark.parametrize("frozen_before", [False, True])
def test_a_unit_is_written_with_the_older_objects_out_of_the_collector(
    frozen_before: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's objects are frozen while a unit is tokenized and given back after (an exception too); what a
    forking server froze before stays frozen."""
    seen: list[int] = []

    def unit(*args: object) -> dict:
        seen.append(gc.get_freeze_count())
        raise RuntimeError("the unit failed")

    monkeypatch.setattr(token_shards, "_write_text_unit", unit)
    gc.unfreeze()
    if frozen_before:
        gc.freeze()
    try:
        with pytest.raises(RuntimeError):
            token_shards.write_unit(Path("unused"), 0, {"data_format": "text"}, None)  # type: ignore[arg-type]
        assert seen[0] > 0
        # Given back, or left frozen (the count only drops as frozen objects die meanwhile)
        assert (gc.get_freeze_count() > 0) == frozen_before
    finally:
        gc.unfreeze()
