"""The GPUs and their CUDA stack: torch's CUDA against the NVIDIA driver (with NVIDIA's driver tables), the CUDA
toolkit under CUDA_ROOT/cuda-$CUDA_VERSION that the launchers put on PATH for DeepSpeed's JIT ops, and the GPUs
per node against GPUS_PER_NODE/CPU_RANKS.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from dskit.launcher.node import CUDA_ROOT, toolkit_home

from .context import GpuProbe, LaunchContext, _run, _version_tuple, ranks_per_node
from .report import Result, Status

# The driver a CUDA release needs. Below the family floor, nothing built with that CUDA major runs; between the
# floor and the release's own driver it runs through minor-version compatibility, without PTX JIT. (NVIDIA: CUDA
# Toolkit release notes, "CUDA Toolkit and Corresponding Driver Versions"; CUDA compatibility guide.)
CUDA_FAMILY_MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
CUDA_RELEASE_DRIVER = {
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}


# --- 2./3. torch's CUDA, the driver and the toolkit --------------------------------------------------------


def driver_verdict(torch_cuda: str, driver: str) -> tuple[Status, str, str]:
    """(status, found, fix) for a torch built with CUDA `torch_cuda` on an NVIDIA driver `driver`."""
    cuda = _version_tuple(torch_cuda)[:2]
    have = _version_tuple(driver)
    floor = CUDA_FAMILY_MIN_DRIVER.get(cuda[0])
    release = CUDA_RELEASE_DRIVER.get(cuda)
    found = f"driver {driver}, torch built with CUDA {torch_cuda}"
    if floor is None:
        return (
            Status.WARN,
            f"{found}: CUDA {cuda[0]}.x is not in the doctor's table",
            f"check that the driver supports CUDA {torch_cuda} (nvidia-smi prints the newest CUDA it supports)",
        )
    if have < _version_tuple(floor):
        return (
            Status.FAIL,
            f"{found}, which needs driver >= {release or floor}",
            f"upgrade the NVIDIA driver to >= {release or floor}, or use a torch built for an older CUDA "
            f"(e.g. the cu126 wheel) in pyproject.toml/uv.lock",
        )
    if release is not None and have < _version_tuple(release):
        return (
            Status.WARN,
            f"{found}: runs through CUDA minor-version compatibility only (no PTX JIT; needs >= {release} for all)",
            f"upgrade the NVIDIA driver to >= {release}",
        )
    return Status.PASS, found + (f" (>= {release})" if release else f" (>= {floor} for CUDA {cuda[0]}.x)"), ""


def check_driver(gpus: GpuProbe, torch_cuda: str | None, torch_version: str) -> Result:
    name = "torch CUDA vs driver"
    if not gpus.present:
        if gpus.smi_error:
            return Result(
                name,
                Status.WARN,
                f"nvidia-smi fails: {gpus.smi_error}",
                "check the NVIDIA driver (nvidia-smi, dmesg); ignore on a CPU-only node",
            )
        return Result(name, Status.SKIP, f"no GPU on this node (torch {torch_version})")
    if torch_cuda is None:
        return Result(
            name,
            Status.FAIL,
            f"torch {torch_version} is a CPU-only build, but this node has {max(gpus.smi_count, gpus.torch_count)} GPUs",
            "install the CUDA build of torch from uv.lock: uv sync --frozen",
        )
    if gpus.driver is None:
        return Result(
            name,
            Status.WARN,
            f"could not read the NVIDIA driver version (torch built with CUDA {torch_cuda})",
            "check the driver: nvidia-smi, /proc/driver/nvidia/version",
        )
    status, found, fix = driver_verdict(torch_cuda, gpus.driver)
    return Result(name, status, found, fix)


def check_toolkit(
    ctx: LaunchContext, gpus: GpuProbe, torch_cuda: str | None, root: Path = CUDA_ROOT
) -> Result:
    """The toolkit under root/cuda-$CUDA_VERSION that the launchers put on PATH for DeepSpeed's JIT ops."""
    name = "CUDA toolkit"
    if not ranks_per_node(ctx, gpus)[1]:
        return Result(
            name, Status.SKIP, f"CPU ranks: no toolkit needed (CUDA_VERSION={ctx.cuda_version} unused)"
        )
    if torch_cuda is None:
        return Result(name, Status.SKIP, "torch has no CUDA (see 'torch CUDA vs driver')")
    found_home = toolkit_home(ctx.cuda_version, root)
    home = found_home or root / f"cuda-{ctx.cuda_version}"
    installed = sorted(p.name for p in root.glob("cuda-*") if p.is_dir())
    if found_home is None:
        others = f"installed: {', '.join(installed)}" if installed else f"none is installed under {root}"
        return Result(
            name,
            Status.FAIL,
            f"no CUDA {ctx.cuda_version} toolkit at {home} ({others})",
            f"install CUDA {ctx.cuda_version} at {home}, or set CUDA_VERSION to an installed one "
            f"whose major is {torch_cuda.split('.')[0]} (torch's)",
        )
    nvcc = home / "bin" / "nvcc"
    if not os.access(nvcc, os.X_OK):
        return Result(
            name, Status.FAIL, f"{home} has no bin/nvcc", f"install the full toolkit (cuda-nvcc) under {home}"
        )
    try:
        proc = _run([str(nvcc), "--version"])
        release = re.search(r"release (\d+\.\d+)", proc.stdout)
    except (OSError, subprocess.TimeoutExpired):
        release = None
    if release is None:
        return Result(name, Status.FAIL, f"{nvcc} --version fails", f"reinstall the CUDA toolkit at {home}")
    nvcc_version = release.group(1)
    found = f"{home}: nvcc {nvcc_version}, torch built with CUDA {torch_cuda}"
    if nvcc_version.split(".")[0] != torch_cuda.split(".")[0]:
        matching = [d for d in installed if d.removeprefix("cuda-").split(".")[0] == torch_cuda.split(".")[0]]
        hint = (
            f"CUDA_VERSION={matching[-1].removeprefix('cuda-')}" if matching else f"install CUDA {torch_cuda}"
        )
        return Result(
            name,
            Status.FAIL,
            found + ": the CUDA majors differ, so DeepSpeed's JIT ops cannot be built",
            f"{hint} (a toolkit with torch's CUDA major)",
        )
    if nvcc_version != ".".join(ctx.cuda_version.split(".")[:2]):  # nvcc says the minor release only
        return Result(
            name,
            Status.WARN,
            f"{found}, but the directory says {ctx.cuda_version}",
            f"check the install at {home}",
        )
    return Result(name, Status.PASS, found)


