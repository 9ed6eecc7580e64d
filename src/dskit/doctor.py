"""`dskit doctor [TRAINING FLAGS...]`: is this node ready for this run? A pass/warn/fail table, each with a fix.

It takes the training flags (to know the model, data, checkpoint dir and DeepSpeed config) and the launch context
the launchers export (GPUS_PER_NODE, CPU_RANKS, CUDA_VERSION, EFA, SLURM_JOB_NUM_NODES, TORCH_EXTENSIONS_DIR;
defaults from `render.LaunchValues`). Exit status: 1 when a check FAILs, 0 otherwise (WARN does not stop a
launch), 2 for bad flags. It is quick and changes nothing: no op is built, no dataset is loaded in full, no
weights are loaded (parameters are counted on the meta device).
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils import startup
from model_utils.arguments import REPO_ROOT, DataArgs, TrainConfig, parse_args
from model_utils.errors import ConfigError, first_line

USAGE = """\
usage: dskit doctor [TRAINING FLAGS...]

Check this node for a training run and print a table: check, PASS/WARN/FAIL/SKIP, what was found, the fix.
The flags are the training flags (see `dskit config --help`). The launch context comes from the environment:
GPUS_PER_NODE, CPU_RANKS, CUDA_VERSION, EFA (auto|on|off), SLURM_JOB_NUM_NODES, TORCH_EXTENSIONS_DIR.
Exit status 1 when any check FAILs, 0 otherwise, 2 for bad flags."""

CUDA_ROOT = Path("/usr/local")  # where the launchers look for cuda-$CUDA_VERSION
INFINIBAND_SYSFS = Path("/sys/class/infiniband")  # where the sbatch launcher looks for EFA devices
# Where AWS images (DLAMI, the EFA installer, ParallelCluster) put aws-ofi-nccl, NCCL's network plugin for EFA.
NCCL_PLUGIN_DIRS = (
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/ofi-nccl/lib64",
    "/opt/aws-ofi-nccl/lib",
    "/opt/aws-ofi-nccl/lib64",
    "/opt/amazon/efa/lib",
    "/opt/amazon/efa/lib64",
    "/usr/local/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
)
# bf16/fp16 weights + fp32 master weights + Adam's two fp32 moments, per parameter, in every checkpoint.
CHECKPOINT_BYTES_PER_PARAM = {True: 2 + 12, False: 4 + 12}  # keyed by "half-precision training"
SUBPROCESS_TIMEOUT_S = 20

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


class Status(enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class Result:
    check: str
    status: Status
    found: str
    fix: str = ""


@dataclass(frozen=True)
class LaunchContext:
    """What the launchers tell the doctor through the environment (the same variables the ranks see)."""

    gpus_per_node: int
    cpu_ranks: int
    cuda_version: str
    efa: str
    nodes: int
    extensions_dir: Path | None
    ds_accelerator: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LaunchContext:
        from dskit.render import LaunchValues

        defaults = LaunchValues()

        def count(name: str, default: int) -> int:
            text = env.get(name, "").strip() or str(default)
            if not text.isdigit():
                raise ConfigError(f"{name}={text!r} is not a whole number: set it to e.g. {default}")
            return int(text)

        ext = env.get("TORCH_EXTENSIONS_DIR")
        return cls(
            gpus_per_node=count("GPUS_PER_NODE", defaults.gpus_per_node),
            cpu_ranks=count("CPU_RANKS", defaults.cpu_ranks_per_node),
            cuda_version=env.get("CUDA_VERSION", "").strip() or defaults.cuda_version,
            efa=env.get("EFA", "").strip() or defaults.efa,
            nodes=max(1, count("SLURM_JOB_NUM_NODES", 1)),
            extensions_dir=Path(ext) if ext else None,
            ds_accelerator=env.get("DS_ACCELERATOR"),
        )


@dataclass(frozen=True)
class GpuProbe:
    """The GPUs of this node as nvidia-smi and torch see them."""

    smi_count: int  # GPUs nvidia-smi lists (0 without nvidia-smi)
    torch_count: int  # GPUs torch sees (what the launchers count)
    names: tuple[str, ...]
    driver: str | None
    memory_bytes: int | None  # of the smallest GPU
    smi_error: str | None  # nvidia-smi exists but failed

    @property
    def present(self) -> bool:
        return self.smi_count > 0 or self.torch_count > 0


def _run(cmd: list[str], timeout: float = SUBPROCESS_TIMEOUT_S, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# --- probes -----------------------------------------------------------------------------------------------


def probe_gpus() -> GpuProbe:
    import torch

    torch_count = torch.cuda.device_count()
    names: list[str] = []
    driver: str | None = None
    memory: list[int] = []
    error: str | None = None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            proc = _run(
                [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"]
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            error = f"nvidia-smi did not answer ({first_line(e)})"
        else:
            lines = [line for line in proc.stdout.splitlines() if line.strip()]
            if proc.returncode == 0:
                for line in lines:
                    parts = [part.strip() for part in line.rsplit(",", 2)]
                    if len(parts) != 3:
                        continue
                    name, drv, mib = parts
                    names.append(name)
                    driver = drv
                    if mib.isdigit():
                        memory.append(int(mib) * 2**20)
            elif "no devices were found" not in (proc.stdout + proc.stderr).lower():
                error = first_line(RuntimeError(proc.stdout + proc.stderr)) or f"exit {proc.returncode}"
    if driver is None:  # the kernel module says it too, without nvidia-smi
        try:
            match = re.search(
                r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)",
                Path("/proc/driver/nvidia/version").read_text(),
            )
        except OSError:
            match = None
        driver = match.group(1) if match else None
    if not memory and torch_count:
        memory = [torch.cuda.get_device_properties(i).total_memory for i in range(torch_count)]
    return GpuProbe(len(names), torch_count, tuple(names), driver, min(memory) if memory else None, error)


def ranks_per_node(ctx: LaunchContext, gpus: GpuProbe) -> tuple[int, bool]:
    """(ranks per node, on GPUs?) as the launchers' choose_ranks decides it."""
    if gpus.torch_count > 0 and ctx.gpus_per_node > 0:
        return gpus.torch_count, True
    return ctx.cpu_ranks, False


