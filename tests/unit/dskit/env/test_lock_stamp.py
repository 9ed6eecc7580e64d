"""dskit.env.lock_stamp: a launch skips `uv sync` only while the environment is what the last sync made of
this uv.lock and pyproject.toml."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dskit.env import lock_stamp


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "uv.lock").write_text("version = 1\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "t"\n')
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    (tmp_path / ".venv" / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    return tmp_path


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_no_stamp_means_sync(project: Path) -> None:
    assert lock_stamp.synced_at(project, project / ".venv") is None


def test_the_stamp_holds_until_the_lock_or_the_environment_changes(project: Path) -> None:
    venv = project / ".venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    age(site, 60)  # the sync's last change came before its stamp
    lock_stamp.write(project, venv)
    assert lock_stamp.synced_at(project, venv) is not None

    (site / "__pycache__").mkdir()  # what importing does inside site-packages' own cache dir is not a change
    (site / "__pycache__" / "x.cpython-311.pyc").write_text("")
    age(site, 60)
    assert lock_stamp.synced_at(project, venv) is not None

    (site / "extra-1.0.dist-info").mkdir()  # `pip install extra`: a new entry moves the directory's mtime
    assert lock_stamp.synced_at(project, venv) is None

    age(site, 60)
    lock_stamp.write(project, venv)
    assert lock_stamp.synced_at(project, venv) is not None
    (project / "uv.lock").write_text("version = 1\n# moved on\n")
    assert lock_stamp.synced_at(project, venv) is None
    lock_stamp.write(project, venv)
    (project / "pyproject.toml").write_text('[project]\nname = "t"\ndependencies = ["x"]\n')
    assert lock_stamp.synced_at(project, venv) is None


def test_a_damaged_stamp_or_a_missing_interpreter_means_sync(project: Path) -> None:
    venv = project / ".venv"
    age(venv / "lib" / "python3.11" / "site-packages", 60)
    (venv / lock_stamp.STAMP).write_text("{not json")
    assert lock_stamp.synced_at(project, venv) is None
    lock_stamp.write(project, venv)
    (venv / "bin" / "python").unlink()
    assert lock_stamp.synced_at(project, venv) is None


def test_the_command_answers_by_its_status(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lock_stamp, "REPO_ROOT", project)
    venv = str(project / ".venv")
    age(project / ".venv" / "lib" / "python3.11" / "site-packages", 60)
    assert lock_stamp.main(["check", venv]) == 1
    assert lock_stamp.main(["write", venv]) == 0
    assert lock_stamp.main(["check", venv]) == 0
    assert lock_stamp.main(["sync"]) == 2
