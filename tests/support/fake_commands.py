"""Stand-in commands for tests of what runs them (the launchers, the doctor): an executable script at a path."""

from __future__ import annotations

from pathlib import Path

NOOP = "#!/usr/bin/env bash\n"  # succeeds, does nothing


def executable(path: Path, text: str) -> Path:
    """`text` written to `path` (its directories made) and made executable; the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path
