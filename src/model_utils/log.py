"""Rank-0 logging: one helper, so no module needs `if rank == 0` for output."""

from __future__ import annotations

import os
import sys
import time


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def print0(message: str) -> None:
    """Print a timestamped line from global rank 0 only (flushed: logs are tailed live)."""
    if _rank() == 0:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{stamp} | {message}", flush=True)


def warn0(message: str) -> None:
    print0(f"WARNING: {message}")


def error_line(message: str) -> None:
    """The single line a user sees for a mistake; printed by rank 0 only so N ranks do not repeat it."""
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
