"""`dskit bench --data`: the headroom only where there is a need, bad input and what prepare-data refuses as one
line before any preparation, the help, and the benchmark corpus maker. The benchmark itself (prepare-data at 1
and 2 real child processes, the read path, the headroom against a metrics file): tests/e2e/test_bench.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit import cli
from dskit.bench import data_bench


def test_headroom_is_not_computed_without_a_need() -> None:
    read = data_bench.ReadPath(2048, 8, 1, 10, 100, False, 0.01, 8000.0, 8000.0 * 2048)
    assert "headroom: not computed" in data_bench.need_line(read, None)
    given = data_bench.Need(1000.0, "--need_tokens_per_s")
    assert data_bench.need_line(read, given).endswith("headroom: 16,384.0x")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics", "/nonexistent/run.metrics.jsonl"], "--metrics /nonexistent/run.metrics.jsonl: cannot"),
        (["--procs", "0,2"], "--procs '0,2'"),
        (["--procs", "one"], "--procs 'one'"),
        (["--metrics", "m.jsonl", "--need_tokens_per_s", "5"], "not allowed with argument"),
        (["--unit_mb", "0"], "--unit_mb 0"),
    ],
)
def test_bad_input_is_one_line_before_any_preparation(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    assert cli.main(["bench", "--data", "embedded", "--work_dir", str(work), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not work.exists()


def test_what_prepare_data_refuses_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jsonl"
    argv = ["bench", "--data", str(missing), "--procs", "1", "--work_dir", str(tmp_path / "work")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: prepare-data: dataset path {missing} does not exist") and err.count("\n") == 1
    )
    assert list((tmp_path / "work").iterdir()) == []


def test_bench_help_names_the_data_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--help"])
    assert exited.value.code == 0 and "--data SOURCE" in capsys.readouterr().out


def _lines(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def test_make_corpus_writes_python_sources_of_the_size_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    assert cli.main(["bench", "--make_corpus", str(corpus), "--corpus_mb", "1"]) == 0
    assert "wrote " in capsys.readouterr().out
    assert corpus.stat().st_size == 2**20
    records = _lines(corpus)
    assert len(records) > 1 and all(list(r) == ["text"] and r["text"].strip() for r in records)
    assert sum("import " in r["text"] for r in records) > len(records) // 2  # real Python sources
    first = corpus.read_bytes()
    assert cli.main(["bench", "--make_corpus", str(corpus), "--corpus_mb", "1"]) == 0
    assert corpus.read_bytes() == first  # the same corpus on every run
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]  # no temporary file left


def test_make_corpus_cycles_the_sources_to_the_exact_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "lib"
    (sources / "pkg" / "__pycache__").mkdir(parents=True)
    (sources / "a.py").write_text('print("héllo")\n' * 100)
    (sources / "pkg" / "b.py").write_text("x = 1\n" * 50)
    (sources / "pkg" / "empty.py").write_text("")
    (sources / "pkg" / "latin1.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
    (sources / "pkg" / "__pycache__" / "c.py").write_text("y = 2\n")
    (sources / "notes.txt").write_text("not Python")
    monkeypatch.setattr(data_bench, "_source_roots", lambda: [sources])

    made = data_bench.make_corpus(tmp_path / "c.jsonl", 1)
    assert made["bytes"] == (tmp_path / "c.jsonl").stat().st_size == 2**20 and made["passes"] > 100
    texts = [r["text"] for r in _lines(tmp_path / "c.jsonl")]
    a, b = 'print("héllo")\n' * 100, "x = 1\n" * 50
    assert texts[:-1] == [a, b] * ((len(texts) - 1) // 2) + [a] * ((len(texts) - 1) % 2)  # in order, cycled
    # The last document is cut, and padded with spaces, to end the file at exactly 1 MB.
    assert (a if len(texts) % 2 else b).startswith(texts[-1].rstrip(" "))


def test_verify_times_the_first_open_and_a_resume_that_hashes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from model_utils.data import token_shards

    made = data_bench.make_prepared(tmp_path / "p", 3, shard_mb=1)
    assert made["shards"] == 3 and made["bytes"] == 3 * 2**20
    dataset = token_shards.open_prepared(tmp_path / "p")  # a prepared dataset as the kit reads it
    assert dataset.tokens("train") == 3 * 2**19
    figures = tmp_path / "verify.json"
    assert cli.main(["bench", "--verify", str(tmp_path / "p"), "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    assert "first open, from storage" in out and "resume (.verified.json)" in out
    runs = {r["open"]: r for r in json.loads(figures.read_text())["runs"]}
    assert [r["hashed"] for r in runs.values()] == [3, 3, 0]  # the resume: every shard found in the record
    assert (
        runs["first open, page cache"]["hashed_mb"] == 3.0 and runs["first open, page cache"]["mb_per_s"] > 0
    )
    assert runs["resume (.verified.json)"]["mb_per_s"] is None
    assert cli.main(["bench", "--make_prepared", str(tmp_path / "p")]) == 2  # never over an existing dir
    assert capsys.readouterr().err.startswith(
        f"error: --make_prepared {tmp_path / 'p'} exists: pass a new path"
    )
