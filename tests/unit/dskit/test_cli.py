"""The `dskit` command's dispatch and its `config` subcommand."""

from __future__ import annotations

import json

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
    assert text.startswith("usage: dskit config [--format json|yaml] [-h]"), text[:80]
    assert "(default: None)" not in text and "(default: the model's own) (default" not in text
    assert "(default: the model's own)" in text and "(default: 100)" in text  # --tokenizer's; --max_steps'


def test_ctrl_c_in_a_command_is_one_line_and_status_130(capsys, monkeypatch) -> None:
    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt  # Ctrl-C in `dskit preflight` while the launcher checks the node

    monkeypatch.setitem(cli.COMMANDS, "preflight", (interrupted, *cli.COMMANDS["preflight"][1:]))
    assert cli.main(["preflight"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "dskit preflight: interrupted (Ctrl-C)\n" and captured.out == ""
