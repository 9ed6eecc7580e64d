"""`dskit bench --data`: prepare-data at 1 and 2 processes (real child processes), the read path and the headroom
against a metrics file, printed and written as JSON; and the benchmark corpus maker. Not a timing test: it checks
that every figure is there, positive and consistent with the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit import cli
from dskit.bench import data_bench
from model_utils.observe import metrics

TABLE_FIELDS = ("procs", "units", "wall s", "tokenize s", "tokens/s", "tokens/s/proc", "speed-up")
TABLE_FIELDS += ("peak RSS tree GiB", "peak RSS proc GiB", "disk MB", "shards")


def _metrics_file(path: Path) -> None:
    """What a 2-rank run writes: a start event, then one record per logged interval (the first one slow)."""
    file = metrics.MetricsFile(path)
    file.write({"event": "start", "step": 0, "world_size": 2, "max_steps": 40})
    for step, rate in ((10, 100.0), (20, 1000.0), (30, 1200.0), (40, 800.0)):
        file.write(
            {"step": step, "tokens_per_s": 2 * rate, "tokens_per_s_per_device": rate, "step_time_s": 0.5}
        )


def test_data_bench_prepares_reads_and_compares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _metrics_file(tmp_path / "run.metrics.jsonl")
    out, work = tmp_path / "data.json", tmp_path / "work"
    argv = ["bench", "--data", "embedded", "--procs", "1,2", "--unit_mb", "1", "--read_steps", "20"]
    argv += ["--metrics", str(tmp_path / "run.metrics.jsonl"), "--json", str(out), "--work_dir", str(work)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out

    table = printed[printed.index("procs  ") :].splitlines()
    assert all(name in table[0] for name in TABLE_FIELDS)
    assert table[1].split()[0] == "1" and table[2].split()[0] == "2"
    assert "shards: identical at 1, 2 processes" in printed
    assert "read path" in printed and "blocks/s" in printed
    assert "trainer's need: 1,000 tokens/s per rank" in printed and "world size 2" in printed
    assert list(work.iterdir()) == []  # the preparations are deleted

    result = json.loads(out.read_text())
    assert result["source"] == "embedded" and result["tokenizer"] == "tiny-qwen3" and result["units"] == 3
    runs = result["runs"]
    assert [r["procs"] for r in runs] == [1, 2]
    # The same stream at every process count: the same tokens and the same shard checksums.
    assert runs[0]["tokens"] == runs[1]["tokens"] > 0 and runs[0]["documents"] == runs[1]["documents"] > 0
    assert runs[0]["shards_digest"] == runs[1]["shards_digest"] and result["shards_identical"] is True
    for r in runs:
        assert r["wall_s"] > r["tokenize_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["tokenize_s"])
        assert r["tokens_per_s_wall"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["tokens_per_s_per_proc"] == pytest.approx(r["tokens_per_s"] / min(r["procs"], r["units"]))
        assert r["peak_rss_tree_gib"] >= r["peak_rss_process_gib"] > 0 and r["rss_samples"] >= 1
        assert r["disk_mb"] * 2**20 >= 2 * r["tokens"]  # uint16 tokens (a 2048-token vocabulary), plus JSON
    assert runs[0]["speedup"] == 1.0
    assert runs[1]["speedup"] == pytest.approx(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"])

    read = result["read"]
    assert (read["seq_length"], read["micro_batch_size"], read["steps"]) == (2048, 8, 20)
    assert 0 < read["blocks"] <= runs[0]["tokens"] // 2048  # the train split's blocks
    assert read["blocks_per_s"] == pytest.approx(20 * 8 / read["seconds"])
    assert read["tokens_per_s"] == pytest.approx(read["blocks_per_s"] * 2048)
    need = result["need"]
    # The median of the intervals after the first (which holds the warm-up), per rank.
    assert (need["tokens_per_s_per_rank"], need["world_size"], need["intervals"]) == (1000.0, 2, 3)
    assert need["step_time_s"] == 0.5
    assert result["headroom"] == pytest.approx(read["tokens_per_s"] / 1000.0)


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