# --- 1. the uv environment ------------------------------------------------------------------------------


def _uv_command() -> list[str] | None:
    """uv on PATH, else the one the launchers bootstrap with pip (`python3 -m uv`)."""
    if found := shutil.which("uv"):
        return [found]
    python3 = shutil.which("python3")
    if python3:
        try:
            if _run([python3, "-m", "uv", "--version"]).returncode == 0:
                return [python3, "-m", "uv"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def check_uv(project: Path = REPO_ROOT, python_prefix: Path = Path(sys.prefix)) -> Result:
    """`uv sync --frozen --check --offline`: compares the environment with uv.lock, changes nothing, no network."""
    name = "uv environment"
    env_dir = Path(os.environ.get("UV_PROJECT_ENVIRONMENT") or ".venv")
    env_dir = env_dir if env_dir.is_absolute() else project / env_dir
    if not (project / "uv.lock").is_file():
        return Result(name, Status.FAIL, f"no uv.lock in {project}", "restore it: git checkout uv.lock")
    if python_prefix.resolve() != env_dir.resolve():
        return Result(
            name,
            Status.SKIP,
            f"this python ({python_prefix}) is not the project env {env_dir} (a container image?): "
            "nothing to compare with uv.lock",
        )
    uv = _uv_command()
    if uv is None:
        return Result(
            name,
            Status.WARN,
            "uv not found (neither `uv` nor `python3 -m uv`): cannot compare .venv with uv.lock",
            "python3 -m pip install uv (the launchers do this on first use)",
        )
    env = {**os.environ, "UV_NO_PROGRESS": "1"}
    base = [*uv, "sync", "--frozen", "--offline", "--project", str(project)]
    try:
        proc = _run([*base, "--check"], env=env, cwd=project)
        if proc.returncode == 2 and "--check" in proc.stderr:  # a uv older than `sync --check`
            proc = _run([*base, "--dry-run"], env=env, cwd=project)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Result(name, Status.WARN, f"uv sync --check did not finish ({first_line(e)})", "")
    output = proc.stdout + proc.stderr
    changes = [line.strip() for line in output.splitlines() if re.match(r"\s*[-+~] \S", line)]
    in_sync = proc.returncode == 0 and not changes
    if in_sync:
        checked = re.search(r"Checked (\d+) packages?", output)
        count = f" ({checked.group(1)} packages)" if checked else ""
        return Result(name, Status.PASS, f"{env_dir} matches uv.lock{count}")
    if changes or "outdated" in output or "Would " in output:
        listed = ", ".join(changes[:4]) + (f" and {len(changes) - 4} more" if len(changes) > 4 else "")
        missing_env = "Would create" in output
        what = (
            "does not exist"
            if missing_env
            else f"differs from uv.lock: {listed or first_line(RuntimeError(output))}"
        )
        return Result(
            name,
            Status.FAIL,
            f"{env_dir} {what}",
            f"cd {project} && uv sync --frozen (the launchers run it on the batch host before training)",
        )
    return Result(name, Status.WARN, f"uv sync --check failed: {first_line(RuntimeError(output))}", "")


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
    home = root / f"cuda-{ctx.cuda_version}"
    installed = sorted(p.name for p in root.glob("cuda-*") if p.is_dir())
    if not home.is_dir():
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
    if nvcc_version != ctx.cuda_version:
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
    if gpus.torch_count > 0:
        if ctx.gpus_per_node == 0:
            return Result(
                name,
                Status.WARN,
                f"{gpus.torch_count} GPUs{names}, but GPUS_PER_NODE=0: the run uses {ctx.cpu_ranks} CPU ranks",
                "unset GPUS_PER_NODE (or render with --set gpus_per_node=N) to train on the GPUs",
            )
        if gpus.torch_count != ctx.gpus_per_node:
            return Result(
                name,
                Status.WARN,
                f"{gpus.torch_count} GPUs{names}, the launch values say {ctx.gpus_per_node}: "
                f"{gpus.torch_count} ranks per node",
                f"set GPUS_PER_NODE={gpus.torch_count} (or --set gpus_per_node) if this node is as intended",
            )
        return Result(name, Status.PASS, f"{gpus.torch_count} GPUs{names} = GPUS_PER_NODE")
    if ctx.cpu_ranks < 1:
        return Result(
            name,
            Status.FAIL,
            "no GPU and CPU_RANKS=0: nothing to train on",
            "set CPU_RANKS=2 or use GPU nodes",
        )
    cpu_run = f"no GPU: {ctx.cpu_ranks} CPU ranks per node over gloo"
    if ctx.gpus_per_node == 0 or (ctx.ds_accelerator or "").lower() == "cpu":
        why = "GPUS_PER_NODE=0" if ctx.gpus_per_node == 0 else "DS_ACCELERATOR=cpu"
        return Result(name, Status.PASS, f"{cpu_run} ({why})")
    return Result(
        name,
        Status.WARN,
        f"{cpu_run}, though GPUS_PER_NODE={ctx.gpus_per_node}",
        "on a GPU node: check the driver (nvidia-smi); on CPU nodes: GPUS_PER_NODE=0 (--set gpus_per_node=0)",
    )


# --- 5. the network between nodes ----------------------------------------------------------------------


def efa_devices(sysfs: Path = INFINIBAND_SYSFS) -> list[str]:
    """EFA devices as the sbatch launcher finds them: /sys/class/infiniband/*/device/driver -> .../efa."""
    found = []
    for dev in sorted(sysfs.glob("*")):
        driver = dev / "device" / "driver"
        if driver.exists() and driver.resolve().name == "efa":
            found.append(dev.name)
    return found


def nccl_net_plugins() -> list[Path]:
    """libnccl-net*.so (aws-ofi-nccl) where NCCL looks: LD_LIBRARY_PATH, then the usual install dirs."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(NCCL_PLUGIN_DIRS)
    found: list[Path] = []
    for d in dict.fromkeys(dirs):
        found += sorted(Path(d).glob("libnccl-net*.so*"))
    return found


def _fi_info_efa() -> tuple[bool, str]:
    """(libfabric offers the efa provider, what fi_info said)."""
    fi_info = shutil.which("fi_info") or next(
        (p for p in ("/opt/amazon/efa/bin/fi_info",) if os.access(p, os.X_OK)), None
    )
    if fi_info is None:
        return False, "no fi_info (libfabric) on PATH or in /opt/amazon/efa/bin"
    try:
        proc = _run([fi_info, "-p", "efa"])
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"fi_info -p efa did not answer ({first_line(e)})"
    if proc.returncode == 0 and re.search(r"provider:\s*efa", proc.stdout):
        return True, "fi_info -p efa lists the efa provider"
    return (
        False,
        f"fi_info -p efa: {first_line(RuntimeError(proc.stdout + proc.stderr)) or f'exit {proc.returncode}'}",
    )


def check_network(ctx: LaunchContext, uses_gpus: bool, sysfs: Path = INFINIBAND_SYSFS) -> Result:
    name = "network (EFA)"
    if ctx.efa not in ("auto", "on", "off"):
        return Result(name, Status.FAIL, f"EFA={ctx.efa!r}", "set EFA to auto, on or off")
    if ctx.efa == "off":
        return Result(name, Status.SKIP, "EFA=off: NCCL/gloo use TCP sockets")
    if ctx.efa == "auto" and ctx.nodes == 1:
        return Result(name, Status.SKIP, "one node: no traffic between nodes")
    devices = efa_devices(sysfs)
    fi_ok, fi_said = _fi_info_efa()
    plugins = nccl_net_plugins() if uses_gpus else []
    install = (
        "install the AWS EFA software (efa_installer: libfabric, aws-ofi-nccl) and add "
        "/opt/amazon/ofi-nccl/lib to LD_LIBRARY_PATH"
    )
    problems = []
    if not devices:
        problems.append(f"no EFA device (no {sysfs}/*/device/driver -> efa)")
    if not fi_ok:
        problems.append(fi_said)
    if uses_gpus and not plugins:
        problems.append(
            "no NCCL net plugin (libnccl-net*.so, aws-ofi-nccl) on LD_LIBRARY_PATH or in /opt/amazon"
        )
    if not problems:
        plugin = f", NCCL plugin {plugins[0]}" if plugins else ""
        return Result(name, Status.PASS, f"EFA {', '.join(devices)}; {fi_said}{plugin}")
    found = "; ".join(problems)
    if ctx.efa == "on":
        fix = (
            "use EFA-enabled instances (p4d/p5), or EFA=auto / EFA=off to train over TCP sockets"
            if not devices
            else install
        )
        return Result(name, Status.FAIL, f"EFA=on but {found}", fix)
    transport = "NCCL" if uses_gpus else "gloo"
    if not devices:
        return Result(
            name,
            Status.WARN,
            f"{found}: {transport} uses TCP sockets between the {ctx.nodes} nodes",
            "for fast multi-node training use EFA instances (p4d/p5) with the EFA software; EFA=off if there is none",
        )
    return Result(
        name, Status.WARN, f"EFA device {', '.join(devices)}, but {found}: NCCL falls back to TCP", install
    )


# --- 6. checkpoint disk ---------------------------------------------------------------------------------


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def check_disk(cfg: TrainConfig, n_params: int | None, half_precision: bool) -> Result:
    """Free space for `keep_checkpoints` checkpoints plus the one being written (rotation deletes after a save)."""
    name = "checkpoint disk"
    directory = Path(cfg.checkpoint.checkpoint_dir)
    where = _existing_ancestor(directory)
    if not os.access(where, os.W_OK | os.X_OK):
        return Result(
            name,
            Status.FAIL,
            f"{where} is not writable (checkpoint dir {directory})",
            "pass --checkpoint_dir with a writable path on a shared filesystem",
        )
    if n_params is None:
        return Result(name, Status.WARN, "could not count the model's parameters (see 'host RAM')", "")
    per_param = CHECKPOINT_BYTES_PER_PARAM[half_precision]
    per_checkpoint = n_params * per_param
    copies = cfg.checkpoint.keep_checkpoints + 1
    needed = per_checkpoint * copies
    # Tags already there count toward the total: rotation deletes them as new ones arrive.
    from model_utils.checkpoint import is_tag_dir

    existing = sum(_tree_bytes(t) for t in directory.glob("*") if is_tag_dir(t))
    usage = shutil.disk_usage(where)
    available = usage.free + existing
    found = (
        f"{_size(needed)} for {copies} checkpoints ({cfg.checkpoint.keep_checkpoints} kept + 1 being written) "
        f"of {_size(per_checkpoint)} ({n_params / 1e6:,.1f}M params x {per_param} B), "
        f"{_size(usage.free)} free at {where}"
        + (f" + {_size(existing)} in existing checkpoints" if existing else "")
    )
    if needed > available:
        fits = int(available // per_checkpoint) - 1
        lower = f", or --keep_checkpoints {fits}" if fits >= 1 else ""
        return Result(
            name,
            Status.FAIL,
            found,
            f"free {_size(needed - available)} more there, move --checkpoint_dir to a larger filesystem{lower}",
        )
    return Result(name, Status.PASS, found)


# --- 7. the dataset -------------------------------------------------------------------------------------


def _hub_offline() -> bool:
    return any(
        os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _peek_columns(path: Path, builder: str) -> list[str] | None:
    """Column names of a data file from its first record or schema, without loading it; None if unknown."""
    if builder == "text":
        return ["text"]
    if builder == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with path.open("r", encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    if builder == "csv":
        import csv

        return next(csv.reader([first]), [])
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return None  # a pretty-printed JSON document: only a full load can tell
    return list(record) if isinstance(record, dict) else None


def _check_local_dataset(path: Path, data: DataArgs) -> Result:
    from model_utils import concat_dataset

    name = "dataset"
    if not path.exists():
        return Result(
            name,
            Status.FAIL,
            f"dataset path {path} does not exist",
            "check --dataset (or --local_dataset false for a hub name)",
        )
    if not os.access(path, os.R_OK):
        return Result(name, Status.FAIL, f"{path} is not readable", f"fix the permissions of {path}")
    if path.is_dir() and concat_dataset._is_saved_dataset(path):
        import datasets

        try:  # memory-mapped Arrow: opening it reads no rows
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError, FileNotFoundError) as e:
            return Result(
                name, Status.FAIL, f"{path} does not load ({first_line(e)})", "re-save it with save_to_disk"
            )
        if isinstance(loaded, datasets.DatasetDict):
            if data.train_split not in loaded:
                return Result(
                    name,
                    Status.FAIL,
                    f"{path} has no split {data.train_split!r} (splits: {', '.join(loaded)})",
                    "pass --train_split",
                )
            loaded = loaded[data.train_split]
        elif data.train_split != "train":
            return Result(
                name, Status.FAIL, f"{path} is a single split, not {data.train_split!r}", "drop --train_split"
            )
        columns, rows = loaded.column_names, f"{loaded.num_rows:,} rows"
        found = f"save_to_disk dataset {path}: {rows}"
    else:
        if data.train_split != "train":
            return Result(
                name,
                Status.FAIL,
                f"local files {path} form one split, not {data.train_split!r}",
                "drop --train_split",
            )
        try:
            builder, files = concat_dataset._files_builder(path)
        except ConfigError as e:
            return Result(name, Status.FAIL, str(e).split(":")[0], "point --dataset at supported data")
        sizes = [Path(f).stat().st_size for f in files]
        if not any(sizes):
            return Result(
                name, Status.FAIL, f"dataset {path} is empty", "point --dataset at files with documents"
            )
        first = next(Path(f) for f, s in zip(files, sizes, strict=True) if s)
        try:
            columns = _peek_columns(first, builder)
        except (OSError, ValueError) as e:
            return Result(
                name,
                Status.FAIL,
                f"{first} is not readable {builder} ({first_line(e)})",
                "check the file format",
            )
        found = f"{len(files)} {builder} file{'s' if len(files) > 1 else ''} ({_size(sum(sizes))}) in {path}"
        if columns is None:
            return Result(name, Status.PASS, f"{found} (columns known only after loading)")
    if data.text_field not in columns:
        return Result(
            name,
            Status.FAIL,
            f"{found}, no column {data.text_field!r} (columns: {', '.join(columns)})",
            "pass --text_field with the column holding the text",
        )
    return Result(name, Status.PASS, f"{found}, column {data.text_field!r}")


def _check_hub_dataset(data: DataArgs) -> Result:
    name = "dataset"
    repo = data.dataset
    if _hub_offline():
        import datasets
        from huggingface_hub import constants

        caches = [
            Path(constants.HF_HUB_CACHE) / f"datasets--{repo.replace('/', '--')}",
            Path(datasets.config.HF_DATASETS_CACHE) / repo.replace("/", "___"),
        ]
        cached = [str(c) for c in caches if c.exists()]
        if cached:
            return Result(
                name, Status.PASS, f"hub dataset {repo}: offline, found in the local cache {cached[0]}"
            )
        return Result(
            name,
            Status.WARN,
            f"hub dataset {repo}: offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE), and not in the local caches",
            "download it once with network access, unset the offline variables, or pass a local path",
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        info = HfApi().dataset_info(repo, timeout=10)
    except GatedRepoError:
        return Result(
            name,
            Status.FAIL,
            f"hub dataset {repo} is gated",
            "accept its terms on huggingface.co and set HF_TOKEN (or `hf auth login`)",
        )
    except RepositoryNotFoundError:
        return Result(
            name,
            Status.FAIL,
            f"no dataset {repo!r} on the Hugging Face hub (or it is private)",
            "check --dataset (or --local_dataset true for a local path); set HF_TOKEN for a private one",
        )
    except (HfHubHTTPError, OSError, ValueError) as e:
        return Result(
            name,
            Status.WARN,
            f"could not reach the hub for {repo} ({first_line(e)})",
            "check the network (HF_ENDPOINT, proxy), or download it once and pass a local path",
        )
    return Result(name, Status.PASS, f"hub dataset {info.id} exists (not downloaded by the doctor)")


def _check_s3_dataset(uri: str, cache_dir: Path) -> Result:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    from model_utils.s3_tier import describe_error, error_kind, parse_s3_uri

    name = "dataset"
    bucket, prefix = parse_s3_uri(uri)
    mirror = cache_dir / "s3" / bucket / prefix
    cached = f"; a copy from an earlier run is in {mirror}" if mirror.exists() else ""
    config = Config(connect_timeout=5, read_timeout=10, retries={"total_max_attempts": 2})
    client = boto3.session.Session().client("s3", config=config)
    try:
        listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=10)
        count = listing.get("KeyCount", 0)
        if count == 0 and prefix:  # s3://bucket/file.jsonl names one object
            client.head_object(Bucket=bucket, Key=prefix)
            count = 1
    except (BotoCoreError, ClientError) as e:
        kind = error_kind(e)
        if kind == "credentials":
            return Result(
                name,
                Status.FAIL,
                f"no AWS credentials to read {uri}",
                "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or attach an instance role",
            )
        if kind == "not_found":
            return Result(name, Status.FAIL, f"no objects under {uri}", "check the dataset URI")
        if kind == "no_bucket":
            return Result(name, Status.FAIL, f"S3 bucket {bucket} does not exist", "fix the dataset URI")
        if kind == "unreachable":
            return Result(
                name,
                Status.FAIL,
                f"cannot reach S3 for {uri} ({describe_error(e)}){cached}",
                "check the network and AWS_ENDPOINT_URL",
            )
        return Result(
            name, Status.FAIL, f"no access to {uri} ({describe_error(e)})", "check the credentials/role"
        )
    more = "+" if count >= 10 else ""
    return Result(name, Status.PASS, f"{uri}: {count}{more} objects readable{cached}")


def check_dataset(data: DataArgs) -> Result:
    from model_utils.assets import CORPUS_PATH
    from model_utils.concat_dataset import EMBEDDED

    name = data.dataset
    if name == EMBEDDED:
        if not CORPUS_PATH.is_file():
            return Result(
                "dataset", Status.FAIL, f"embedded corpus {CORPUS_PATH} is missing", "git checkout it"
            )
        return Result("dataset", Status.PASS, f"embedded corpus ({_size(CORPUS_PATH.stat().st_size)})")
    if name.startswith("s3://"):
        return _check_s3_dataset(name, Path(data.data_cache_dir))
    from model_utils.concat_dataset import is_local_dataset

    path = Path(name).expanduser()
    return _check_local_dataset(path, data) if is_local_dataset(data) else _check_hub_dataset(data)


# --- 8. DeepSpeed's ops ---------------------------------------------------------------------------------


def _extensions_root(ctx: LaunchContext) -> Path:
    """TORCH_EXTENSIONS_DIR, else torch's default per-python/CUDA directory."""
    if ctx.extensions_dir is not None:
        return ctx.extensions_dir
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accel}"


