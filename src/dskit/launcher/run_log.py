"""train-singlenode.sh's log: one file per launch, made before anything else, renamed after the run once the run's
Python can name it.

    python3 -m dskit.launcher.run_log create JOB_NAME            # prints logs/JOB_NAME_<time>.out, made exclusively
    python3 -m dskit.launcher.run_log rename LOG PYTHON... -- FLAGS  # prints the log's path once named after the run

`create` refuses a JOB_NAME that cannot name a file in logs/ (a '/' would make tee fail and the run go on without
its log: the rule of render's job_name and of --run_name), and a launch in the same second as another gets -2,
-3, ... `rename` asks the kit for the run's name (`--run_name`, else model-backend[-lora]: the same rule as the run
id, model_utils/observe/run_name.py, no torch imported) and renames the log to it, keeping its time stamp; tee
writes on into the renamed file. The log keeps its name when the flags do not parse (the preflight then says why)
or a log of that name exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from dskit.launcher import main, say
from model_utils.errors import ConfigError

LOGS = Path("logs")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_SAME_SECOND = 99


def create(job_name: str, now: float | None = None) -> Path:
    if not NAME.fullmatch(job_name):
        raise ConfigError(
            f"JOB_NAME '{job_name}' cannot name the log file logs/<JOB_NAME>_<time>.out: use letters, digits, '.', "
            f"'_' or '-', starting with a letter or digit (e.g. JOB_NAME={re.sub(r'[^A-Za-z0-9._-]', '_', job_name)})"
        )
    stamp = f"{job_name}_{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    try:
        LOGS.mkdir(exist_ok=True)
        for n in range(1, MAX_SAME_SECOND + 1):
            log = LOGS / (f"{stamp}.out" if n == 1 else f"{stamp}-{n}.out")
            try:
                os.close(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                return log
            except FileExistsError:
                continue
    except OSError:
        pass
    raise ConfigError(f"cannot create a log file in {Path.cwd() / LOGS}: make that dir writable")


def rename(log: Path, name: str | None) -> Path:
    """The log named `name` (with its own time stamp), where that is a new, valid name."""
    if name is None or not NAME.fullmatch(name):
        return log
    named = log.with_name(f"{name}_{log.name.rpartition('_')[2]}")
    if named == log or named.exists():
        return log
    try:
        log.rename(named)
    except OSError:
        return log
    return named


def run_name(python: list[str], flags: list[str]) -> str | None:
    proc = subprocess.run(
        [*python, "-m", "model_utils.observe.run_name", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def _main(argv: list[str]) -> int:
    if argv[:1] == ["create"] and len(argv) == 2:
        log = create(argv[1])
    elif argv[:1] == ["rename"] and len(argv) > 2 and "--" in argv:
        split = argv.index("--")
        log = rename(Path(argv[1]), run_name(argv[2:split], argv[split + 1 :]))
        say(f"Logging to {LOGS / log.name}")
    else:
        raise ConfigError(
            "usage: python3 -m dskit.launcher.run_log create JOB_NAME | rename LOG PYTHON... -- FLAGS"
        )
    print(log)
    return 0


if __name__ == "__main__":
    main(_main)
