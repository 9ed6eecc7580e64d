"""The run's Python, picked once, first thing in a launch: it prints the interpreter's path.

    python3 -m dskit.launcher.interpreter      # in the repo root

DSKIT_PYTHON: an interpreter that has torch already (a container's, a cluster module's), used as it is.
WHEELHOUSE: .venv installed from that directory with no network (over DSKIT_PYTHON when both are set: only what it
lacks, its torch kept). Else a .venv installed from a wheelhouse before, or the locked .venv: `uv sync --frozen`,
uv bootstrapped with pip on first use, skipped while the stamp of the last sync holds (dskit/env/lock_stamp.py).
Several launches may sync at once: uv locks the environment, so they take turns.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

from dskit.env import lock_stamp
from dskit.env.uv import uv_command
from dskit.env.wheelhouse import STAMP as WHEELHOUSE_STAMP
from dskit.launcher import check, main, say
from model_utils.errors import ConfigError

VENV = ".venv"


def interpreter(environ: Mapping[str, str], project: Path) -> str:
    """The interpreter of this run, installed or synced first where it needs to be."""
    given = environ.get("DSKIT_PYTHON", "")
    wheelhouse = environ.get("WHEELHOUSE", "")
    if given and shutil.which(given) is None:
        raise ConfigError(
            f"DSKIT_PYTHON={given}: no such interpreter on {socket.gethostname()}: give the path of a Python that "
            "has torch (e.g. /usr/bin/python3 in a container), or unset it to use the kit's own .venv"
        )
    venv_python = str(project / VENV / "bin" / "python")
    if wheelhouse:
        overlay = ["--overlay"] if given else []
        check(
            [
                given or "python3",
                "-m",
                "dskit.env.wheelhouse",
                "install",
                wheelhouse,
                "--venv",
                VENV,
                *overlay,
            ]
        )
        return venv_python
    if given:
        say(f"Python: {given} (DSKIT_PYTHON: used as it is, no uv sync)")
        return given
    if (project / VENV / WHEELHOUSE_STAMP).is_file():
        say("Python: .venv, installed from a wheelhouse (no uv sync; WHEELHOUSE=DIR updates it)")
        return venv_python
    sync(project)
    return venv_python


def sync(project: Path) -> None:
    """The locked environment in .venv (`uv sync --frozen`), unless the stamp of the last sync holds."""
    venv = project / VENV
    installed = os.access(venv / "bin" / "python", os.X_OK)
    if installed and lock_stamp.synced_at(project, venv) is not None:
        return  # uv would spend ~1.5 s finding so
    uv = uv_command()
    if uv is None:
        say("uv not found: installing it with pip")
        check(["python3", "-m", "pip", "install", "--quiet", "uv"])
        uv = ["python3", "-m", "uv"]
    if not installed:  # the one long quiet step before the preflight: said
        say(
            "Installing the locked environment into .venv (uv sync --frozen; the first time about 20 s with uv's "
            "cache, a few minutes without) ..."
        )
    # Bytecode compiled once at install (incremental later): each rank imports ~2,000 modules at start.
    check([*uv, "sync", "--frozen", "--quiet", "--compile-bytecode"])
    with contextlib.suppress(
        OSError
    ):  # a cache: where it cannot be written (read-only), the next launch syncs
        lock_stamp.write(project, venv)


def _main(argv: list[str]) -> int:
    if argv:
        raise ConfigError(
            "usage: python3 -m dskit.launcher.interpreter (no arguments; DSKIT_PYTHON, WHEELHOUSE)"
        )
    print(interpreter(os.environ, Path.cwd()))
    return 0


if __name__ == "__main__":
    main(_main)