def check_ops(ctx: LaunchContext, uses_gpus: bool) -> Result:
    """The ops training JIT-builds: CPUAdam (offloaded optimizer), FusedAdam on GPUs, the shm comm op on CPUs."""
    startup.import_deepspeed()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    name = "DeepSpeed ops"
    accelerator = get_accelerator()
    wanted = ["CPUAdamBuilder", "FusedAdamBuilder" if uses_gpus else "ShareMemCommBuilder"]
    root = _extensions_root(ctx)
    built, to_build, incompatible = [], [], []
    for class_name in wanted:
        builder = accelerator.create_op_builder(class_name)
        if builder is None or type(builder).__name__ == "NotImplementedBuilder":
            continue
        op = builder.name
        if installed_ops.get(op) or any((root / op).glob(f"{op}*.so")):
            built.append(op)
            continue
        try:
            compatible = builder.is_compatible(verbose=False)
            reason = getattr(builder, "error_log", None) or "is_compatible() is False"
        # Builders probe compilers and CUDA in many ways: any exception means "cannot build here".
        except Exception as e:
            compatible, reason = False, first_line(e)
        if compatible:
            to_build.append(op)
        else:
            incompatible.append(f"{op} ({reason})")
    have = f"built in {root}: {', '.join(built)}" if built else f"none built yet in {root}"
    if incompatible:
        return Result(
            name,
            Status.FAIL,
            f"{have}; cannot build {', '.join(incompatible)}",
            "install what the op needs (a C++ compiler; for GPU ops the CUDA toolkit), see `ds_report`",
        )
    if not to_build:
        return Result(name, Status.PASS, have)
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    missing = [] if is_ninja_available() else ["ninja"]
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler})")
    if "fused_adam" in to_build:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or not os.access(Path(CUDA_HOME) / "bin" / "nvcc", os.X_OK):
            missing.append(f"nvcc (CUDA_HOME={CUDA_HOME})")
    if missing:
        return Result(
            name,
            Status.FAIL,
            f"{have}; {', '.join(to_build)} must be built, but {', '.join(missing)} not found",
            "install them (e.g. apt-get install ninja-build g++; the CUDA toolkit for nvcc), or build the ops "
            f"once on a node that has them: they are kept in {root}",
        )
    return Result(
        name,
        Status.PASS,
        f"{have}; {', '.join(to_build)} will be built on first use (a few minutes; ninja and {compiler} found)",
    )


