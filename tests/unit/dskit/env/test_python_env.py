"""dskit.env.python_env: what the launchers ask an interpreter before anything else (DSKIT_PYTHON, containers)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch as torch_module

from dskit.env import python_env

REPO = Path(__file__).resolve().parents[4]


def fake_distribution(site: Path, name: str, version: str) -> None:
    """An importable distribution `name` at `version` (metadata and a top-level package), shadowing the real one."""
    module = name.replace("-", "_")
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text("")
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def run_module(python: str, *args: str, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run(
        [python, "-m", "dskit.env.python_env", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_every_dependency_of_pyproject_is_read() -> None:
    lines = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [r.name for r in python_env.requirements(REPO)]
    assert len(names) == len(lines)  # none excluded by a marker on Linux, none unparsed
    assert {"torch", "deepspeed", "transformers", "liger-kernel", "pyyaml"} <= set(names)


def test_versions_compare_on_their_release_numbers() -> None:
    torch = python_env.parse("torch>=2.6")
    assert torch is not None
    # an NGC container's torch is a 2.6 (pip would call it older and replace it)
    assert torch.allows("2.6.0a0+ecf3bae40a.nv25.01") and torch.allows("2.15.0+cu132")
    assert not torch.allows("2.5.1")
    ranged = python_env.parse("x>=1.2,<2")
    assert (
        ranged is not None
        and ranged.allows("1.10")
        and not ranged.allows("2.0")
        and not ranged.allows("1.1.9")
    )
    assert python_env.parse("liger-kernel>=0.8.5 ; sys_platform == 'darwin'") is None


def test_the_kits_environment_passes_and_probes() -> None:
    assert python_env.check(REPO) is None
    proc = run_module(sys.executable, "probe", pythonpath=[REPO / "src"])
    assert proc.returncode == 0, proc.stderr
    gpus, python, torch, _cuda, deepspeed = proc.stdout.split()
    assert (python, torch, deepspeed) == (
        ".".join(map(str, sys.version_info[:3])),
        torch_module.__version__,
        importlib.metadata.version("deepspeed"),
    )
    assert int(gpus) >= 0


def test_a_bare_interpreter_gets_one_line_naming_everything_and_the_pip_command(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    python = str(tmp_path / "bare" / "bin" / "python")
    proc = run_module(python, "probe", pythonpath=[REPO / "src"])
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {python} (Python ") and "lacks what the kit needs" in line
    for req in python_env.requirements(REPO):
        assert f"{req.name} (missing)" in line and f"'{req.text}'" in line
    assert f"Fix: {python} -m pip install " in line and "WHEELHOUSE=DIR" in line
    assert "torch==" not in line  # no torch to keep
    assert "(installs torch: this interpreter has none, or one too old)" in line and "pins" not in line


def test_an_old_package_is_named_and_the_installed_torch_is_pinned(tmp_path: Path) -> None:
    site = tmp_path / "site"
    fake_distribution(site, "transformers", "4.46.0")
    fake_distribution(site, "torch", "2.6.0a0+ecf3bae40a.nv25.01")  # a container's torch: good enough
    proc = run_module(sys.executable, "probe", pythonpath=[site, REPO / "src"])
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert "lacks what the kit needs: transformers 4.46.0 (needs transformers>=5.16). Fix:" in line
    assert (
        "-m pip install 'transformers>=5.16' 'torch==2.6.0a0+ecf3bae40a.nv25.01' (pins the installed torch"
        in line
    )
    missing = run_module(sys.executable, "missing", pythonpath=[site, REPO / "src"])
    assert missing.returncode == 0
    assert missing.stdout.split() == ["transformers>=5.16", "torch==2.6.0a0+ecf3bae40a.nv25.01"]
    # nothing missing: nothing to install (not even the torch pin)
    assert run_module(sys.executable, "missing", pythonpath=[REPO / "src"]).stdout.split() == []


def test_torchs_versions_are_read_without_importing_it() -> None:
    assert python_env.torch_build() == (torch_module.__version__, torch_module.version.cuda)


@pytest.fixture
def nvidia_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node whose driver exposes 4 GPUs (stand-ins for /dev/nvidiactl and /proc/driver/nvidia/gpus)."""
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    for bus in range(4):
        (gpus / f"0000:{bus:02x}:00.0").mkdir(parents=True)
    monkeypatch.setattr(python_env, "NVIDIA_GPUS", gpus)
    monkeypatch.setattr(python_env, "NVIDIA_DRIVER", (gpus.parent,))
    return gpus


@pytest.mark.parametrize(
    ("visible", "count"),
    [(None, 4), ("", 0), ("2", 1), ("0,1,2,3", 4), ("1,3", 2), ("0,7,1", 1), ("-1", 0), ("0,-1,1", 1)],
)
def test_the_gpus_torch_would_count_as_cuda_reads_visible_devices(
    nvidia_node: Path, visible: str | None, count: int
) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert python_env.visible_gpus("12.8", env) == count


def test_no_gpus_without_a_cuda_build_or_a_driver(nvidia_node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert python_env.visible_gpus(None, {}) == 0  # a CPU build of torch
    monkeypatch.setattr(python_env, "NVIDIA_DRIVER", (nvidia_node.parent / "absent",))
    assert python_env.visible_gpus("12.8", {}) == 0


def test_uuids_are_left_to_torch(nvidia_node: Path) -> None:
    """GPU-/MIG- UUIDs: only the CUDA runtime resolves them, so torch counts (none here)."""
    assert (
        python_env.visible_gpus("12.8", {"CUDA_VISIBLE_DEVICES": "GPU-8a2b"})
        == torch_module.cuda.device_count()
    )