# --- 4. GPUs per node ----------------------------------------------------------------------------------


def check_gpus(ctx: LaunchContext, gpus: GpuProbe) -> Result:
    name = "GPUs"
    names = f" ({gpus.names[0]})" if gpus.names else ""
    if gpus.smi_count > 0 and gpus.torch_count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return Result(
            name,
            Status.FAIL,
            f"nvidia-smi lists {gpus.smi_count} GPUs{names} but torch sees none{extra}",
            "see 'torch CUDA vs driver' (CPU-only torch or too old a driver), or fix CUDA_VISIBLE_DEVICES",
        )
    if ctx.launcher_gpus is not None and ctx.launcher_gpus != gpus.torch_count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return Result(
            name,
            Status.FAIL,
            f"the launcher counted {ctx.launcher_gpus} GPUs (the driver's, narrowed by CUDA_VISIBLE_DEVICES="
            f"{visible!r}), torch sees {gpus.torch_count}{names}: the ranks would not match the devices",
            "give CUDA_VISIBLE_DEVICES as GPU indices (0,1,...) or UUIDs, or unset it",
        )
    if gpus.torch_count > 0:
        if ctx.gpus_per_node == 0:
            return Result(
                name,
                Status.WARN,
                f"{gpus.torch_count} GPUs{names}, but GPUS_PER_NODE=0: the run uses {ctx.cpu_ranks} CPU ranks",
                f"to train on the GPUs: GPUS_PER_NODE={gpus.torch_count} ./train-singlenode.sh (or sbatch "
                f"train.sbatch), or the launchers rendered with: dskit render --set gpus_per_node={gpus.torch_count}",
            )
        if gpus.torch_count != ctx.gpus_per_node:
            return Result(
                name,
                Status.WARN,
                f"{gpus.torch_count} GPUs{names}, the launch values say {ctx.gpus_per_node}: "
                f"{gpus.torch_count} ranks per node",
                f"if this node is as intended: dskit render --set gpus_per_node={gpus.torch_count} (the "
                "launchers start a rank per GPU either way)",
            )
        return Result(name, Status.PASS, f"{gpus.torch_count} GPUs{names} = GPUS_PER_NODE")
    if ctx.cpu_ranks < 1:
        return Result(
            name,
            Status.FAIL,
            "no GPU and CPU_RANKS=0: nothing to train on",
            "CPU_RANKS=2 ./train-singlenode.sh (or sbatch train.sbatch), or use GPU nodes",
        )
    cpu_run = f"no GPU: {ctx.cpu_ranks} CPU ranks per node over gloo"
    if ctx.gpus_per_node == 0 or (ctx.ds_accelerator or "").lower() == "cpu":
        why = "GPUS_PER_NODE=0" if ctx.gpus_per_node == 0 else "DS_ACCELERATOR=cpu"
        return Result(name, Status.PASS, f"{cpu_run} ({why})")
    # No NVIDIA driver: a CPU machine, where the launchers start CPU ranks whatever GPUS_PER_NODE says.
    if gpus.driver is None and gpus.smi_error is None:
        return Result(name, Status.PASS, f"{cpu_run} (what the launchers start on a node without GPUs)")
    driver = f"the NVIDIA driver {gpus.driver} is loaded" if gpus.driver else "nvidia-smi fails"
    return Result(
        name,
        Status.WARN,
        f"{cpu_run}: {driver} but no GPU is visible, though GPUS_PER_NODE={ctx.gpus_per_node}",
        "check the GPUs: nvidia-smi (see 'torch CUDA vs driver'); to train on CPU ranks here on purpose: "
        "GPUS_PER_NODE=0 ./train-singlenode.sh (or sbatch train.sbatch)",
    )
