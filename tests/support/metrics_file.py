"""A run's metrics file (JSON lines) as the tests read it."""

from __future__ import annotations

import json
from pathlib import Path


def step_records(path: Path) -> dict[int, dict]:
    """The logged training steps by step number (start events and validation records left out)."""
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}
