"""launcher/node.py: a node's ranks, CUDA toolkit, threads per rank and network, from what the run's Python sees
(an interpreter with GPUs stood in for: none here) and the launch settings; a toolkit tree and an EFA device in
sysfs made in tmp_path."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dskit.launcher import node
from model_utils.errors import ConfigError
from model_utils.launch import health_gate
from support.fake_commands import executable

REPO = Path(__file__).resolve().parents[4]
HOST = socket.gethostname()
SETTINGS = {"GPUS_PER_NODE": "8", "CPU_RANKS": "2", "CUDA_VERSION": "12.8"}


def toolkits(tmp_path: Path, *versions: str) -> Path:
    for version in versions:
        (tmp_path / f"cuda-{version}").mkdir()
    return tmp_path


def test_a_gpu_node_runs_a_rank_per_gpu_with_the_toolkit_of_cuda_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = toolkits(tmp_path, "12.8", "12.9")
    chosen = node.choose(8, SETTINGS, cores=96, cuda_root=root)
    assert chosen == node.Node(gpus=8, ranks=8, threads="12", cuda_home=root / "cuda-12.8")
    assert capsys.readouterr().err.splitlines() == [
        f"CUDA toolkit: {root / 'cuda-12.8'}",
        "Ranks per node: 8 (GPUs)",
        "Threads per rank: OMP_NUM_THREADS=12 (96 cores / 8 ranks)",
    ]
    # every GPU the node has, whatever the launch values say, with a warning
    assert node.choose(4, SETTINGS, cores=96, cuda_root=root).ranks == 4
    assert f"WARNING: {HOST} has 4 GPUs, the launch values say 8: using all 4" in capsys.readouterr().err


def test_a_gpu_node_without_the_toolkit_is_an_error_naming_the_installed_ones(tmp_path: Path) -> None:
    root = toolkits(tmp_path, "12.4", "12.9")
    with pytest.raises(ConfigError) as e:
        node.choose(8, {**SETTINGS, "CUDA_VERSION": "99.9"}, cores=8, cuda_root=root)
    assert str(e.value) == (
        f"CUDA toolkit 99.9 not found at {root / 'cuda-99.9'} on {HOST}: install it there or set CUDA_VERSION to "
        "an installed one (cuda-12.4 cuda-12.9)"
    )


def test_a_patch_release_finds_the_toolkit_of_its_minor_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # NVIDIA's CUDA images export CUDA_VERSION=13.0.2 and install at /usr/local/cuda-13.0 (seen on an H200 image)
    root = toolkits(tmp_path, "13", "13.0")
    chosen = node.choose(1, {**SETTINGS, "CUDA_VERSION": "13.0.2"}, cores=16, cuda_root=root)
    assert chosen.cuda_home == root / "cuda-13.0"
    assert (
        f"CUDA toolkit: {root / 'cuda-13.0'} (CUDA_VERSION=13.0.2: its minor release)"
        in capsys.readouterr().err
    )
    # its own directory first, where there is one
    (root / "cuda-13.0.2").mkdir()
    assert node.choose(1, {**SETTINGS, "CUDA_VERSION": "13.0.2"}, cores=16, cuda_root=root).cuda_home == (
        root / "cuda-13.0.2"
    )
    with pytest.raises(
        ConfigError, match=r"CUDA toolkit 12.9.1 not found at .*cuda-12.9.1 .*\(cuda-13 cuda-13.0"
    ):
        node.choose(1, {**SETTINGS, "CUDA_VERSION": "12.9.1"}, cores=16, cuda_root=root)


@pytest.mark.parametrize(("gpus", "gpus_per_node"), [(0, "8"), (8, "0")], ids=["no GPU", "GPUS_PER_NODE=0"])
def test_cpu_ranks_without_gpus_or_toolkit(
    gpus: int, gpus_per_node: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = {**SETTINGS, "GPUS_PER_NODE": gpus_per_node, "CUDA_VERSION": "99.9"}  # no toolkit needed
    chosen = node.choose(gpus, settings, cores=2, cuda_root=Path("/nonexistent"))
    assert chosen == node.Node(gpus=gpus, ranks=2, threads="1", cuda_home=None)
    assert f"Ranks per node: 2 (CPU, no GPU on {HOST})" in capsys.readouterr().err
    # at least one thread each (torchrun would set 1 and print a banner saying so)
    assert node.choose(0, {**settings, "CPU_RANKS": "3"}, cores=2).threads == "1"


def test_threads_set_by_the_caller_are_kept(capsys: pytest.CaptureFixture[str]) -> None:
    assert node.choose(0, {**SETTINGS, "OMP_NUM_THREADS": "4,2"}, cores=64).threads == "4,2"
    assert "Threads per rank: OMP_NUM_THREADS=4,2 (from the environment)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"CPU_RANKS": "0"}, f"{HOST} has no GPU and CPU_RANKS is 0: set CPU_RANKS or use GPU nodes"),
        ({"CPU_RANKS": "two"}, "CPU_RANKS=two: use a whole number (0 or more)"),
    ],
)
def test_no_rank_to_run_or_a_bad_count_is_an_error(settings: dict[str, str], said: str) -> None:
    with pytest.raises(ConfigError) as e:
        node.choose(0, {**SETTINGS, **settings}, cores=8)
    assert str(e.value) == said


def test_efa_is_found_by_its_devices_driver(tmp_path: Path) -> None:
    """The devices node.py asks health_gate for (its gate counts them): /sys/class/infiniband/*/device/driver."""
    sysfs = tmp_path / "infiniband"
    assert health_gate.efa_devices(sysfs) == []  # no such dir: no device
    for name, driver in (("mlx5_0", "mlx5_core"), ("rdmap16s27", "efa")):
        (tmp_path / "drivers" / driver).mkdir(parents=True)
        (sysfs / name / "device").mkdir(parents=True)
        (sysfs / name / "device" / "driver").symlink_to(tmp_path / "drivers" / driver)
    assert health_gate.efa_devices(sysfs) == ["rdmap16s27"]


def test_the_network_is_efa_only_where_it_exists(capsys: pytest.CaptureFixture[str]) -> None:
    assert node.network("auto", present=True) == "efa"
    assert node.network("on", present=True) == "efa"
    assert f"Network: EFA found on {HOST}: FI_PROVIDER=efa" in capsys.readouterr().err
    assert node.network("auto", present=False) == "tcp"
    assert f"Network: no EFA device on {HOST}: NCCL/gloo use sockets (TCP)" in capsys.readouterr().err
    assert node.network("off", present=True) == "tcp"
    assert "Network: EFA off (efa=off): NCCL/gloo use sockets (TCP)" in capsys.readouterr().err
    # efa=on without EFA is an error, never a silent fall back to sockets
    with pytest.raises(ConfigError, match=rf"^efa=on but {HOST} has no EFA device"):
        node.network("on", present=False)
    with pytest.raises(ConfigError, match=r"^EFA=maybe: use auto, on or off$"):
        node.network("maybe", present=False)


def run_node(tmp_path: Path, probe: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The module as the launchers run it, with a run's Python that answers the probe as `probe` says."""
    python = executable(tmp_path / "python", f"#!/usr/bin/env bash\n{probe}\n")
    env = {**os.environ, **SETTINGS, "PYTHONPATH": str(REPO / "src")}
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        [sys.executable, "-m", "dskit.launcher.node", *args, str(python)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_line_the_launchers_read(tmp_path: Path) -> None:
    proc = run_node(tmp_path, 'echo "0 3.11.7 2.6.0 none 0.19.8"', "--efa", "off")
    assert proc.returncode == 0, proc.stderr
    cores = len(os.sched_getaffinity(0))
    assert proc.stdout == f"0 2 {max(1, cores // 2)} - tcp\n"
    assert proc.stderr.splitlines()[0] == "Versions: python 3.11.7, torch 2.6.0 (CUDA none), deepspeed 0.19.8"
    assert run_node(tmp_path, 'echo "0 3.11.7 2.6.0 none 0.19.8"').stdout.split()[3:] == [
        "-"
    ]  # no network asked


def test_an_interpreter_that_lacks_a_package_stops_it_with_its_own_line(tmp_path: Path) -> None:
    """python_env's probe says what is missing and how to add it (exit 2): that line and status, nothing else."""
    proc = run_node(
        tmp_path, 'echo "error: python lacks what the kit needs: deepspeed (missing)" >&2; exit 2'
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: python lacks what the kit needs: deepspeed (missing)\n"
