"""The `dskit` command's dispatch and its `config` subcommand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dskit import cli


def test_config_prints_the_resolved_config(capsys) -> None:
    assert cli.main(["config", "--lr", "1e-3", "--max_steps", "7"]) == 0
    printed = json.loads(capsys.readouterr().out)  # stdout is the JSON alone
    config, resolved = printed["config"], printed["resolved"]
    assert config["optim"]["lr"] == 1e-3 and config["loop"]["max_steps"] == 7
    assert config["explicit"] == ["lr", "max_steps"]
    assert config["data"]["seq_length"] is None and config["optim"]["micro_batch_size"] == 1  # as given
    # Derived once by preflight: the preset's sequence length, the DeepSpeed dict with the schedule's steps.
    assert resolved["seq_length"] == 256 and resolved["lr"] == 1e-3 and resolved["max_steps"] == 7
    assert (resolved["precision"], resolved["zero_stage"]) == ("bf16", 2)
    assert printed["deepspeed"]["scheduler"]["params"]["total_num_steps"] == 7
    assert printed["deepspeed"]["optimizer"]["params"]["lr"] == 1e-3


def test_unknown_command_is_one_line(capsys) -> None:
    assert cli.main(["trian"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: unknown command 'trian': use one of " + ", ".join(cli.COMMANDS) + " (dskit --help)"
    )


def test_help_lists_commands(capsys) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)
    assert cli.main([]) == 2


def test_every_command_reaches_its_module(capsys) -> None:
    """Each command's `--help` runs its own parser: a command whose module moved or lost its main fails here."""
    for name in cli.COMMANDS:
        try:
            code = cli.main([name, "--help"])
        except SystemExit as exit_:  # argparse's --help exits 0 after printing
            code = exit_.code
        out = capsys.readouterr()
        assert code == 0, (name, out.err[-2000:])
        assert "usage" in (out.out + out.err).lower(), name