# --- 9. memory ------------------------------------------------------------------------------------------


def check_memory(settings: Any, ctx: LaunchContext, gpus: GpuProbe) -> tuple[Result, Result]:
    """(host RAM, GPU memory): the estimate for this config against this node."""
    import psutil

    from dskit.estimate import estimate_for_config

    ranks, on_gpus = ranks_per_node(ctx, gpus)
    estimate = estimate_for_config(settings, nodes=ctx.nodes, ranks_per_node=ranks, on_gpus=on_gpus)
    vm = psutil.virtual_memory()
    need = estimate.host_bytes_per_node
    found = (
        f"needs ~{_size(need)} per node ({ctx.nodes} node{'s' if ctx.nodes > 1 else ''} x {ranks} ranks), "
        f"{_size(vm.total)} total, {_size(vm.available)} available"
    )
    fix = (
        "more nodes (ZeRO shards the offloaded optimizer), a smaller --micro_batch_size or fewer CPU_RANKS, "
        "or nodes with more RAM; `dskit estimate` suggests a config that fits"
    )
    if need > vm.total:
        host = Result("host RAM", Status.FAIL, found, fix)
    elif need > vm.available:
        host = Result(
            "host RAM", Status.WARN, found + ": other processes hold the rest", "stop them, or " + fix
        )
    else:
        host = Result("host RAM", Status.PASS, found)
    if not on_gpus:
        return host, Result("GPU memory", Status.SKIP, "CPU ranks")
    per_rank = estimate.device_bytes_per_rank
    if gpus.memory_bytes is None:
        return host, Result("GPU memory", Status.WARN, f"needs ~{_size(per_rank)} per GPU; size unknown", "")
    found = f"needs ~{_size(per_rank)} per GPU, {_size(gpus.memory_bytes)} each"
    fix = (
        "ZeRO-3 (--deepspeed_config deepspeed/ds_config_zero3.json), a smaller --micro_batch_size or "
        "--seq_length; `dskit estimate` suggests a config that fits"
    )
    if per_rank > gpus.memory_bytes:
        return host, Result("GPU memory", Status.FAIL, found, fix)
    if per_rank > 0.9 * gpus.memory_bytes:
        return host, Result("GPU memory", Status.WARN, found + ": under 10% headroom", fix)
    return host, Result("GPU memory", Status.PASS, found)


