"""Where uv is: on PATH, or the one the launchers bootstrap with pip (`python3 -m uv`). Standard library only: the
wheelhouse runs under a bare interpreter."""

from __future__ import annotations

import shutil
import subprocess

# A `python3 -m uv --version` that hangs (a broken install) must not hang the doctor.
VERSION_TIMEOUT_S = 20


def uv_command() -> list[str] | None:
    """The command that runs uv, or None when there is none."""
    if found := shutil.which("uv"):
        return [found]
    python3 = shutil.which("python3")
    if python3:
        try:
            probe = subprocess.run(
                [python3, "-m", "uv", "--version"],
                capture_output=True,
                timeout=VERSION_TIMEOUT_S,
                check=False,
            )
            if probe.returncode == 0:
                return [python3, "-m", "uv"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None
