"""--health_gate: before the first step, every node of the job checks itself and the ranks time one all-reduce.

A node with a GPU that fell off the bus, an Xid error in its kernel log, a missing EFA device or a slow link
would otherwise cost hours: a run that crashes later, or one that trains at a fraction of its speed. The gate runs
on the ranks, inside the allocation, once the process group is up and before anything else is loaded:

- each node's local rank 0 probes the node: the GPU count and health (`nvidia-smi`; `dcgmi diag -r 1` where DCGM
  is installed; node-level Xid errors in the kernel log, `dmesg`), and the EFA devices where the launcher chose
  EFA (FI_PROVIDER=efa) against the instance type's count;
- every rank joins one all-reduce, timed as nccl-tests time theirs (bus bandwidth: the bytes each rank sends and
  receives, 2(n-1)/n of the buffer, over the slowest rank's time), compared with the instance type's floor in
  THRESHOLDS (or --health_min_busbw); on CPU ranks a gloo all-reduce against CPU_FLOOR_GBPS, with the rank
  count per host: the subset CI runs.

A failing node is named in one `error: health gate:` line (rank 0 prints one per node), its host goes to the
launcher's hosts file (DSKIT_HANG_HOSTS_FILE, `launch_env.name_bad_hosts`) and every rank raises NodeUnhealthy,
which the entry point ends with the watchdog's status 75: train.sbatch requeues the job without the hosts named
there, as after a hang (one owner of that logic: docs/hangs.md). A slow all-reduce across several nodes names no
host (a ring is as slow as its slowest link, which one all-reduce cannot tell); the job then ends with 75 and the
line, and train.sbatch does not requeue it.

The probes parse their commands' output (parse_*), so the tests hold them to recorded outputs of real nodes;
a probe whose command is missing or not allowed (no nvidia-smi, dmesg restricted) adds a note, never a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from model_utils import launch_env
from model_utils.errors import NodeUnhealthy, first_line
from model_utils.observe import ledger_file

if TYPE_CHECKING:  # torch is imported where the gate runs: `dskit doctor` reads the table without it
    import torch

# When the floors below were set: about half of the nccl-tests all_reduce_perf bus bandwidths (256 MiB, the gate's
# CUDA buffer) commonly reported for each type, so a busy node passes and a broken link (a lane down, TCP instead
# of EFA) does not. Written from those reports, not measured on the instances (docs/hangs.md).
THRESHOLDS_DATE = "2026-11-26"


@dataclass(frozen=True)
class Floor:
    gpus: int  # GPUs the type has
    efa_devices: int  # its EFA devices (0: none)
    node_busbw: float  # GB/s, an all-reduce over one node's GPUs (NVLink or PCIe)
    job_busbw: float  # GB/s, over several nodes (EFA)


THRESHOLDS: dict[str, Floor] = {
    "p4d.24xlarge": Floor(gpus=8, efa_devices=4, node_busbw=100.0, job_busbw=20.0),
    "p4de.24xlarge": Floor(gpus=8, efa_devices=4, node_busbw=100.0, job_busbw=20.0),
    "p5.48xlarge": Floor(gpus=8, efa_devices=32, node_busbw=200.0, job_busbw=80.0),
    "p5e.48xlarge": Floor(gpus=8, efa_devices=32, node_busbw=200.0, job_busbw=80.0),
    "p5en.48xlarge": Floor(gpus=8, efa_devices=16, node_busbw=200.0, job_busbw=100.0),
    "g5.48xlarge": Floor(gpus=8, efa_devices=1, node_busbw=5.0, job_busbw=3.0),
    "g6e.48xlarge": Floor(gpus=8, efa_devices=4, node_busbw=10.0, job_busbw=10.0),
}
# gloo between CPU ranks (loopback on one host, TCP between hosts): a rank this slow is starved or broken. A
# loaded 2-core CI machine reaches ~0.3-1 GB/s.
CPU_FLOOR_GBPS = 0.02
BUFFER_BYTES = {"cuda": 256 << 20, "cpu": 8 << 20}
TIMED_ALL_REDUCES = 5  # after one untimed (connections, NCCL's channels)
PROBE_TIMEOUT_S = 120  # dcgmi diag -r 1 takes ~10-30 s

# Xid errors of the node, not of the program (NVIDIA's Xid catalog): double-bit ECC (48), micro-controller halt
# (62), ECC page retirement or row remapping (63, 64), NVLink (74), fallen off the bus (79), high single-bit ECC
# rate (92), contained and uncontained ECC (94, 95), GSP (119, 120), unrecovered ECC (140). An application's own
# faults (13, 31, 43, 45) say nothing about the node.
NODE_XIDS = {48: "double-bit ECC", 62: "micro-controller halt", 63: "ECC page retirement", 64: "row remap failure",
             74: "NVLink error", 79: "fell off the bus", 92: "high single-bit ECC rate", 94: "contained ECC error",
             95: "uncontained ECC error", 119: "GSP timeout", 120: "GSP error", 140: "unrecovered ECC error"}  # fmt: skip
NVIDIA_SMI_QUERY = [
    "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total",
    "--format=csv,noheader",
]
INFINIBAND_SYSFS = Path("/sys/class/infiniband")  # where dskit/launcher/node.py looks (efa_devices)


@dataclass
class NodeCheck:
    """What one node's probes found: problems fail the gate, notes only say what was not checked."""

    host: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --- the probes' parsers (recorded outputs in the tests) ---


