"""The `dskit` command's dispatch and its `config` subcommand."""

from __future__ import annotations

import json

from dskit import cli


def test_config_prints_the_resolved_config(capsys) -> None:
    assert cli.main(["config", "--lr", "1e-3", "--max_steps", "7"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 1e-3 and printed["loop"]["max_steps"] == 7
    assert printed["explicit"] == ["lr", "max_steps"]


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
