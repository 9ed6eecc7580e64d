"""The kit's error types and how a mistake reaches the user: one line, naming what to do."""

from __future__ import annotations

import pytest

from model_utils.errors import CommandParser, ConfigError, ModelUnavailable, RunDiverged, first_line


def test_user_mistakes_are_config_errors_and_a_diverged_run_is_not() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ModelUnavailable, ConfigError)  # an unreachable model is reported like bad input
    assert not issubclass(
        RunDiverged, ConfigError
    )  # a stopped run is not the user's input: its own exit status


def test_first_line_of_a_multi_line_message_or_the_type_name() -> None:
    assert first_line(RuntimeError("  disk full\n  Traceback (most recent call last):\n  ...")) == "disk full"
    assert first_line(OSError()) == "OSError"
    assert first_line(ValueError("   \n  ")) == "ValueError"  # only whitespace: nothing to show but the type


def test_command_parser_refuses_abbreviations_with_one_line_naming_help() -> None:
    parser = CommandParser(prog="dskit example")
    parser.add_argument("--nodes", type=int, default=1)
    assert parser.parse_args(["--nodes", "2"]).nodes == 2
    with pytest.raises(ConfigError) as err:
        parser.parse_args(["--node", "2"])
    assert str(err.value) == "unrecognized arguments: --node 2 (dskit example --help)"
    with pytest.raises(
        ConfigError, match=r"argument --nodes: invalid int value: 'two' \(dskit example --help\)"
    ):
        parser.parse_args(["--nodes", "two"])
