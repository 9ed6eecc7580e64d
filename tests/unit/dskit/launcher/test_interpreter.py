"""launcher/interpreter.py: the run's Python: the kit's .venv (uv sync, skipped while the stamp of the last sync
holds), DSKIT_PYTHON as it is, WHEELHOUSE. uv, pip and the wheelhouse install are stood in for (a real sync
downloads the lock's packages; tests/unit/dskit/env/ tests the install and the stamp, tests/slurm/ an offline
install); the project, its lock files, .venv and the stamp are real files in tmp_path."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dskit.env import lock_stamp, wheelhouse
from support.fake_commands import executable
from support.recorded_commands import Commands

REPO = Path(__file__).resolve().parents[4]
SYNC = ["sync", "--frozen", "--quiet", "--compile-bytecode"]


class Project:
    """A checkout (uv.lock, pyproject.toml) in tmp_path, with stand-ins for uv and python3."""

    def __init__(self, tmp_path: Path, venv: bool = True) -> None:
        self.dir = tmp_path / "kit"
        self.dir.mkdir()
        for name in lock_stamp.LOCK_FILES:
            (self.dir / name).write_text(f"{name} of this checkout\n")
        self.venv_python = self.dir / ".venv" / "bin" / "python"
        if venv:
            executable(self.venv_python, "#!/bin/sh\n")
            (self.dir / ".venv" / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
        self.commands = Commands(tmp_path / "stand-ins")
        self.commands.add("uv")
        self.commands.add("python3")

    def choose(self, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
        """What the launchers run first, in the checkout: the interpreter's path on stdout."""
        environ = {
            "PATH": path or self.commands.path,
            "PYTHONPATH": str(REPO / "src"),
            "HOME": str(self.dir),
            **env,
        }
        return subprocess.run(
            [sys.executable, "-m", "dskit.launcher.interpreter"],
            cwd=self.dir, env=environ, capture_output=True, text=True, timeout=60,
        )  # fmt: skip


def test_the_kits_venv_is_synced_once_and_again_only_when_the_lock_changes(tmp_path: Path) -> None:
    """`uv sync` costs ~1.5 s a launch even when nothing changed: skipped while the stamp holds
    (dskit/env/lock_stamp.py); a sync writes a new one."""
    kit = Project(tmp_path)
    first = kit.choose()
    assert first.returncode == 0, first.stderr
    assert first.stdout == f"{kit.venv_python}\n"
    assert kit.commands.calls("uv") == [SYNC]
    assert "Installing the locked environment" not in first.stderr  # .venv there: a quick sync, said nothing
    assert lock_stamp.synced_at(kit.dir, kit.dir / ".venv") is not None
    assert kit.choose().stdout == f"{kit.venv_python}\n"
    assert kit.commands.calls("uv") == [SYNC]  # the stamp held
    (kit.dir / "uv.lock").write_text("a new lock\n")
    assert kit.choose().returncode == 0
    assert kit.commands.calls("uv") == [SYNC, SYNC]


def test_a_first_install_of_the_venv_is_announced(tmp_path: Path) -> None:
    """The first `uv sync` is the one long step before the preflight speaks (about 20 s with uv's cache)."""
    kit = Project(tmp_path, venv=False)
    first = kit.choose()
    assert first.returncode == 0, first.stderr
    assert first.stderr.splitlines() == [
        "Installing the locked environment into .venv (uv sync --frozen; the first time about 20 s with uv's "
        "cache, a few minutes without) ..."
    ]
    assert kit.commands.calls("uv") == [SYNC]


def test_uv_is_bootstrapped_with_pip_where_there_is_none(tmp_path: Path) -> None:
    kit = Project(tmp_path)
    (kit.commands.bin / "uv").unlink()
    # python3 has no uv module until pip installs it
    kit.commands.add("python3", '[[ "$*" != "-m uv --version" ]] || exit 1')
    proc = kit.choose(path=f"{kit.commands.bin}:/usr/bin:/bin")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["uv not found: installing it with pip"]
    assert kit.commands.calls("python3") == [
        ["-m", "uv", "--version"], ["-m", "pip", "install", "--quiet", "uv"], ["-m", "uv", *SYNC]
    ]  # fmt: skip


def test_a_failed_sync_ends_the_launch_with_its_status(tmp_path: Path) -> None:
    kit = Project(tmp_path)
    kit.commands.add("uv", "echo 'error: the lock needs updating' >&2; exit 2")
    proc = kit.choose()
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "error: the lock needs updating\n"
    assert lock_stamp.synced_at(kit.dir, kit.dir / ".venv") is None


@pytest.mark.parametrize("how", ["PATH", "path"])
def test_dskit_python_is_used_as_it_is(tmp_path: Path, how: str) -> None:
    kit = Project(tmp_path)
    given = kit.commands.add("torch-python")
    proc = kit.choose(DSKIT_PYTHON="torch-python" if how == "PATH" else str(given))
    assert proc.returncode == 0, proc.stderr
    name = "torch-python" if how == "PATH" else str(given)
    assert proc.stdout == f"{name}\n"
    assert proc.stderr == f"Python: {name} (DSKIT_PYTHON: used as it is, no uv sync)\n"
    assert kit.commands.calls("uv") == []


def test_a_missing_dskit_python_is_one_line(tmp_path: Path) -> None:
    kit = Project(tmp_path)
    proc = kit.choose(DSKIT_PYTHON="/nonexistent/python3")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        f"error: DSKIT_PYTHON=/nonexistent/python3: no such interpreter on {socket.gethostname()}: give the path of "
        "a Python that has torch (e.g. /usr/bin/python3 in a container), or unset it to use the kit's own .venv\n"
    )
    assert kit.commands.calls("uv") == []


@pytest.mark.parametrize("given_python", [False, True])
def test_a_wheelhouse_installs_the_venv_then_it_is_reused(tmp_path: Path, given_python: bool) -> None:
    """WHEELHOUSE: the base interpreter (python3, or DSKIT_PYTHON under the venv) installs .venv from it, with no
    network; later launches without it use that .venv as it is (no uv sync: no network there)."""
    kit = Project(tmp_path)
    given = kit.commands.add("torch-python")
    env = {"WHEELHOUSE": "/fsx/wheelhouse", **({"DSKIT_PYTHON": str(given)} if given_python else {})}
    proc = kit.choose(**env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{kit.venv_python}\n"
    install = ["-m", "dskit.env.wheelhouse", "install", "/fsx/wheelhouse", "--venv", ".venv"]
    base = "torch-python" if given_python else "python3"
    assert kit.commands.calls(base) == [install + (["--overlay"] if given_python else [])]
    assert kit.commands.calls("uv") == []
    (kit.dir / ".venv" / wheelhouse.STAMP).write_text("{}\n")  # what the install leaves
    later = kit.choose()
    assert later.stdout == f"{kit.venv_python}\n"
    assert (
        later.stderr == "Python: .venv, installed from a wheelhouse (no uv sync; WHEELHOUSE=DIR updates it)\n"
    )
    assert kit.commands.calls("uv") == []


def test_a_failed_wheelhouse_install_ends_the_launch_with_its_status(tmp_path: Path) -> None:
    kit = Project(tmp_path)
    kit.commands.add("python3", "echo 'error: the wheelhouse is of another uv.lock' >&2; exit 2")
    proc = kit.choose(WHEELHOUSE="/fsx/wheelhouse")
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2,
        "",
        "error: the wheelhouse is of another uv.lock\n",
    )
