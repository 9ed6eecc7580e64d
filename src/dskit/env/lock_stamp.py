"""Is .venv still what the last `uv sync --frozen` made of this uv.lock? Then a launch need not sync again.

`uv sync` takes ~1.5 s (1.3 CPU-s) even when nothing changed, on every launch and every node that syncs; the
doctor's exact comparison (`uv sync --check`) another second. After each sync the launchers write a stamp into
the environment: the digest of uv.lock and pyproject.toml. The stamp holds while both files are unchanged and the
environment's site-packages has not changed since it was written: installing or removing a package (pip, uv pip)
adds or removes entries there, which moves the directory's modification time past the stamp's.

Standard library only (it runs before the environment is known to be whole):

  python -m dskit.env.lock_stamp check [VENV]   exit 0 when the stamp holds, 1 when the launcher must sync
  python -m dskit.env.lock_stamp write [VENV]   after a successful sync
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from model_utils.repo import REPO_ROOT

STAMP = "dskit-synced.json"
LOCK_FILES = ("uv.lock", "pyproject.toml")


def digest(project: Path) -> str:
    sha = hashlib.sha256()
    for name in LOCK_FILES:
        sha.update(name.encode() + b"\0" + (project / name).read_bytes() + b"\0")
    return sha.hexdigest()


def _site_packages(venv: Path) -> list[Path]:
    return sorted(venv.glob("lib/python3*/site-packages"))


def synced_at(project: Path, venv: Path) -> float | None:
    """When the sync this stamp records happened, if the environment is unchanged since; else None."""
    stamp = venv / STAMP
    try:
        recorded = json.loads(stamp.read_text())
        written = stamp.stat().st_mtime
        if recorded.get("digest") != digest(project) or not (venv / "bin" / "python").exists():
            return None
        sites = _site_packages(venv)
        if not sites or any(site.stat().st_mtime > written for site in sites):
            return None
        return float(recorded.get("synced_at", written))
    except (OSError, ValueError, AttributeError):
        return None


def write(project: Path, venv: Path) -> None:
    # Written after the sync's last change to site-packages, so its mtime is the later one.
    (venv / STAMP).write_text(json.dumps({"digest": digest(project), "synced_at": time.time()}) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] not in ("check", "write"):
        print("usage: python -m dskit.env.lock_stamp check|write [VENV]", file=sys.stderr)
        return 2
    venv = Path(argv[1]) if len(argv) == 2 else REPO_ROOT / ".venv"
    if argv[0] == "write":
        write(REPO_ROOT, venv)
        return 0
    return 0 if synced_at(REPO_ROOT, venv) is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
