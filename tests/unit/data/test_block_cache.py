"""The token blocks a run reads: a small dataset prepared once into the cache (read again at any block length, not
tokenized again; changed content prepared anew), and a large unprepared one refused with the command that prepares
it. (The shard format: test_token_shards.py; the order ranks read blocks in: test_sampler.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from dskit import prepare_data
from model_utils.config.arguments import DataArgs
from model_utils.data import token_shards
from model_utils.errors import ConfigError
from support.prepared_data import DOCS, ids_of, run_data, write_jsonl


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
