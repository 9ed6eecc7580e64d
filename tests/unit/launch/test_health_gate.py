"""The node health gate (launch/health_gate.py): its GPU, DCGM, Xid and EFA probes over recorded outputs of real
nodes (no GPU here: the probes' parsers are what runs on one), the floors, and the CPU subset for real on 2 gloo
ranks: a pass with its one line, a failing node named with its host written for train.sbatch, and a rank count
that does not match the launcher's."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_utils import launch_env
from model_utils.errors import NodeUnhealthy
from model_utils.launch import health_gate

# Recorded: `nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total --format=csv,noheader`
SMI_HEALTHY = "".join(f"{i}, 00000000:{16 * (i + 1):02X}:1C.0, 0\n" for i in range(8))
SMI_ECC = SMI_HEALTHY.replace("00000000:30:1C.0, 0", "00000000:30:1C.0, 3")
SMI_FELL_OFF = "Unable to determine the device handle for GPU0000:10:1C.0: Unknown Error\n"
SMI_NO_ECC = "0, 00000000:01:00.0, [N/A]\n"  # a GPU without ECC reporting (A10G with ECC off)
# Recorded: `dcgmi diag -r 1`
DCGMI_FAIL = """\
Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Metadata  ----------+------------------------------------------------|
| DCGM Version              | 3.3.5                                          |
|-----  Deployment  --------+------------------------------------------------|
| Denylist                  | Pass                                           |
| NVML Library              | Pass                                           |
| Permissions and OS Blocks | Pass                                           |
| Page Retirement/Row Remap | Fail                                           |
| Warning                   | GPU 3 Row remap failure                        |
| Environment Variables     | Pass                                           |
+---------------------------+------------------------------------------------+
"""
DCGMI_PASS = DCGMI_FAIL.replace("| Fail ", "| Pass ").replace(
    "| Warning                   | GPU 3 Row remap failure", ""
)
DCGMI_NO_ENGINE = (
    "Error: unable to establish a connection to the specified host: localhost\n"
    "Error: Unable to connect to host engine. Host engine connection invalid/disconnected.\n"
)
# Recorded: `dmesg` of a p4d node
DMESG = """\
[  812.104233] NVRM: GPU at PCI:0000:10:1c: GPU-5c2f...
[ 9021.553811] NVRM: Xid (PCI:0000:20:1c): 13, pid=41213, name=python, Graphics SM Warp Exception on (GPC 0, TPC 1)
[ 9122.001245] NVRM: Xid (PCI:0000:10:1c): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
[ 9122.001301] NVRM: Xid (PCI:0000:10:1c): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
[ 9130.000001] NVRM: Xid (PCI:0000:a0:1c): 94, pid=41213, name=python, Ch 00000008
"""


def test_nvidia_smi_counts_the_gpus_and_names_uncorrected_ecc_and_a_failed_query() -> None:
    assert health_gate.parse_nvidia_smi(0, SMI_HEALTHY, 8) == []
    assert health_gate.parse_nvidia_smi(0, SMI_NO_ECC, 1) == []
    assert health_gate.parse_nvidia_smi(0, SMI_ECC, 8) == [
        "GPU 2 (00000000:30:1C.0): 3 uncorrected ECC errors"
    ]
    seven = "".join(SMI_HEALTHY.splitlines(keepends=True)[:7])
    assert health_gate.parse_nvidia_smi(0, seven, 8) == ["7 GPUs visible, 8 expected"]
    assert health_gate.parse_nvidia_smi(255, SMI_FELL_OFF, 8) == [
        "nvidia-smi failed (exit 255): Unable to determine the device handle for GPU0000:10:1C.0: Unknown Error"
    ]


def test_dcgmi_diag_fails_on_a_failed_test_and_notes_a_diag_that_could_not_run() -> None:
    assert health_gate.parse_dcgmi_diag(226, DCGMI_FAIL) == (
        ["dcgmi diag: Page Retirement/Row Remap failed"],
        [],
    )
    assert health_gate.parse_dcgmi_diag(0, DCGMI_PASS) == ([], [])
    problems, notes = health_gate.parse_dcgmi_diag(255, DCGMI_NO_ENGINE)
    assert problems == [] and notes == [
        "dcgmi diag did not run (Error: unable to establish a connection to the specified host: localhost)"
    ]


def test_only_the_nodes_own_xids_fail_it_once_per_gpu() -> None:
    """An application's Xid 13 says nothing about the node; 79 twice on one GPU is one problem."""
    assert health_gate.parse_xids(DMESG) == [
        "Xid 79 (fell off the bus) on GPU 0000:10:1c",
        "Xid 94 (contained ECC error) on GPU 0000:a0:1c",
    ]
    assert health_gate.parse_xids("[ 1.0] Linux version 6.8\n") == []


