"""What every check reads: the launch context (the launchers' environment variables), this node's GPUs as
nvidia-smi and torch see them, the ranks per node the launchers would start, and the small helpers the checks
share (a subprocess runner with a timeout, version tuples, human-readable sizes).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils import repo
from model_utils.errors import ConfigError, first_line

SUBPROCESS_TIMEOUT_S = 20


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
    launcher_gpus: int | None = (
        None  # the GPUs the launcher counted here (DSKIT_NODE_GPUS): its ranks per node
    )

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
            extensions_dir=Path(ext) if ext else repo.EXTENSIONS_DIR,  # where a rank would build them
            ds_accelerator=env.get("DS_ACCELERATOR"),
            launcher_gpus=count("DSKIT_NODE_GPUS", 0) if env.get("DSKIT_NODE_GPUS") else None,
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
    """(ranks per node, on GPUs?) as dskit/launcher/node.py's choose decides it."""
    if gpus.torch_count > 0 and ctx.gpus_per_node > 0:
        return gpus.torch_count, True
    return ctx.cpu_ranks, False
