"""The launchers' decisions, out of their shell: train.sbatch and train-singlenode.sh (templates/) hold the SBATCH
header, the environment and the launch, and run these modules for the rest.

    python3 -m dskit.launcher.interpreter      the run's Python (DSKIT_PYTHON, WHEELHOUSE, or the locked .venv)
    python3 -m dskit.launcher.node ...         the node's ranks, CUDA toolkit, threads per rank and network
    python3 -m dskit.launcher.accelerate ...   `accelerate launch`'s options (launcher: accelerate)
    python3 -m dskit.launcher.run_log ...      train-singlenode.sh's log: made exclusively, named after the run
    python3 -m dskit.launcher.stop ...         Ctrl-C and USR1 handed to the ranks; a second Ctrl-C ends them
    python3 -m dskit.launcher.requeue ...      train.sbatch's end: requeue (preempted, time limit, hang) or not

They run under the host's python3 (PYTHONPATH=src, from the repo root), standard library only: the first runs
before the run's environment exists, and none of them needs it. A rank never imports them. What a script reads
back goes to stdout; what a person reads, to stderr (the launchers log both).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from model_utils.errors import ConfigError


def say(line: str) -> None:
    """A progress line for the log (stdout is the script's to read)."""
    print(line, file=sys.stderr, flush=True)


class Exit(Exception):
    """A step's command failed and said why itself: the launch ends with its exit status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def check(command: list[str], capture: bool = False) -> str:
    """Run a step's command; its output goes to the log (stderr), or is returned (capture). Its failure ends the
    launch with its exit status: the command has said why."""
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE if capture else 2, text=True, check=False)
    except OSError as e:
        raise ConfigError(f"{command[0]}: {e.strerror}: install it or put it on PATH") from None
    if proc.returncode:
        raise Exit(128 - proc.returncode if proc.returncode < 0 else proc.returncode)
    return proc.stdout or ""


def main(run: Callable[[list[str]], int]) -> None:
    """A module's command line: ConfigError is its one `error:` line and exit status 2."""
    try:
        status = run(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        status = 2
    except Exit as e:
        status = e.status
    sys.exit(status)
