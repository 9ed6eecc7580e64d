"""`dskit prepare-data OUT --dataset SOURCE`: the same shards with one or two processes, a --max_tokens prefix,
progress lines in logs, a run that trains on what it prepared, a second run into one dir waiting for the first,
and workers that end with a preparation killed outright."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model_utils import processes
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


HELD_AT_THE_FIRST_UNIT = """
import sys, time
from pathlib import Path
from dskit import prepare_data
from model_utils.data import token_shards

gate, real_write_unit = Path(sys.argv[1]), token_shards.write_unit

def write_unit_when_let(*args, **kwargs):
    while not gate.exists():  # holds the output dir's lock until the test lets it go on
        time.sleep(0.05)
    return real_write_unit(*args, **kwargs)

token_shards.write_unit = write_unit_when_let
sys.exit(prepare_data.main(sys.argv[2:]))
"""


def _wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_second_prepare_data_into_the_same_dir_waits_for_the_first_then_reuses_it(tmp_path: Path) -> None:
    source = corpus(tmp_path)
    out, gate = tmp_path / "p", tmp_path / "go-on"
    args = [str(out), "--dataset", str(source), "--num_proc", "1", "--unit_mb", "0.02"]
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("first", "second")}
    first = subprocess.Popen(
        [sys.executable, "-c", HELD_AT_THE_FIRST_UNIT, str(gate), *args],
        stdout=logs["first"],
        stderr=subprocess.STDOUT,
    )
    second = None
    try:
        lock = out / token_shards.LOCK
        _wait_for(
            lambda: lock.is_file() and f"pid {first.pid} " in lock.read_text(), "the first to hold the lock"
        )
        second = subprocess.Popen(
            [sys.executable, "-m", "dskit.cli", "prepare-data", *args],
            stdout=logs["second"],
            stderr=subprocess.STDOUT,
        )
        second_log = tmp_path / "second.log"
        _wait_for(lambda: "waiting for it to finish" in second_log.read_text(), "the second's waiting line")
        assert re.search(
            rf"prepare-data: {out} is being prepared by another process \(host \S+ pid {first.pid} since "
            r"[\d:]+, \.prepare-data\.lock\): waiting for it to finish",
            second_log.read_text(),
        ), second_log.read_text()
        assert first.poll() is None and second.poll() is None  # the first is held, the second waits for it
        gate.touch()
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
        assert second.wait(timeout=300) == 0, second_log.read_text()
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
        for log in logs.values():
            log.close()
    assert f"{out} is prepared already: train with --dataset {out}" in (tmp_path / "second.log").read_text()
    assert "Traceback" not in (tmp_path / "second.log").read_text()
    assert token_shards.open_prepared(out).manifest["units"] > 2


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # ended meanwhile
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(stat.parent.name))
    return found


def test_workers_end_when_the_preparation_is_killed_outright(tmp_path: Path) -> None:
    """kill -9 (the OOM killer, a cancelled job) leaves the driver no chance to stop its workers itself."""
    source = corpus(tmp_path, 20000)  # more than the test waits for
    args = [str(tmp_path / "p"), "--dataset", str(source), "--num_proc", "2", "--unit_mb", "0.01"]
    args += ["--progress_every", "0"]
    log_path = tmp_path / "log"
    with log_path.open("w") as log:
        preparation = subprocess.Popen(
            [sys.executable, "-m", "dskit.cli", "prepare-data", *args], stdout=log, stderr=subprocess.STDOUT
        )
    workers: set[int] = set()

    def working() -> bool:
        assert preparation.poll() is None, log_path.read_text()
        for pid in _children(preparation.pid) - workers:
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    workers.add(pid)
        return len(workers) == 2 and " units, " in log_path.read_text()  # a worker's progress came through

    try:
        _wait_for(working, "the two workers at work")
        preparation.kill()
        preparation.wait()
        _wait_for(lambda: not any(map(processes.running, workers)), "the workers to end", timeout=10)
    finally:
        preparation.kill()
        for pid in workers:  # on a failure: not left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_line_not_utf8_is_one_error_line_of_prepare_data_and_the_preflight(tmp_path: Path, capsys) -> None:
    from dskit import cli

    source = tmp_path / "d.jsonl"
    source.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    expected = (
        f"error: {source} line 2 is not UTF-8 text (byte 0xe9: invalid continuation byte): write the file as "
        "UTF-8, or drop that line\n"
    )
    out, checkpoints, cache = (str(tmp_path / name) for name in ("p", "ck", "c"))
    workers = ["--unit_mb", "0.00001", "--num_proc", "2"]  # a unit a line, read in two worker processes
    assert cli.main(["prepare-data", out, "--dataset", str(source), *workers]) == 2
    captured = capsys.readouterr()
    assert captured.err == expected and "to tokenize with 2 processes" in captured.out
    preflight = ["--dataset", str(source), "--checkpoint_dir", checkpoints, "--data_cache_dir", cache]
    assert cli.main(["preflight", *preflight]) == 2
    assert capsys.readouterr().err == expected
