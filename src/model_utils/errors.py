"""The one exception type for user mistakes: its message says what is wrong and how to fix it."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class ConfigError(ValueError):
    """Bad input from the user (flags, config files, data, paths). Reported as one line, exit status 2."""


class ModelUnavailable(ConfigError):
    """A model, config or tokenizer that could not be loaded from the hub or the HF cache (offline?)."""


class RunDiverged(RuntimeError):
    """The spike guard stopped the run (a requeue would only repeat it). One line, exit status 4."""


class CheckpointSaveFailed(RuntimeError):
    """A save that could not be written (a full disk, a lost mount); older checkpoints are intact. Its one line
    is printed where it is raised (before any rank exits); exit status 3, on every rank together."""


class NodeUnhealthy(RuntimeError):
    """A node failed the health gate (launch/health_gate.py): its line is out and its host named to the launcher;
    exit status 75 on every rank, the hang watchdog's, which train.sbatch requeues without that host."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (libraries raise multi-line ones), or its type's name."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class CommandParser(argparse.ArgumentParser):
    """argparse for a `dskit` command: no abbreviations, and a usage mistake is a ConfigError naming --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} ({self.prog} --help)")
