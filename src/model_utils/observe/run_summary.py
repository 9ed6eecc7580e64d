"""The run summary: a run's outcome as one JSON object, for a tool that started the run (dskit.api) to read.

Written where DSKIT_RUN_SUMMARY names (nothing when it is unset): by rank 0's reporter as the run goes (run id,
files, trackers, last step and losses, newest checkpoint, how it ended), then by train.sbatch's end (the job's exit
status). A requeued job adds to the same object: what a later job did not say again is kept. Each write replaces
the file whole, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from model_utils import launch_env


def read(path: Path) -> dict[str, Any]:
    """The summary at `path`; empty when no process wrote one (or it is unreadable)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def update(fields: dict[str, Any]) -> None:
    """`fields` into the summary DSKIT_RUN_SUMMARY names."""
    name = os.environ.get(launch_env.RUN_SUMMARY)
    if not name:
        return
    path = Path(name)
    summary = {**read(path), **fields}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(summary, f)
    os.replace(tmp, path)
