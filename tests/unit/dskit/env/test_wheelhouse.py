"""dskit.env.wheelhouse: which locked file a target gets, and the offline install's refusals. Its overlay venv for
real: tests/e2e/test_wheelhouse.py.

The full build (3 GiB from PyPI) and a full offline install with training runs are in tests/slurm (they run when
~/.cache/dskit/wheelhouse holds a wheelhouse of this uv.lock: docs/testing.md).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from dskit.env import wheelhouse
from support.wheelhouses import install, manifest_dir

REPO = Path(__file__).resolve().parents[4]
LOCK = tomllib.loads((REPO / "uv.lock").read_text())


def chosen(python: str, machine: str, glibc: str) -> dict[str, dict]:
    pins = wheelhouse.locked_pins(REPO, wheelhouse.target_environment(python, machine))
    files = wheelhouse.choose_files(LOCK, pins, wheelhouse.target_tags(python, machine, glibc))
    return {f["name"]: f for f in files}


@pytest.fixture(scope="module")
def x86_311() -> dict[str, dict]:
    return chosen("3.11", "x86_64", "2.28")


def test_each_target_gets_its_own_wheels(x86_311: dict[str, dict]) -> None:
    assert x86_311["torch"]["file"] == "torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert x86_311["deepspeed"]["build"] and x86_311["deepspeed"]["file"].endswith(".tar.gz")  # sdist only
    accepted = set(wheelhouse.target_tags("3.11", "x86_64", "2.28"))
    for f in x86_311.values():
        assert f["build"] or set(parse_wheel_filename(f["file"])[3]) & accepted, f["file"]
        assert f["hash"].startswith("sha256:")
    # a Windows-only pin (waitress: mlflow's server on Windows) is not fetched; colorama, once one, is not since
    # sacrebleu (lm-eval's) needs it everywhere
    assert "waitress" not in x86_311 and "colorama" in x86_311
    other = chosen("3.12", "aarch64", "2.28")
    assert other["torch"]["file"] == "torch-2.15.0-cp312-cp312-manylinux_2_28_aarch64.whl"
    assert other["numpy"]["version"] != x86_311["numpy"]["version"]  # the lock pins numpy per Python version


def test_a_target_without_a_wheel_is_one_clear_error() -> None:
    with pytest.raises(
        wheelhouse.WheelhouseError,
        match=r"==[0-9.]+ has no wheel for this target and no source archive in uv.lock: pick another",
    ):
        chosen("3.11", "x86_64", "2.17")  # torch and its CUDA packages need glibc 2.28 or newer


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (None, "has no dskit-wheelhouse.json: build one with `make wheelhouse` on a connected machine"),
        ({"lock_sha256": "0" * 64}, "was built from another uv.lock than this repo's: rebuild it"),
        ({"python": "3.99"}, "is for Python 3.99 on"),
        ({"machine": "riscv64"}, "make wheelhouse WHEELHOUSE_PYTHON="),
    ],
    ids=["not-a-wheelhouse", "other-lock", "other-python", "other-machine"],
)
def test_a_wheelhouse_for_something_else_is_refused_in_one_line(
    tmp_path: Path, override: dict | None, expected: str
) -> None:
    wh = tmp_path / "wh"
    if override is None:
        wh.mkdir()
    else:
        manifest_dir(wh, **override)
    proc = install(wh, tmp_path / "venv")
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: WHEELHOUSE=") and expected in line
    assert not (tmp_path / "venv").exists()


def test_an_existing_venv_not_from_a_wheelhouse_is_left_alone(tmp_path: Path) -> None:
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("uv = 0.13.9\n")
    proc = install(manifest_dir(tmp_path / "wh"), venv)
    assert proc.returncode == 2
    assert "exists and was not installed from a wheelhouse (uv's environment?): move it away" in proc.stderr
    assert sorted(p.name for p in venv.iterdir()) == ["bin", "pyvenv.cfg"]
