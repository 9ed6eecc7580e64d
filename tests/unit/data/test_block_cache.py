"""The token blocks a run reads: a small dataset prepared once into the cache (read again at any block length, not
tokenized again; changed content prepared anew), and a large unprepared one refused with the command that prepares
it. (The shard format: test_token_shards.py; the order ranks read blocks in: test_sampler.py.)"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from dskit import prepare_data
from model_utils.config.arguments import DataArgs
from model_utils.data import block_cache, token_shards
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


# Two of these start together (a sweep, two jobs on one --data_cache_dir): each round, both prepare the same new
# dataset into the same new cache at the same moment (a barrier of files), as the launches' preflights do.
RACER = """
import json, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from model_utils.config.arguments import DataArgs
from model_utils.data import block_cache
from model_utils.assets import TOKENIZER_DIR
root, me, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
for r in range(rounds):
    (root / f"ready-{r}-{me}").touch()
    while not (root / f"go-{r}").exists():
        time.sleep(0.001)
    data = DataArgs(dataset=str(root / "data.jsonl"), data_cache_dir=str(root / f"cache-{r}"))
    dataset = block_cache.prepared(data, frozenset(), tokenizer, "tiny-qwen3", lambda fn: fn())
    print(json.dumps({"round": r, "manifest": dataset.manifest["shards"]}), flush=True)
"""


def test_two_launches_preparing_the_same_new_data_at_once_never_collide(tmp_path: Path) -> None:
    """Each round both start at the same moment: one tokenizes while the other says whose preparation it waits
    for, then reads the same verified data; no traceback, no removed file another process writes, no staging
    left. (The preflight's prepare took no lock: in 4 of 5 tries one died renaming its own staging file.)"""
    import subprocess
    import sys
    import time

    from support.prepared_data import corpus

    corpus(tmp_path, 600).rename(tmp_path / "data.jsonl")
    rounds = 12
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path), me, str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for me in ("a", "b")
    ]

    def both_ready(r: int) -> bool:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}-{me}").exists() for me in ("a", "b")):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                return False  # one died (its output says why, below) or hangs
            time.sleep(0.005)
        return True

    for r in range(rounds):
        if not both_ready(r):
            for p in procs:  # the other would wait at this round's barrier for ever
                p.kill()
            break
        (tmp_path / f"go-{r}").touch()
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [out[-3000:] for out in outputs]
    for out in outputs:
        assert "Traceback" not in out, out[-3000:]
    waited = sum(out.count("is being prepared by another process") for out in outputs)
    tokenized = sum(out.count("Data: tokenized") for out in outputs)
    assert tokenized == rounds and waited >= 1, outputs  # one preparation a round; the other read it
    manifests = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outputs]
    for a, b in zip(*manifests, strict=True):
        assert a == b  # the same verified shards, whoever prepared them
    for r in range(rounds):
        assert not list((tmp_path / f"cache-{r}").glob("prepared/*/.staging/*"))
    print(f"{rounds} rounds: {waited} times one waited for the other's preparation")


def test_a_preparation_that_fails_leaves_no_staging_dir(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": ["not", "text"]}) + "\n")
    data = DataArgs(dataset=str(path), validation_fraction=0, data_cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="holds list values, not text"):
        run_data(data, tokenizer)
    prepared = next((tmp_path / "c" / "prepared").iterdir())
    assert not (prepared / ".staging").exists() or not list((prepared / ".staging").iterdir())


def test_a_run_files_preparation_settings_are_ignored_on_prepared_data_with_a_line_and_typed_ones_refused(
    tmp_path: Path, tokenizer, capsys
) -> None:
    """The shipped SFT run file sets data_format and chat_template; pointed at a prepared dir (which fixed its own
    at preparation) they are ignored with one line naming them as the run file does, not an error that no flag
    can undo; the same settings typed as flags are still refused (they would be silently ignored)."""
    from support.prepared_data import corpus, prep

    out = tmp_path / "prepared"
    assert prep(out, "--dataset", str(corpus(tmp_path)), "--num_proc", "1") == 0
    capsys.readouterr()
    data = DataArgs(dataset=str(out), data_format="text", validation_fraction=0.1)
    run_file = {"data_format": "data.data_format (run file configs/x.yaml)"}
    dataset = block_cache.prepared(
        data, frozenset({"data_format"}), tokenizer, "tiny-qwen3", lambda fn: fn(), run_file.get
    )
    assert dataset.tokens("train") > 0
    assert (
        f"Data: data.data_format (run file configs/x.yaml) apply when data is prepared, and {out} is prepared "
        "already: ignored (it keeps the settings `dskit prepare-data` gave it)"
    ) in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"^--validation_fraction apply when data is prepared, and "):
        block_cache.prepared(
            data, frozenset({"data_format", "validation_fraction"}), tokenizer, "tiny-qwen3", lambda fn: fn(),
            run_file.get,
        )  # fmt: skip