def parse_nvidia_smi(returncode: int, output: str, expected: int) -> list[str]:
    """Problems in `nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total` output."""
    if returncode != 0:
        return [f"nvidia-smi failed (exit {returncode}): {first_line(RuntimeError(output)) or 'no output'}"]
    problems = []
    rows = [[cell.strip() for cell in line.split(",")] for line in output.splitlines() if line.strip()]
    if len(rows) < expected:
        problems.append(f"{len(rows)} GPUs visible, {expected} expected")
    for row in rows:
        if len(row) >= 3 and row[2].isdigit() and int(row[2]) > 0:
            problems.append(f"GPU {row[0]} ({row[1]}): {row[2]} uncorrected ECC errors")
    return problems


def parse_dcgmi_diag(returncode: int, output: str) -> tuple[list[str], list[str]]:
    """(problems, notes) of `dcgmi diag -r 1`: each test it reports as Fail; a diag that did not run is a note."""
    failed = re.findall(r"^\|\s*([^|]*?)\s*\|\s*Fail\b", output, flags=re.M)
    if failed:
        return [f"dcgmi diag: {', '.join(failed)} failed"], []
    if returncode != 0:
        return [], [f"dcgmi diag did not run ({first_line(RuntimeError(output)) or f'exit {returncode}'})"]
    return [], []


def parse_xids(kernel_log: str) -> list[str]:
    """Node-level Xid errors in the kernel log (`NVRM: Xid (PCI:0000:10:1c): 79, pid=...`), one per GPU and Xid."""
    seen: dict[tuple[str, int], None] = {}
    for pci, xid in re.findall(r"NVRM: Xid \(PCI:([^)]+)\): (\d+)", kernel_log):
        if int(xid) in NODE_XIDS:
            seen[(pci, int(xid))] = None
    return [f"Xid {xid} ({NODE_XIDS[xid]}) on GPU {pci}" for pci, xid in seen]


def efa_devices(sysfs: Path = INFINIBAND_SYSFS) -> list[str]:
    """EFA devices as train.sbatch finds them: /sys/class/infiniband/*/device/driver -> .../efa."""
    found = []
    for dev in sorted(sysfs.glob("*")):
        driver = dev / "device" / "driver"
        if driver.exists() and driver.resolve().name == "efa":
            found.append(dev.name)
    return found


def check_efa(found: list[str], expected: int) -> list[str]:
    if len(found) < max(expected, 1):
        return [f"{len(found)} EFA devices, {max(expected, 1)} expected (FI_PROVIDER=efa)"]
    return []


# --- the node's probes ---

Runner = Callable[[list[str]], tuple[int, str] | None]


