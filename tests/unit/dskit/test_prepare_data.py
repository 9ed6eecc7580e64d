"""`dskit prepare-data OUT --dataset SOURCE`: the same shards with one or two processes, a --max_tokens prefix,
progress lines in logs, and a run that trains on what it prepared."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from model_utils.config.arguments import DataArgs
from model_utils.data import token_shards
from model_utils.errors import ConfigError
from support.prepared_data import corpus, ids_of, prep, run_data, stream


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