def fake_sysfs(root: Path, devices: dict[str, str]) -> Path:
    """/sys/class/infiniband as a node has it: each device's driver a link to the driver's directory."""
    for name, driver in devices.items():
        (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (root / "ib" / name / "device").mkdir(parents=True)
        (root / "ib" / name / "device" / "driver").symlink_to(root / "drivers" / driver)
    (root / "ib").mkdir(exist_ok=True)
    return root / "ib"


def test_a_gpu_node_is_probed_by_its_commands_and_efa_where_the_launcher_chose_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = {"nvidia-smi": (0, SMI_HEALTHY), "dcgmi": (226, DCGMI_FAIL), "dmesg": (0, DMESG)}
    asked: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str] | None:
        asked.append(argv)
        return outputs.get(argv[0])

    p4d = health_gate.THRESHOLDS["p4d.24xlarge"]
    sysfs = fake_sysfs(tmp_path, {"rdmap16s27": "efa", "rdmap32s27": "efa", "mlx5_0": "mlx5_core"})
    monkeypatch.setenv("FI_PROVIDER", "efa")
    node = health_gate.check_node("cuda", 8, p4d, run, sysfs)
    assert node.problems == [
        "dcgmi diag: Page Retirement/Row Remap failed",
        "Xid 79 (fell off the bus) on GPU 0000:10:1c",
        "Xid 94 (contained ECC error) on GPU 0000:a0:1c",
        "2 EFA devices, 4 expected (FI_PROVIDER=efa)",
    ]
    assert asked[0] == ["nvidia-smi", *health_gate.NVIDIA_SMI_QUERY] and asked[1] == [
        "dcgmi",
        "diag",
        "-r",
        "1",
    ]
    # No DCGM installed, dmesg restricted (kernel.dmesg_restrict): notes, never failures; no EFA expected.
    monkeypatch.delenv("FI_PROVIDER")
    outputs = {
        "nvidia-smi": (0, SMI_HEALTHY),
        "dmesg": (1, "dmesg: read kernel buffer failed: Operation not permitted"),
    }
    node = health_gate.check_node("cuda", 8, p4d, run, sysfs)
    assert (node.problems, node.notes) == ([], ["kernel log not readable (dmesg): Xid errors not checked"])
    outputs = {}  # no driver on a GPU node
    assert health_gate.check_node("cuda", 8, None, run, sysfs).problems[0].startswith("no nvidia-smi")
    # A CPU node runs no GPU command.
    asked.clear()
    assert health_gate.check_node("cpu", 2, None, run, sysfs).problems == [] and asked == []


def test_the_floor_is_the_flag_then_the_instance_types_in_a_node_or_across_nodes() -> None:
    assert health_gate.busbw_floor("cuda", "p5.48xlarge", 1, None) == (200.0, "p5.48xlarge, 2026-11-26")
    assert health_gate.busbw_floor("cuda", "p5.48xlarge", 4, None) == (80.0, "p5.48xlarge, 2026-11-26")
    assert health_gate.busbw_floor("cuda", "p5.48xlarge", 4, 150.0) == (150.0, "--health_min_busbw")
    assert health_gate.busbw_floor("cuda", "p5.48xlarge", 4, 0.0) == (None, "--health_min_busbw")
    assert health_gate.busbw_floor("cpu", None, 1, None) == (health_gate.CPU_FLOOR_GBPS, "cpu")
    floor, source = health_gate.busbw_floor("cuda", "x9.huge", 1, None)
    assert floor is None and "no floor for x9.huge: set --health_min_busbw" in source
    assert health_gate.bus_bandwidth_gbps(1_000_000_000, 8, 1.0) == pytest.approx(1.75)


def test_a_slow_all_reduce_across_nodes_names_no_host() -> None:
    nodes = [health_gate.NodeCheck("n1"), health_gate.NodeCheck("n2")]
    verdict = health_gate.judge(nodes, 10.0, 20.0, "p4d.24xlarge, 2026-11-26", 1.0)
    assert verdict.failing() == []
    assert verdict.job_problem() is not None and "across 2 nodes reached 10 GB/s" in verdict.job_problem()