def run_command(argv: list[str]) -> tuple[int, str] | None:
    """(exit status, stdout and stderr) of a probe command; None when it is not installed."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, *argv[1:]], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]} did not answer in {PROBE_TIMEOUT_S} s"
    except OSError as e:
        return 126, str(e)
    return proc.returncode, proc.stdout + proc.stderr


def check_node(
    device_type: str,
    local_ranks: int,
    floor: Floor | None,
    run: Runner = run_command,
    sysfs: Path = INFINIBAND_SYSFS,
) -> NodeCheck:
    """This node's probes (run by its local rank 0)."""
    node = NodeCheck(socket.gethostname())
    if device_type == "cuda":
        expected = max(local_ranks, floor.gpus if floor else 0)
        smi = run(["nvidia-smi", *NVIDIA_SMI_QUERY])
        if smi is None:
            node.problems.append("no nvidia-smi on a GPU node (the driver is not installed)")
        else:
            node.problems += parse_nvidia_smi(*smi, expected)
        if (diag := run(["dcgmi", "diag", "-r", "1"])) is not None:
            problems, notes = parse_dcgmi_diag(*diag)
            node.problems += problems
            node.notes += notes
        kernel_log = run(["dmesg"])
        if kernel_log is None or kernel_log[0] != 0:
            node.notes.append("kernel log not readable (dmesg): Xid errors not checked")
        else:
            node.problems += parse_xids(kernel_log[1])
    if (
        os.environ.get("FI_PROVIDER") == "efa"
    ):  # the launcher found EFA on the first node: every node needs it
        node.problems += check_efa(efa_devices(sysfs), floor.efa_devices if floor else 1)
    return node


# --- the job's all-reduce ---


