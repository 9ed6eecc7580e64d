"""`dskit.env.wheelhouse install --overlay` for real: a venv over this interpreter's environment installs nothing
more, imports the base's torch, and is found up to date on the next launch. The wheel selection and refusals:
tests/unit/dskit/env/test_wheelhouse.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dskit.env import wheelhouse
from support.torchrun import REPO
from support.wheelhouses import install, manifest_dir

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]


def test_overlay_venv_sees_the_base_packages_installs_nothing_more_and_is_reused(tmp_path: Path) -> None:
    """Over an interpreter that has everything (this one: a venv itself), the overlay needs nothing from the
    wheelhouse, imports the base's torch, and a second launch finds it up to date."""
    wh, venv = manifest_dir(tmp_path / "wh"), tmp_path / ".venv"
    proc = install(wh, venv, "--overlay", "--test_tools")  # pytest too: the base's is kept (none in wh)
    assert proc.returncode == 0, proc.stderr
    assert "installing nothing" in proc.stdout
    import torch

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__file__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert where == torch.__file__
    stamp = json.loads((venv / wheelhouse.STAMP).read_text())
    assert stamp == {
        "lock_sha256": wheelhouse.lock_digest(REPO),
        "base": os.path.realpath(sys.executable),
        "overlay": True,
    }
    again = install(wh, venv, "--overlay")
    assert again.returncode == 0 and "(up to date)" in again.stdout
    # the same venv asked for as a plain one is a different install: refused, not silently reused
    plain = install(wh, venv)
    assert plain.returncode == 2 and "rm -rf" in plain.stderr