def test_one_rank_from_a_launcher_that_does_not_say_how_many_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No LOCAL_WORLD_SIZE (a launcher other than torchrun): the rank count is not compared; one rank makes no
    all-reduce. A CPU node runs no GPU probe."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("FI_PROVIDER", raising=False)
    said: list[str] = []
    verdict = health_gate.run_gate(
        0, 1, torch.device("cpu"), None, said.append, said.append, run=lambda argv: None
    )
    assert verdict.failing() == [] and verdict.busbw is None
    assert said == [
        f"Health gate: 1 cpu rank on 1 node passed in {verdict.seconds:.2f} s per node: one rank: no all-reduce"
    ]


def _gate(rank: int, store: str, hosts_file: str, results: dict[tuple[int, str], object]) -> None:
    os.environ.update({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
    os.environ[launch_env.HANG_HOSTS_FILE] = hosts_file
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    said: list[str] = []
    try:
        passed = health_gate.run_gate(rank, 2, cpu, None, said.append, said.append)
        results[(rank, "pass")] = (passed.busbw, passed.seconds, list(said))
        said.clear()
        name_bad_hosts = launch_env.name_bad_hosts

        def slow_to_name(*args: object) -> None:  # rank 0 names the hosts late: no rank may leave before
            time.sleep(0.5)
            name_bad_hosts(*args)
            results[(rank, "named at")] = time.time()

        launch_env.name_bad_hosts = slow_to_name  # type: ignore[assignment]
        for case, floor, local_ranks in (("slow", 1e6, "2"), ("missing rank", None, "3")):
            os.environ["LOCAL_WORLD_SIZE"] = local_ranks
            try:
                health_gate.run_gate(rank, 2, cpu, floor, said.append, said.append)
                results[(rank, case)] = "passed"
            except NodeUnhealthy as e:
                results[(rank, case)] = (str(e), list(said))
                results[(rank, f"{case} raised at")] = time.time()
            said.clear()
        launch_env.name_bad_hosts = name_bad_hosts
        # two nodes of one rank each on one host (a test's two SageMaker instances): told apart by GROUP_RANK
        os.environ.update({"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank)})
        two = health_gate.run_gate(rank, 2, cpu, None, said.append, said.append)
        results[(rank, "two nodes")] = (len(two.nodes), list(said))
    finally:
        dist.destroy_process_group()


def test_the_cpu_subset_on_two_real_ranks(tmp_path: Path) -> None:
    """2 gloo ranks: a measured all-reduce passes the CPU floor with one summary line (rank 0); an impossible
    floor fails the node on every rank, named in one line, its host written for train.sbatch; a node where fewer
    ranks joined than the launcher started fails too."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    hosts_file = tmp_path / "hang_hosts"
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_gate, args=(str(tmp_path / "store"), str(hosts_file), results), nprocs=2)
        got = dict(results)
    host = socket.gethostname()
    busbw, seconds, said = got[(0, "pass")]
    assert busbw > health_gate.CPU_FLOOR_GBPS and 0 < seconds < 60
    assert said == [
        f"Health gate: 2 cpu ranks on 1 node passed in {seconds:.2f} s per node: all-reduce {busbw:.3g} GB/s bus "
        f"bandwidth (floor {health_gate.CPU_FLOOR_GBPS:g} GB/s, cpu)"
    ]
    assert got[(1, "pass")][2] == []  # rank 0 speaks
    print(said[0])  # the gate's time per node on this machine (pytest -s)
    for rank in (0, 1):
        message, _ = got[(rank, "slow")]
        assert message.startswith(f"health gate: node {host} failed: all-reduce bus bandwidth ")
        assert message.endswith(
            "below the floor of 1e+06 GB/s (--health_min_busbw) (exit status 75: requeue without it)"
        )
        message, _ = got[(rank, "missing rank")]
        assert (
            message
            == f"health gate: node {host} failed: 2 ranks joined, 3 started (LOCAL_WORLD_SIZE) (exit status 75: requeue without it)"
        )
    nodes, said = got[(0, "two nodes")]
    assert nodes == 2 and said[0].startswith("Health gate: 2 cpu ranks on 2 nodes passed in "), said
    # rank 0 named the host to the launcher, once per failure, before any rank left the gate (torchrun ends the
    # other ranks once one exits)
    assert hosts_file.read_text() == f"{host} failed the health gate\n" * 2
    assert got[(1, "missing rank raised at")] >= got[(0, "named at")]
