"""The network between nodes: EFA devices in sysfs, libfabric's efa provider (fi_info) and NCCL's net plugin
(aws-ofi-nccl), checked as the EFA setting (auto|on|off) and the node count ask.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from model_utils.config.arguments import TrainConfig
from model_utils.errors import first_line
from model_utils.launch.health_gate import INFINIBAND_SYSFS, efa_devices  # the ranks' gate looks there too

from .context import LaunchContext, _run
from .report import Result, Status

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


def check_health_gate(cfg: TrainConfig, ctx: LaunchContext, uses_gpus: bool, instance: str | None) -> Result:
    """The health gate's floors for this launch (launch/health_gate.py): what the ranks will hold each node to."""
    from model_utils.launch import health_gate

    name = "health gate"
    if cfg.loop.health_gate == "off":
        return Result(name, Status.SKIP, "--health_gate off: no node checks before the first step")
    device = "cuda" if uses_gpus else "cpu"
    floor, source = health_gate.busbw_floor(device, instance, ctx.nodes, cfg.loop.health_min_busbw)
    row = health_gate.THRESHOLDS.get(instance or "")
    expects = (
        f"{row.gpus} GPUs, {row.efa_devices} EFA devices where EFA is used; "
        if uses_gpus and row is not None
        else ""
    )
    if floor is None and source != "--health_min_busbw":
        known = ", ".join(health_gate.THRESHOLDS)
        return Result(
            name,
            Status.WARN,
            f"{source}: the all-reduce is measured, not judged (the table of {health_gate.THRESHOLDS_DATE} has {known})",
            "set --health_min_busbw GB/s (about half of this type's nccl-tests all_reduce_perf bus bandwidth)",
        )
    judged = "measured, not judged" if floor is None else f">= {floor:g} GB/s"
    return Result(
        name, Status.PASS, f"{expects}all-reduce bus bandwidth {judged} over {ctx.nodes} node(s) ({source})"
    )
