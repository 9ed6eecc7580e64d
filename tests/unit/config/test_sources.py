"""--sources and the run file's data.sources list: both spellings read to the same sources; every bad input is
one line naming the source and the fix; `dskit config --format yaml` writes the list back, fed back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit import cli
from model_utils.config.arguments import PER_SOURCE_KEYS, parse_args
from model_utils.config.sources import SourceSpec, parse
from model_utils.errors import ConfigError


def test_the_compact_form_reads_names_paths_shares_and_repeats() -> None:
    specs = parse("web=data/year=2024/web@0.7, code=s3://bucket/a:b/code@0.3x2.5", PER_SOURCE_KEYS)
    assert specs == (
        SourceSpec("web", "data/year=2024/web", 0.7),  # the name runs to the first '='
        SourceSpec("code", "s3://bucket/a:b/code", 0.3, 2.5),  # the share after the last '@'
    )


def test_the_flag_the_json_form_and_the_run_file_list_are_one_config(tmp_path: Path) -> None:
    compact = parse_args(["--sources", "web=data/web@0.7,code=data/code.jsonl@0.3x2"])
    listed = [
        {"name": "web", "dataset": "data/web", "share": 0.7},
        {"name": "code", "dataset": "data/code.jsonl", "share": 0.3, "max_repeat": 2},
    ]
    as_json = parse_args(["--sources", json.dumps(listed)])
    run = tmp_path / "run.yaml"
    run.write_text(
        "data:\n  sources:\n"
        "    - {name: web, dataset: data/web, share: 0.7}\n"
        "    - {name: code, dataset: data/code.jsonl, share: 0.3, max_repeat: 2}\n"
    )
    from_file = parse_args(["--config", str(run)])
    assert compact.data.source_specs == as_json.data.source_specs == from_file.data.source_specs
    assert [s.max_repeat for s in from_file.data.source_specs] == [1.0, 2.0]  # 1: no repetition, the default
    assert "sources" in from_file.explicit


def test_a_source_sets_its_own_data_keys_and_inherits_the_rest() -> None:
    listed = [
        {
            "name": "chat",
            "dataset": "a.jsonl",
            "share": 1,
            "text_field": "body",
            "validation_fraction": "0.1",
        },
        {"name": "web", "dataset": "b.jsonl", "share": 3},
    ]
    cfg = parse_args(["--sources", json.dumps(listed), "--text_field", "content", "--seq_length", "64"])
    chat, web = (cfg.data.for_source(s) for s in cfg.data.source_specs)
    assert (chat.dataset, chat.text_field, chat.validation_fraction) == ("a.jsonl", "body", 0.1)  # typed
    assert (web.dataset, web.text_field, web.validation_fraction) == ("b.jsonl", "content", 0.02)
    assert chat.sources is None and chat.seq_length == 64


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("web=a@0", "source 'web' has share 0, not a positive number: fix: give it a positive share"),
        ("web=a@-1", "source 'web' has share -1, not a positive number"),
        ("web=a@1x0", "source 'web' has max_repeat 0, not a positive number: fix: use 1 for no repetition"),
        ("web=a", "entry 'web=a' is not NAME=DATASET@SHARE[xMAX_REPEAT]"),
        ("data/web@0.5", "entry 'data/web@0.5' is not NAME=DATASET@SHARE"),
        ("web=a@1,web=b@1", "two sources are named 'web': fix: give each source its own name"),
        ("w/b=a@1", "source name 'w/b' is not a short name"),
        (
            '[{"name": "a", "dataset": "x", "share": 1, "shares": 2}]',
            "unknown key 'shares': fix: did you mean share?",
        ),
        ('[{"name": "a", "dataset": "x", "share": 1, "seq_length": 8}]', "unknown key 'seq_length'"),
        (
            '[{"name": "a", "share": 1}]',
            "source 'a' has no dataset: fix: give each source name, dataset, share",
        ),
        ('[{"name": "a", "dataset": "x", "share": "lots"}]', "source 'a' has share 'lots', not a number"),
        ("[]", "no sources given"),
        (
            '[{"name": "a", "dataset": "x", "share": 1, "validation_fraction": 1.5}]',
            "source 'a': --validation_fraction 1.5 is outside [0, 1)",
        ),
        ("[{", "not valid JSON"),
    ],
)
def test_bad_sources_are_one_line_with_the_fix(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_args(["--sources", value])
    message = str(caught.value)
    assert says in message and "\n" not in message and message.startswith("--sources: ")


def test_a_bad_source_in_a_run_file_names_the_file_and_key(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("data:\n  sources:\n    - {name: web, dataset: data/web, share: 0, max_repeat: 1}\n")
    with pytest.raises(ConfigError, match=rf"^run file {run}: data.sources: source 'web' has share 0"):
        parse_args(["--config", str(run)])


def test_sources_and_dataset_are_one_choice(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--sources and --dataset both given: keep one of them"):
        parse_args(["--sources", "a=x@1", "--dataset", "y"])
    run = tmp_path / "run.yaml"
    run.write_text("data: {dataset: y}\n")
    cfg = parse_args(["--config", str(run), "--sources", "a=x@1"])  # the flag replaces the file's dataset
    assert cfg.data.dataset == "embedded" and cfg.data.source_specs[0].dataset == "x"


def test_the_yaml_dump_writes_the_list_and_feeds_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, n in (("a", 300), ("b", 120)):
        texts = [f"{name} document {i}: " + "words of the source " * (1 + i % 5) for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    common = [
        "--data_cache_dir",
        str(tmp_path / "c"),
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--seq_length",
        "32",
    ]
    flag = f"a={tmp_path / 'a.jsonl'}@0.6,b={tmp_path / 'b.jsonl'}@0.4x2"
    assert cli.main(["config", "--format", "yaml", "--sources", flag, *common]) == 0
    dumped = capsys.readouterr().out
    assert "sources:\n  - name: a\n" in dumped and "dataset: null" in dumped
    path = tmp_path / "dumped.yaml"
    path.write_text(dumped)
    assert cli.main(["config", "--config", str(path), "--format", "yaml"]) == 0
    assert capsys.readouterr().out == dumped  # a fixed point
    assert (
        parse_args(["--config", str(path)]).data.source_specs
        == parse_args(["--sources", flag]).data.source_specs
    )


@pytest.mark.parametrize(
    ("sources", "says"),
    [
        ("a={a}@1,b={a}@0", "--sources: source 'b' has share 0, not a positive number: fix: "),
        (
            '[{{"name": "a", "dataset": "{a}", "share": 1, "weight": 2}}]',
            "--sources: source 'a' has an unknown key",
        ),
        ("a={a}@1,b={missing}@1", "source b: dataset {missing} does not exist: fix: "),
        ("a={a}@1,tiny={tiny}@1", "source tiny has 3 train tokens, fewer than one block of 32: fix: "),
    ],
)
def test_a_bad_mixture_stops_the_launch_with_one_error_line(
    sources: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(100)))
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    paths = {"a": a, "missing": tmp_path / "missing.jsonl", "tiny": tmp_path / "tiny.jsonl"}
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "keep.txt").write_text("a user's file")
    flags = ["--sources", sources.format(**paths), "--seq_length", "32", "--validation_fraction", "0"]
    capsys.readouterr()
    code = cli.main(
        ["prepare", *flags, "--data_cache_dir", str(tmp_path / "c"), "--checkpoint_dir", str(ckpt)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + says.format(**paths)), err
    assert (ckpt / "keep.txt").read_text() == "a user's file"  # nothing on disk lost
