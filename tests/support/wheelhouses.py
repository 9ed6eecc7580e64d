"""Wheelhouses for tests of `dskit.env.wheelhouse install`: a manifest for this machine and this checkout's
uv.lock (no wheels: an environment that already has everything needs none), and the install command run as the
launchers run it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from dskit.env import wheelhouse

REPO = Path(__file__).resolve().parents[2]


def manifest_dir(path: Path, **override: object) -> Path:
    path.mkdir()
    manifest = {
        "format": wheelhouse.FORMAT,
        "lock_sha256": wheelhouse.lock_digest(REPO),
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "machine": platform.machine(),
        "glibc": "2.28",
        "kit_wheel": "dskit-0.1.0-py3-none-any.whl",
        "packages": 0,
        "bytes": 0,
        **override,
    }
    (path / wheelhouse.MANIFEST).write_text(json.dumps(manifest))
    (path / wheelhouse.REQUIREMENTS).write_text("")
    return path


def install(wheelhouse_dir: Path, venv: Path, *more: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    command = [
        sys.executable,
        "-m",
        "dskit.env.wheelhouse",
        "install",
        str(wheelhouse_dir),
        "--venv",
        str(venv),
        *more,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