def bus_bandwidth_gbps(nbytes: int, ranks: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: each rank sends and receives 2(n-1)/n of the buffer."""
    return nbytes * 2 * (ranks - 1) / ranks / seconds / 1e9


def time_all_reduce(device: torch.device, nbytes: int, world_size: int) -> float:
    """Bus bandwidth in GB/s of TIMED_ALL_REDUCES all-reduces of `nbytes`, by the slowest rank's time."""
    import torch

    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    torch.distributed.all_reduce(buffer)  # untimed: connections and buffers are set up on the first
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    torch.distributed.barrier()
    started = time.perf_counter()
    for _ in range(TIMED_ALL_REDUCES):
        torch.distributed.all_reduce(buffer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mean_s = (time.perf_counter() - started) / TIMED_ALL_REDUCES
    slowest = torch.tensor([mean_s], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    return bus_bandwidth_gbps(nbytes, world_size, float(slowest.item()))


def busbw_floor(
    device_type: str, instance: str | None, nodes: int, override: float | None
) -> tuple[float | None, str]:
    """(the floor in GB/s, where it comes from); None: no floor known (the bandwidth is reported, not judged)."""
    if override is not None:
        return (override or None), "--health_min_busbw"
    if device_type == "cpu":
        return CPU_FLOOR_GBPS, "cpu"
    floor = THRESHOLDS.get(instance or "")
    if floor is None:
        return None, f"no floor for {instance or 'an unknown instance type'}: set --health_min_busbw"
    return (floor.node_busbw if nodes == 1 else floor.job_busbw), f"{instance}, {THRESHOLDS_DATE}"


# --- the gate ---


@dataclass(frozen=True)
class Verdict:
    nodes: list[NodeCheck]  # every host's, by host
    busbw: float | None  # GB/s (None: one rank)
    floor: float | None
    floor_source: str
    seconds: float  # the slowest node's gate time

    def failing(self) -> list[NodeCheck]:
        return [node for node in self.nodes if node.problems]

    def job_problem(self) -> str | None:
        """A slow all-reduce across several hosts: no host to name."""
        if self.busbw is None or self.floor is None or self.busbw >= self.floor or len(self.nodes) == 1:
            return None
        return (
            f"the all-reduce across {len(self.nodes)} nodes reached {self.busbw:.3g} GB/s bus bandwidth, below "
            f"the floor of {self.floor:g} GB/s ({self.floor_source}); one all-reduce cannot tell which link is slow"
        )


def judge(
    nodes: list[NodeCheck], busbw: float | None, floor: float | None, floor_source: str, seconds: float
) -> Verdict:
    """The verdict over every node's probes and the job's bandwidth; one host's slow all-reduce is that host's."""
    if busbw is not None and floor is not None and busbw < floor and len(nodes) == 1:
        nodes[0].problems.append(
            f"all-reduce bus bandwidth {busbw:.3g} GB/s, below the floor of {floor:g} GB/s ({floor_source})"
        )
    return Verdict(nodes, busbw, floor, floor_source, seconds)


def node_line(node: NodeCheck) -> str:
    return f"health gate: node {node.host} failed: {'; '.join(node.problems)} (exit status 75: requeue without it)"


def summary_line(verdict: Verdict, ranks: int, device_type: str) -> str:
    hosts = len(verdict.nodes)
    bandwidth = (
        "one rank: no all-reduce"
        if verdict.busbw is None
        else f"all-reduce {verdict.busbw:.3g} GB/s bus bandwidth"
        + (
            f" (floor {verdict.floor:g} GB/s, {verdict.floor_source})"
            if verdict.floor
            else f" ({verdict.floor_source})"
        )
    )
    notes = sorted({note for node in verdict.nodes for note in node.notes})
    return (
        f"Health gate: {ranks} {device_type} rank{'s' if ranks != 1 else ''} on {hosts} node{'s' if hosts != 1 else ''} "
        f"passed in {verdict.seconds:.2f} s per node: {bandwidth}"
        + (f"; {'; '.join(notes)}" if notes else "")
    )


def run_gate(
    rank: int,
    world_size: int,
    device: torch.device,
    min_busbw: float | None,
    say: Callable[[str], None],
    report_error: Callable[[str], None],
    run: Runner = run_command,
) -> Verdict:
    """The gate on every rank (a collective: every rank calls it). Says the summary line (rank 0), or names each
    failing node, names their hosts to the launcher and raises NodeUnhealthy."""
    started = time.perf_counter()
    host = socket.gethostname()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # What the launcher started on this host (torchrun's; another launcher may not say: then not compared).
    started_here = os.environ.get("LOCAL_WORLD_SIZE")
    local_ranks = int(started_here) if started_here else None
    instance = ledger_file.instance_type()
    floor_row = THRESHOLDS.get(instance or "")
    node = check_node(device.type, local_ranks or 1, floor_row, run) if local_rank == 0 else None
    busbw = time_all_reduce(device, BUFFER_BYTES[device.type], world_size) if world_size > 1 else None
    # A node is a launcher's group of ranks (torchrun's GROUP_RANK), on its host: two nodes may share one host
    # (a test's two SageMaker instances on one machine), whose names are the same.
    where = (host, os.environ.get("GROUP_RANK", "0"))
    mine = (where, local_ranks, node, time.perf_counter() - started)
    gathered: list[tuple[tuple[str, str], int | None, NodeCheck | None, float]] = [mine]
    if world_size > 1:
        import torch

        gathered = [mine] * world_size
        torch.distributed.all_gather_object(gathered, mine)
    nodes: dict[tuple[str, str], NodeCheck] = {}
    ranks_on: dict[tuple[str, str], int] = {}
    expected_on: dict[tuple[str, str], int | None] = {}
    for w, expected, checked, _ in gathered:
        ranks_on[w] = ranks_on.get(w, 0) + 1
        expected_on[w] = expected
        nodes.setdefault(w, NodeCheck(w[0]))
        if checked is not None:
            nodes[w] = checked
    for w, count in ranks_on.items():  # the CPU subset's node check: every rank the launcher started is here
        if expected_on[w] is not None and count != expected_on[w]:
            nodes[w].problems.append(f"{count} ranks joined, {expected_on[w]} started (LOCAL_WORLD_SIZE)")
    floor, source = busbw_floor(device.type, instance, len(nodes), min_busbw)
    seconds = max(s for *_, s in gathered)
    verdict = judge([nodes[w] for w in sorted(nodes)], busbw, floor, source, seconds)
    failing = verdict.failing()
    job_problem = verdict.job_problem()
    if not failing and job_problem is None:
        if rank == 0:
            say(summary_line(verdict, world_size, device.type))
        return verdict
    lines = [node_line(n) for n in failing] + ([f"health gate: {job_problem}"] if job_problem else [])
    report_error(lines[0])  # rank 0's log, and each host's error file (the launcher's last line)
    if rank == 0:
        for line in lines[1:]:
            say(f"error: {line}")
        launch_env.name_bad_hosts([n.host for n in failing], "failed the health gate")
    if world_size > 1:
        import torch

        # No rank leaves before rank 0 has said it and named the hosts: torchrun ends the others (SIGTERM) once the
        # first rank exits, which could cut rank 0's report. The group works: the verdict came through it.
        torch.distributed.barrier()
    raise NodeUnhealthy(lines[0])