# --- running and reporting ------------------------------------------------------------------------------


def _guarded(name: str, fn: Callable[[], Result]) -> Result:
    """A crash inside one check is the doctor's bug, not the node's: report it and let the launch go on."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as e:
        return Result(name, Status.WARN, f"the check itself failed: {type(e).__name__}: {first_line(e)}", "")


def run_checks(cfg: TrainConfig, ctx: LaunchContext) -> list[Result]:
    import torch

    from model_utils import deepspeed_config, models, preflight

    gpus = probe_gpus()
    _, on_gpus = ranks_per_node(ctx, gpus)
    settings: preflight.RunSettings | None = None
    model_error = ""
    try:  # a hub model needs the network or the HF cache: `dskit prepare` reports that in full
        settings = preflight.resolve_settings(cfg)  # a misspelt --model or a bad DeepSpeed config: exit 2
        half = settings.deepspeed.half_precision
    except models.ModelUnavailable as e:
        model_error = str(e)
        half = deepspeed_config.resolve(cfg).half_precision
    n_params: int | None = None
    if settings is not None:
        try:
            from dskit.estimate import model_shape

            # Counted as `dskit estimate` counts them (meta device, tied parameters once).
            source = settings.source
            n_params = model_shape(settings.model_config, source.name, source.preset is not None).total_params
        except Exception as e:  # an architecture transformers cannot build: prepare reports it properly
            model_error = f"{type(e).__name__}: {first_line(e)}"

    results = [
        _guarded("uv environment", check_uv),
        _guarded("torch CUDA vs driver", lambda: check_driver(gpus, torch.version.cuda, torch.__version__)),
        _guarded("CUDA toolkit", lambda: check_toolkit(ctx, gpus, torch.version.cuda)),
        _guarded("GPUs", lambda: check_gpus(ctx, gpus)),
        _guarded("network (EFA)", lambda: check_network(ctx, on_gpus)),
        _guarded("checkpoint disk", lambda: check_disk(cfg, n_params, half)),
        _guarded("dataset", lambda: check_dataset(cfg.data)),
        _guarded("DeepSpeed ops", lambda: check_ops(ctx, on_gpus)),
    ]
    if settings is None:
        results.append(
            Result(
                "host RAM", Status.WARN, f"no estimate: {model_error}", "`dskit prepare` reports the details"
            )
        )
    else:
        try:
            results += check_memory(settings, ctx, gpus)
        except ConfigError:
            raise
        except Exception as e:
            results.append(
                Result("host RAM", Status.WARN, f"no estimate: {type(e).__name__}: {first_line(e)}", "")
            )
    return results


def format_table(results: list[Result], width: int = 120) -> str:
    check_w = max(len("check"), *(len(r.check) for r in results))
    status_w = 6
    text_w = max(30, (width - check_w - status_w - 6) // 2)
    head = f"{'check':<{check_w}}  {'status':<{status_w}}  {'found':<{text_w}}  fix"
    lines = [head, f"{'-' * check_w}  {'-' * status_w}  {'-' * text_w}  {'-' * text_w}"]
    for r in results:
        found = textwrap.wrap(r.found, text_w) or [""]
        fix = textwrap.wrap(r.fix, text_w) or [""]
        for i in range(max(len(found), len(fix))):
            left = r.check if i == 0 else ""
            status = r.status.value if i == 0 else ""
            f1 = found[i] if i < len(found) else ""
            f2 = fix[i] if i < len(fix) else ""
            lines.append(f"{left:<{check_w}}  {status:<{status_w}}  {f1:<{text_w}}  {f2}".rstrip())
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    counts = {s: sum(r.status is s for r in results) for s in Status}
    text = ", ".join(f"{n} {s.value}" for s, n in counts.items())
    failed = [r.check for r in results if r.status is Status.FAIL]
    if failed:
        return f"doctor: {text}: fix {', '.join(failed)} before training (see the fix column)"
    return f"doctor: {text}: ready" + (" (see the WARN rows)" if counts[Status.WARN] else "")


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    ctx = LaunchContext.from_env(os.environ)
    cfg = parse_args(argv)
    results = run_checks(cfg, ctx)
    print(
        f"dskit doctor on {socket.gethostname()} ({ctx.nodes} node{'s' if ctx.nodes > 1 else ''}):",
        flush=True,
    )
    print(format_table(results))
    print(summary(results), flush=True)
    return 1 if any(r.status is Status.FAIL for r in results) else 0
