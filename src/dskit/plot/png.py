"""Writing a figure as a PNG, shared by the run plot and the schedule plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def save_png(fig: Any, out: Path) -> None:
    """Through a temp file and a rename: a failed write leaves any earlier plot at `out` as it was."""
    partial = out.with_name(f".{out.name}.partial")
    try:
        fig.savefig(partial, format="png", dpi=100)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