def test_config_format_is_read_anywhere_and_a_bad_one_is_one_line(capsys) -> None:
    assert cli.main(["config", "--max_steps", "5", "--format", "xml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: dskit config --format takes json or yaml (dskit config --format yaml [FLAGS])"], (
        err
    )


def test_the_command_list_is_aligned_and_a_misspelt_command_gets_a_suggestion(capsys) -> None:
    assert cli.main(["--help"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(rows) == len(cli.COMMANDS)
    assert len({len(row) - len(row[2:].split(None, 1)[1]) for row in rows}) == 1, rows  # one help column
    assert cli.main(["exprot"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown command 'exprot': did you mean export? use one of config,"), err


def test_version_names_the_package_and_the_checkout(capsys) -> None:
    from importlib.metadata import version

    from model_utils.repo import REPO_ROOT

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dskit {version('dskit')} from {REPO_ROOT}"


def test_config_help_names_the_command_and_says_each_default_once(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as stopped:
        cli.main(["config", "--help"])
    assert stopped.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert text.startswith(
        "usage: dskit config [--format json|yaml] [--nodes N] [--gpus_per_node N] [--gpu_memory_gib G | "
        "--instance_type TYPE] [-h]"
    ), text[:160]
    assert "(default: None)" not in text and "(default: the model's own) (default" not in text
    assert "(default: the model's own)" in text and "(default: 100)" in text  # --tokenizer's; --max_steps'


# Each `dskit` help a user can ask for: the words typed after `dskit`, the program its usage must name, and the
# options it must mention (from the parser that reads them, so a new option missing from the help fails here).
def _help_forms() -> list[tuple[list[str], str, list[str]]]:
    import argparse

    from dskit import bench, cost, estimate, export, plot, prepare_data, render, sagemaker
    from dskit import eval as dskit_eval
    from dskit.bench import data_bench, gpu_check
    from dskit.env import wheelhouse
    from model_utils.config import arguments

    def options(parser: argparse.ArgumentParser) -> list[str]:
        return [o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings]

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    training = options(arguments.build_parser())
    wheel = subcommands(wheelhouse.build_parser())
    # doctor, preflight and sagemaker submit take the training flags and point to `dskit config --help`
    # for them rather than repeating 90 flags
    see_config = ["dskit config --help"]
    return [
        (["config"], "dskit config", training),
        (["prepare"], "dskit prepare", training),
        (["prepare-data"], "dskit prepare-data", options(prepare_data.build_parser())),
        (["preflight"], "dskit preflight", ["dskit doctor --help", *see_config]),
        (["render"], "dskit render", options(render.build_parser())),
        (["export"], "dskit export", options(export.build_parser())),
        (["eval"], "dskit eval", options(dskit_eval.build_parser())),
        (["estimate"], "dskit estimate", options(estimate.build_parser())),
        (["doctor"], "dskit doctor", see_config),
        (["plot"], "dskit plot", options(plot.build_parser())),
        (["cost"], "dskit cost", options(cost.build_parser())),
        (["bench"], "dskit bench", options(bench.build_parser()) + list(bench.DATA_BENCH_FLAGS)),
        (["bench", "--data", "corpus.jsonl"], "dskit bench --data", options(data_bench.build_parser())),
        (["wheelhouse"], "dskit wheelhouse", list(wheel)),
        *[(["wheelhouse", name], f"dskit wheelhouse {name}", options(p)) for name, p in wheel.items()],
        (["gpu-check"], "dskit gpu-check", options(gpu_check.build_parser())),
        (["sagemaker"], "dskit sagemaker submit", [*sagemaker.SUBMIT_OPTIONS, *see_config]),
        (["sagemaker", "submit"], "dskit sagemaker submit", list(sagemaker.SUBMIT_OPTIONS)),
        *[
            (["sagemaker", name], f"dskit sagemaker {name}", options(sagemaker.job_parser(name)))
            for name in ("status", "logs", "stop")
        ],
    ]


# Runs each argv in a child forked from one process that imported dskit.cli only: each child's sys.modules is
# what that one command imported. One interpreter start for all of them keeps the unit tier fast.
HELP_PROBE = r"""
import contextlib, io, json, os, sys
import dskit.cli

results = []
for argv in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            try:
                code = dskit.cli.main(argv)
            except SystemExit as stopped:
                code = stopped.code
        heavy = [name for name in ("torch", "deepspeed", "transformers") if name in sys.modules]
        with os.fdopen(write, "w") as out:
            json.dump({"code": code, "text": text.getvalue(), "heavy": heavy}, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        results.append(json.load(got))
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


def _probe(argvs: list[list[str]]) -> list[dict]:
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "200"}  # argparse wraps at the terminal's width
    done = subprocess.run(
        [sys.executable, "-c", HELP_PROBE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(done.stdout)


def test_every_help_names_its_program_and_options_and_imports_no_ml_library() -> None:
    forms = _help_forms()
    assert {argv[0] for argv, _, _ in forms} == set(cli.COMMANDS), "a dskit command without a help form here"
    argvs = [[*argv, "--help"] for argv, _, _ in forms]
    argvs += [["--help"], ["--version"], ["exprot"]]  # the command list, the version, a did-you-mean
    results = _probe(argvs)
    for argv, (_, prog, mentioned), result in zip(argvs, forms, results, strict=False):
        text = result["text"]
        assert result["code"] == 0, (argv, text[-2000:])
        assert text.startswith(f"usage: {prog} ") or text.startswith(f"usage: {prog}\n"), (argv, text[:200])
        missing = [option for option in mentioned if option not in text]
        assert not missing, f"dskit {' '.join(argv)} does not mention {missing}"
    for argv, result in zip(argvs, results, strict=True):
        assert result["heavy"] == [], f"dskit {' '.join(argv)} imported {result['heavy']}"
    assert [r["code"] for r in results[-3:]] == [0, 0, 2]
    assert "did you mean export?" in results[-1]["text"]


def test_ctrl_c_in_a_command_is_one_line_and_status_130(capsys, monkeypatch) -> None:
    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt  # Ctrl-C in `dskit preflight` while the launcher checks the node

    monkeypatch.setitem(cli.COMMANDS, "preflight", (interrupted, *cli.COMMANDS["preflight"][1:]))
    assert cli.main(["preflight"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "dskit preflight: interrupted (Ctrl-C)\n" and captured.out == ""


def test_config_prints_no_credentials(capsys) -> None:
    import socket

    server = socket.create_server(("127.0.0.1", 0))  # the preflight only checks that the server listens
    port = server.getsockname()[1]
    uri = f"http://admin:pw@127.0.0.1:{port}/"
    assert cli.main(["config", "--max_steps", "7", "--report_to", "mlflow", "--tracking_uri", uri]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["config"]["report"]["tracking_uri"] == f"http://127.0.0.1:{port}/"
    assert "pw" not in printed and "admin" not in printed
    assert cli.main(["config", "--format", "yaml", "--report_to", "mlflow", "--tracking_uri", uri]) == 0
    printed = capsys.readouterr().out
    assert f"tracking_uri: http://127.0.0.1:{port}/" in printed and "pw" not in printed
    server.close()


def test_preflight_refuses_a_checkpoint_dir_a_live_run_holds_before_any_check(tmp_path: Path, capsys) -> None:
    from model_utils.checkpoint import lease

    held = lease.acquire(tmp_path)  # a live run's lease (this process's)
    try:
        assert cli.main(["preflight", "--checkpoint_dir", str(tmp_path)]) == 2
    finally:
        held.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint dir {tmp_path} is in use by another run (host " in err[0], err
    assert f"pid {os.getpid()}" in err[0]


def test_preflight_picks_the_resume_candidate_without_reading_its_files(tmp_path: Path, monkeypatch) -> None:
    """One process reading a whole checkpoint before the ranks start is what the ranks' parallel check replaces:
    the preflight's prepare checks the candidate's files for presence and size only."""
    from dskit import doctor
    from model_utils.checkpoint import protocol
    from model_utils.errors import ConfigError
    from model_utils.resolve import resolver
    from model_utils.storage import file_manifest
    from support.checkpoint_tags import fake_tag

    tag = fake_tag(tmp_path, 10)
    picked = []

    def prepare(cfg, **kwargs):
        picked.append(protocol.select_resume(cfg.checkpoint.checkpoint_dir, None))
        raise ConfigError("stop here")  # the rest of prepare is not what this test is about

    monkeypatch.setattr(doctor, "diagnose", lambda cfg, ctx: ([], None))
    monkeypatch.setattr(doctor, "report", lambda results, ctx: 0)
    monkeypatch.setattr(resolver, "prepare", prepare)
    monkeypatch.setattr(
        file_manifest, "file_digest", lambda path: pytest.fail(f"{path} read by the preflight")
    )
    assert cli.main(["preflight", "--checkpoint_dir", str(tmp_path)]) == 2
    assert picked[0].path == tag
    with pytest.raises(pytest.fail.Exception):  # after the preflight, verify reads checksums again
        file_manifest.verify(tag)


def test_preflight_of_a_complete_run_says_so_and_exits_complete_releasing_the_launchs_lease(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A finished run launched again: one line, status COMPLETE (the launchers start no rank and exit 0), and the
    lease the preflight took for the launch is released (no rank will adopt it)."""
    from model_utils.checkpoint import lease
    from support.checkpoint_tags import fake_tag

    tag = fake_tag(tmp_path / "ck", 5)
    monkeypatch.setenv("DSKIT_LEASE_TOKEN", "this-launch")
    monkeypatch.setenv("CPU_RANKS", "2")
    monkeypatch.setenv("GPUS_PER_NODE", "0")
    flags = [
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--max_steps",
        "5",
        "--data_cache_dir",
        str(tmp_path / "d"),
    ]
    assert cli.main(["preflight", *flags]) == cli.COMPLETE
    out = capsys.readouterr().out
    assert f"run complete: {tmp_path / 'ck' / 'tiny_qwen3-5steps'} is at step 5, at --max_steps 5" in out, out
    assert not (tmp_path / "ck" / lease.LEASE_FILE).exists()
    # Refused after taking the lease (a flag prepare rejects): released too; a launch that goes on keeps it.
    assert cli.main(["preflight", *flags, "--max_steps", "6", "--seq_length", "1"]) == 2
    assert not (tmp_path / "ck" / lease.LEASE_FILE).exists()
    assert cli.main(["preflight", *flags, "--max_steps", "6"]) == 0
    held = json.loads((tmp_path / "ck" / lease.LEASE_FILE).read_text())
    assert (held["token"], held["pid"]) == ("this-launch", os.getppid())  # the launcher's, for its rank 0
    # The complete run's validation is launched all the same (its launch holds the lease as every launch does).
    capsys.readouterr()
    assert cli.main(["preflight", *flags, "--validation_only", "true"]) == 0
    assert f"validation only of {tag}\n" in capsys.readouterr().out


def test_a_crash_is_reported_as_one_and_not_as_a_doctor_fail(capsys, monkeypatch) -> None:
    """A launcher reads status 1 as the doctor's FAIL: a bug exits CRASHED, its traceback kept."""

    def crashing(argv: list[str]) -> int:
        raise FileNotFoundError("a bug")

    monkeypatch.setitem(cli.COMMANDS, "preflight", (crashing, *cli.COMMANDS["preflight"][1:]))
    assert cli.main(["preflight"]) == cli.CRASHED == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "FileNotFoundError: a bug" in err
    assert err.rstrip().splitlines()[-1] == (
        "error: dskit preflight crashed (the traceback above): please report it with the command you ran"
    )
