"""`dskit doctor`: the real checks on this CPU machine, and the launchers stopping on a FAIL (the real doctor
stopping a real launcher: tests/e2e/test_doctor.py).

What cannot exist here is faked, and only that: GPUs and the NVIDIA driver (a fake `nvidia-smi` first on PATH, or
a `GpuProbe` naming GPUs), EFA (a fake `fi_info` on PATH, a fake /sys/class/infiniband tree, a stand-in
libnccl-net.so file) and CUDA toolkits (a fake /usr/local/cuda-X tree whose `nvcc` only prints its version).
Everything else is real: uv against real lock files, the real disk, real datasets, DeepSpeed's op builders, the
model counted on the meta device, and the rendered launcher scripts run by bash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dskit import cli, doctor, render
from dskit.doctor import GpuProbe, LaunchContext, Status
from dskit.env import lock_stamp
from model_utils.config.arguments import DataArgs
from model_utils.resolve import memory_estimate
from support.fake_commands import executable
from support.s3_server import S3Env

REPO = Path(__file__).resolve().parents[4]
QWEN3_0_6B_PARAMS = 596_049_920  # tests/unit/config/test_presets.py checks it is the real one

NO_GPU = GpuProbe(smi_count=0, torch_count=0, names=(), driver=None, memory_bytes=None, smi_error=None)
# Stand-in for an 8-GPU node (no GPU here).
EIGHT_GPUS = GpuProbe(8, 8, ("NVIDIA H100 80GB HBM3",) * 8, "570.124.06", 81559 * 2**20, None)


def context(**overrides: object) -> LaunchContext:
    values: dict[str, object] = dict(
        gpus_per_node=8,
        cpu_ranks=2,
        cuda_version="12.8",
        efa="auto",
        nodes=2,
        extensions_dir=None,
        ds_accelerator="cpu",
    )
    values.update(overrides)
    return LaunchContext(**values)  # type: ignore[arg-type]


@pytest.fixture
def cpu_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The environment the launchers give the doctor on a CPU-only node of a 2-node job; cwd is tmp_path."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("these tests describe a CPU-only node")
    for name, value in {
        "DS_ACCELERATOR": "cpu",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "GPUS_PER_NODE": "8",
        "CPU_RANKS": "2",
        "CUDA_VERSION": "12.8",
        "EFA": "auto",
        "SLURM_JOB_NUM_NODES": "2",
        "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("UV_PROJECT_ENVIRONMENT", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_doctor(
    capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, dict[str, tuple[str, str, str]]]:
    """Run `dskit doctor FLAGS` in-process; (exit status, {check: (status, found, fix)}) read from the table."""
    capsys.readouterr()
    code = cli.main(["doctor", *flags])
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("check "))
    header = lines[head]
    at_status, at_found, at_fix = header.index("status"), header.index("found"), header.index("fix")
    rows: dict[str, list[str]] = {}
    current = ""
    for line in lines[head + 2 :]:
        if line.startswith("doctor: "):
            break
        name = line[:at_status].strip()
        if name:
            current = name
            rows[current] = [line[at_status:at_found].strip(), "", ""]
        rows[current][1] += " " + line[at_found:at_fix].strip()
        rows[current][2] += " " + line[at_fix:].strip()
    assert out.splitlines()[-1].startswith("doctor: "), out
    return code, {k: (s, " ".join(f.split()), " ".join(x.split())) for k, (s, f, x) in rows.items()}


# --- the whole doctor, on this machine -------------------------------------------------------------------


def test_cpu_node_is_ready(cpu_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, rows = run_doctor(capsys)
    statuses = {name: row[0] for name, row in rows.items()}
    # ~4 GiB for 2 CPU ranks: a WARN only if other processes hold nearly all of this machine's RAM right now
    assert statuses.pop("host RAM") in ("PASS", "WARN"), rows["host RAM"]
    assert statuses == {
        "uv environment": "PASS",
        "torch CUDA vs driver": "SKIP",
        "CUDA toolkit": "SKIP",
        "GPUs": "PASS",
        "network (EFA)": "WARN",
        "health gate": "PASS",
        "checkpoint disk": "PASS",
        "dataset": "PASS",
        "DeepSpeed ops": "PASS",
        "GPU memory": "SKIP",
    }, rows
    assert code == 0
    assert "2 CPU ranks per node" in rows["GPUs"][1] and "DS_ACCELERATOR=cpu" in rows["GPUs"][1]
    assert "CUDA_VERSION=12.8 unused" in rows["CUDA toolkit"][1]
    assert "TCP sockets between the 2 nodes" in rows["network (EFA)"][1]
    assert "EFA=off" in rows["network (EFA)"][2]
    assert rows["health gate"][1] == "all-reduce bus bandwidth >= 0.02 GB/s over 2 node(s) (cpu)"
    assert "4 checkpoints (3 kept + 1 being written)" in rows["checkpoint disk"][1]
    assert "needs ~" in rows["host RAM"][1] and "(2 nodes x 2 ranks)" in rows["host RAM"][1]
    assert not (cpu_node / "checkpoints").exists(), "the doctor created the checkpoint dir"


def test_the_doctor_alone_on_a_cpu_machine_judges_what_a_launch_here_would_do(
    cpu_node: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run by hand, without the launchers' variables (GPUS_PER_NODE then defaults to 8): the launchers would start
    CPU ranks on this machine, so that is no warning."""
    for name in (
        "DS_ACCELERATOR",
        "GPUS_PER_NODE",
        "CPU_RANKS",
        "CUDA_VERSION",
        "EFA",
        "SLURM_JOB_NUM_NODES",
    ):
        monkeypatch.delenv(name)
    code, rows = run_doctor(capsys)
    assert rows["GPUs"] == (
        "PASS",
        "no GPU: 2 CPU ranks per node over gloo (what the launchers start on a node without GPUs)",
        "",
    ), rows["GPUs"]
    assert code == 0 and [name for name, row in rows.items() if row[0] in ("WARN", "FAIL")] in (
        [],
        ["host RAM"],  # only if other processes hold nearly all of this machine's RAM right now
    ), rows


def test_a_mixtures_sources_are_each_checked_as_a_dataset(
    cpu_node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (cpu_node / "web.jsonl").write_text('{"text": "one document"}\n')
    (cpu_node / "code.jsonl").write_text('{"body": "def f(): pass"}\n')
    sources = f"web={cpu_node / 'web.jsonl'}@0.7,code={cpu_node / 'code.jsonl'}@0.3"
    code, rows = run_doctor(capsys, "--sources", sources)
    assert "dataset" not in rows and rows["dataset web"][0] == "PASS", rows
    assert rows["dataset code"][0] == "FAIL" and "columns: body" in rows["dataset code"][1] and code == 1


def test_efa_on_without_efa_fails_with_the_fix(
    cpu_node: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EFA", "on")
    code, rows = run_doctor(capsys)
    assert code == 1
    status, found, fix = rows["network (EFA)"]
    assert status == "FAIL" and found.startswith("EFA=on but no EFA device")
    assert "EFA=auto / EFA=off" in fix
    assert [name for name, row in rows.items() if row[0] == "FAIL"] == ["network (EFA)"]


def test_checkpoints_that_do_not_fit_fail(cpu_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """qwen3-0.6b (counted on the meta device) against the real free space of tmp_path's filesystem."""
    per_checkpoint = QWEN3_0_6B_PARAMS * 14
    keep = shutil.disk_usage(cpu_node).free // per_checkpoint + 1  # keep + 1 copies cannot fit
    code, rows = run_doctor(capsys, "--model", "qwen3-0.6b", "--keep_checkpoints", str(keep))
    assert code == 1
    status, found, fix = rows["checkpoint disk"]
    assert status == "FAIL", rows
    assert "596.0M params x 14 B" in found and f"{keep + 1} checkpoints ({keep} kept" in found
    assert "move --checkpoint_dir to a larger filesystem" in fix and "--keep_checkpoints" in fix


def test_bad_flags_exit_2_with_one_line(cpu_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--max_step", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown flag --max_step: did you mean --max_steps?"]


def test_help_describes_the_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dskit doctor") and "GPUS_PER_NODE" in out


# --- `dskit preflight`: the doctor, then prepare, in one process (what the launchers run) ------------------


def test_preflight_stops_at_a_doctor_fail(
    cpu_node: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FAIL row (EFA=on without EFA) and an otherwise clean config: prepare would succeed, but does not run."""
    monkeypatch.setenv("EFA", "on")
    code = cli.main(["preflight", "--checkpoint_dir", str(cpu_node / "ck")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert out.splitlines()[-1].startswith("doctor: ") and " 1 FAIL" in out
    assert "ok: " not in out, "prepare ran after a FAIL"
    # The doctor kept only the model's parameter counts there (memory_estimate.SHAPE_CACHE).
    assert [p.name for p in (cpu_node / ".cache" / "data").iterdir()] == [memory_estimate.SHAPE_CACHE], (
        "prepare packed the data after a FAIL"
    )


def test_preflight_runs_the_doctor_then_prepare(cpu_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["preflight", "--checkpoint_dir", str(cpu_node / "ck")])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("doctor: "))
    (ok,) = [i for i, line in enumerate(lines) if line.startswith("ok: ")]
    assert summary < ok, out
    assert " 0 FAIL" in lines[summary] and "fresh start" in lines[ok]


def test_preflight_passes_on_prepares_one_line_error(
    cpu_node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The doctor passes, prepare refuses the run: one error line and exit 2, as `dskit prepare` alone."""
    nothing = cpu_node / "nothing"
    code = cli.main(
        ["preflight", "--checkpoint_dir", str(cpu_node / "ck"), "--resume_from_checkpoint", str(nothing)]
    )
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    assert "doctor: " in captured.out and "ok: " not in captured.out
    assert captured.err.strip().splitlines() == [
        f"error: --resume_from_checkpoint {nothing} holds no verified checkpoint: point it at a checkpoint dir "
        "or a tag dir, or drop the flag"
    ]


def test_preflight_help_is_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["preflight", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dskit preflight") and "dskit doctor --help" in out
    assert "dskit doctor on" not in out  # help only: no checks ran


def test_preflight_bad_flags_exit_2_with_one_line(cpu_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["preflight", "--max_step", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == ["error: unknown flag --max_step: did you mean --max_steps?"]
    assert captured.out == ""


def test_bad_launch_value_exits_2(
    cpu_node: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUS_PER_NODE", "eight")
    assert cli.main(["doctor"]) == 2
    assert "GPUS_PER_NODE='eight' is not a whole number" in capsys.readouterr().err


# --- 1. uv ---------------------------------------------------------------------------------------------

LOCK_HEAD = 'version = 1\nrevision = 3\nrequires-python = ">=3.11"\n'
PROJECT_ENTRY = '\n[[package]]\nname = "t"\nversion = "0"\nsource = {{ virtual = "." }}\n{deps}'
ABSENT_PACKAGE = """
[[package]]
name = "dskit-doctor-absent"
version = "1.0"
source = { registry = "https://pypi.org/simple" }
wheels = [
    { url = "https://files.pythonhosted.org/packages/00/00/dskit_doctor_absent-1.0-py3-none-any.whl", hash = "sha256:0000000000000000000000000000000000000000000000000000000000000000", size = 1 },
]
"""


def tiny_project(root: Path, with_dependency: bool) -> None:
    dep = '"dskit-doctor-absent"' if with_dependency else ""
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "t"\nversion = "0"\nrequires-python = ">=3.11"\ndependencies = [{dep}]\n'
        "[tool.uv]\npackage = false\n"
    )
    deps = (
        'dependencies = [\n    { name = "dskit-doctor-absent" },\n]\n\n[package.metadata]\n'
        'requires-dist = [{ name = "dskit-doctor-absent" }]\n'
        if with_dependency
        else ""
    )
    lock = LOCK_HEAD + (ABSENT_PACKAGE if with_dependency else "") + PROJECT_ENTRY.format(deps=deps)
    (root / "uv.lock").write_text(lock)


def test_uv_env_in_sync_then_out_of_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny project with its own uv.lock and .venv; uv checks it offline and changes nothing."""
    if shutil.which("uv") is None:
        pytest.fail("uv is not installed: the doctor's uv check needs it (pip install uv)")
    monkeypatch.delenv("UV_PROJECT_ENVIRONMENT", raising=False)
    tiny_project(tmp_path, with_dependency=False)
    subprocess.run(["uv", "venv", "--quiet", str(tmp_path / ".venv")], check=True, cwd=tmp_path)
    result = doctor.check_uv(tmp_path, tmp_path / ".venv")
    assert result.status is Status.PASS, result
    assert "matches uv.lock" in result.found

    tiny_project(tmp_path, with_dependency=True)  # the lock moved on; the environment did not
    lock_before = (tmp_path / "uv.lock").read_bytes()
    result = doctor.check_uv(tmp_path, tmp_path / ".venv")
    assert result.status is Status.FAIL, result
    assert "+ dskit-doctor-absent==1.0" in result.found
    assert "uv sync --frozen" in result.fix
    assert (tmp_path / "uv.lock").read_bytes() == lock_before
    assert not list((tmp_path / ".venv").rglob("dskit_doctor_absent*")), "the check installed something"

    shutil.rmtree(tmp_path / ".venv")
    result = doctor.check_uv(tmp_path, tmp_path / ".venv")
    assert result.status is Status.FAIL and "does not exist" in result.found
    assert not (tmp_path / ".venv").exists()


def test_uv_check_trusts_the_stamp_of_the_last_sync_only_while_it_holds(tmp_path: Path) -> None:
    """No uv at all on the fast path: a PATH without uv still PASSes while the stamp holds."""
    tiny_project(tmp_path, with_dependency=False)
    site = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (tmp_path / ".venv" / "bin").mkdir()
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    lock_stamp.write(tmp_path, tmp_path / ".venv")
    result = doctor.check_uv(tmp_path, tmp_path / ".venv")
    assert result.status is Status.PASS and "unchanged since its uv sync at" in result.found
    tiny_project(tmp_path, with_dependency=True)  # the lock moved on: the stamp no longer holds, uv decides
    result = doctor.check_uv(tmp_path, tmp_path / ".venv")
    assert "unchanged since" not in result.found


def test_uv_check_skips_another_python(tmp_path: Path) -> None:
    tiny_project(tmp_path, with_dependency=False)
    result = doctor.check_uv(tmp_path, Path("/usr"))
    assert result.status is Status.SKIP and "not the project env" in result.found


def test_uv_check_of_a_venv_from_a_wheelhouse_compares_its_lock(tmp_path: Path) -> None:
    """Offline, uv is not there to ask: the install's stamp says which uv.lock its wheelhouse was built from."""
    from dskit.env import wheelhouse

    tiny_project(tmp_path, with_dependency=False)
    (tmp_path / ".venv").mkdir()
    stamp = tmp_path / ".venv" / wheelhouse.STAMP
    stamp.write_text(
        json.dumps({"lock_sha256": wheelhouse.lock_digest(tmp_path), "base": "/usr/bin/python3"})
    )
    result = doctor.check_uv(tmp_path, tmp_path / ".venv")
    assert result.status is Status.PASS and "installed from a wheelhouse of this uv.lock" in result.found
    tiny_project(tmp_path, with_dependency=True)  # the lock moved on
    result = doctor.check_uv(tmp_path, tmp_path / ".venv")
    assert result.status is Status.WARN and "of another uv.lock" in result.found
    assert "WHEELHOUSE=DIR" in result.fix


# --- 2./4. driver and GPUs (fake nvidia-smi) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("torch_cuda", "driver", "status", "text"),
    [
        ("12.8", "570.124.06", Status.PASS, ">= 570.26"),
        ("12.8", "550.54.15", Status.WARN, "minor-version compatibility"),
        ("12.8", "470.82.01", Status.FAIL, "needs driver >= 570.26"),
        ("13.0", "575.57.08", Status.FAIL, "needs driver >= 580.65.06"),
        ("13.2", "580.95.05", Status.PASS, ">= 580.65.06 for CUDA 13.x"),
        ("11.8", "535.104.05", Status.PASS, ">= 520.61.05"),
        ("14.0", "600.1", Status.WARN, "not in the doctor's table"),
    ],
)
def test_driver_against_torch_cuda(torch_cuda: str, driver: str, status: Status, text: str) -> None:
    got, found, fix = doctor.driver_verdict(torch_cuda, driver)
    assert got is status and text in found
    assert (got is Status.PASS) == (fix == "")


NVIDIA_SMI = """#!/usr/bin/env bash
# Fake nvidia-smi (no GPU here): answers the doctor's query like an 8x H100 node.
[[ "$*" == *--query-gpu=name,driver_version,memory.total* ]] || exit 2
for i in 0 1 2 3 4 5 6 7; do echo "NVIDIA H100 80GB HBM3, 550.54.15, 81559"; done
"""


def test_fake_nvidia_smi_gpus_torch_cannot_see(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi lists 8 GPUs but torch (here: no CUDA device) sees none: that node cannot train on GPUs."""
    executable(tmp_path / "bin" / "nvidia-smi", NVIDIA_SMI)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    gpus = doctor.probe_gpus()
    assert (gpus.smi_count, gpus.driver, gpus.memory_bytes) == (8, "550.54.15", 81559 * 2**20)
    assert gpus.names[0] == "NVIDIA H100 80GB HBM3"
    result = doctor.check_gpus(context(), gpus)
    assert result.status is Status.FAIL and "nvidia-smi lists 8 GPUs" in result.found
    result = doctor.check_driver(gpus, "12.8", "2.x")
    assert result.status is Status.WARN and "driver 550.54.15" in result.found
    result = doctor.check_driver(gpus, None, "2.x+cpu")
    assert result.status is Status.FAIL and "CPU-only build" in result.found


@pytest.mark.parametrize(
    ("script", "status"),
    [
        ('echo "No devices were found"; exit 6', Status.SKIP),
        (
            'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9',
            Status.WARN,
        ),
    ],
    ids=["no-devices", "broken-driver"],
)
def test_fake_nvidia_smi_without_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, status: Status
) -> None:
    executable(tmp_path / "bin" / "nvidia-smi", f"#!/usr/bin/env bash\n{script}\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    gpus = doctor.probe_gpus()
    assert gpus.smi_count == 0
    assert doctor.check_driver(gpus, "12.8", "2.x").status is status


# An NVIDIA driver without a GPU it can see: a GPU node whose GPUs are gone (a CPU machine has no driver).
DRIVER_NO_GPU = GpuProbe(0, 0, (), "570.124.06", None, None)


@pytest.mark.parametrize(
    ("ctx", "gpus", "status", "text", "fix"),
    [
        (context(), EIGHT_GPUS, Status.PASS, "8 GPUs (NVIDIA H100 80GB HBM3) = GPUS_PER_NODE", ""),
        (
            context(gpus_per_node=4),
            EIGHT_GPUS,
            Status.WARN,
            "the launch values say 4",
            "dskit render --set gpus_per_node=8",
        ),
        (
            context(gpus_per_node=0),
            EIGHT_GPUS,
            Status.WARN,
            "GPUS_PER_NODE=0",
            "GPUS_PER_NODE=8 ./train-singlenode.sh (or sbatch train.sbatch), or the launchers rendered with: "
            "dskit render --set gpus_per_node=8",
        ),
        # the launchers start CPU ranks where there is no GPU: what they would do on this machine
        (
            context(ds_accelerator=None),
            NO_GPU,
            Status.PASS,
            "no GPU: 2 CPU ranks per node over gloo (what the launchers start on a node without GPUs)",
            "",
        ),
        (
            context(ds_accelerator=None),
            DRIVER_NO_GPU,
            Status.WARN,
            "the NVIDIA driver 570.124.06 is loaded but no GPU is visible, though GPUS_PER_NODE=8",
            "GPUS_PER_NODE=0 ./train-singlenode.sh (or sbatch train.sbatch)",
        ),
        (context(gpus_per_node=0, ds_accelerator=None), NO_GPU, Status.PASS, "(GPUS_PER_NODE=0)", ""),
        (context(cpu_ranks=0), NO_GPU, Status.FAIL, "CPU_RANKS=0", "CPU_RANKS=2 ./train-singlenode.sh"),
        # the launcher counts without torch (python_env.visible_gpus): its ranks must match torch's devices
        (context(launcher_gpus=8), EIGHT_GPUS, Status.PASS, "= GPUS_PER_NODE", ""),
        (
            context(launcher_gpus=4),
            EIGHT_GPUS,
            Status.FAIL,
            "the launcher counted 4 GPUs",
            "CUDA_VISIBLE_DEVICES",
        ),
        (context(launcher_gpus=0), NO_GPU, Status.PASS, "no GPU", ""),
    ],
    ids=[
        "match",
        "fewer-values",
        "gpus-ignored",
        "cpu-machine",
        "gpus-gone",
        "cpu-cluster",
        "no-ranks",
        "launcher-agrees",
        "launcher-differs",
        "launcher-none",
    ],
)
def test_gpu_count_against_launch_values(
    ctx: LaunchContext, gpus: GpuProbe, status: Status, text: str, fix: str
) -> None:
    """What the launchers would start here, and a fix that is something to type (a launch with its variable,
    `dskit render` with its option)."""
    result = doctor.check_gpus(ctx, gpus)
    assert result.status is status and text in result.found, result
    assert fix in result.fix and (fix or not result.fix), result


# --- 3. the CUDA toolkit (fake /usr/local/cuda-X trees) -------------------------------------------------


def fake_toolkit(root: Path, version: str, nvcc: bool = True) -> None:
    (root / f"cuda-{version}" / "lib64").mkdir(parents=True)
    if nvcc:
        executable(
            root / f"cuda-{version}" / "bin" / "nvcc",
            f'#!/usr/bin/env bash\necho "Cuda compilation tools, release {version}, V{version}.41"\n',
        )


def test_toolkit_against_torch_cuda(tmp_path: Path) -> None:
    fake_toolkit(tmp_path, "12.8")
    fake_toolkit(tmp_path, "13.2")
    fake_toolkit(tmp_path, "13.1", nvcc=False)

    result = doctor.check_toolkit(context(cuda_version="13.2"), EIGHT_GPUS, "13.2", root=tmp_path)
    assert result.status is Status.PASS and "nvcc 13.2" in result.found

    result = doctor.check_toolkit(context(cuda_version="12.8"), EIGHT_GPUS, "13.2", root=tmp_path)
    assert result.status is Status.FAIL and "the CUDA majors differ" in result.found
    assert result.fix.startswith("CUDA_VERSION=13.2")

    result = doctor.check_toolkit(context(cuda_version="12.9"), EIGHT_GPUS, "12.8", root=tmp_path)
    assert result.status is Status.FAIL
    assert "installed: cuda-12.8, cuda-13.1, cuda-13.2" in result.found and "CUDA_VERSION" in result.fix

    result = doctor.check_toolkit(context(cuda_version="13.1"), EIGHT_GPUS, "13.2", root=tmp_path)
    assert result.status is Status.FAIL and "no bin/nvcc" in result.found

    result = doctor.check_toolkit(context(cuda_version="12.9"), NO_GPU, "12.8", root=tmp_path)
    assert result.status is Status.SKIP

    # NVIDIA's images export CUDA_VERSION with the patch release (13.2.1) beside /usr/local/cuda-13.2
    result = doctor.check_toolkit(context(cuda_version="13.2.1"), EIGHT_GPUS, "13.2", root=tmp_path)
    assert result.status is Status.PASS and f"{tmp_path / 'cuda-13.2'}: nvcc 13.2" in result.found


# --- 5. EFA (fake fi_info, sysfs and plugin) ----------------------------------------------------------

FI_INFO = """#!/usr/bin/env bash
# Fake fi_info (no EFA here): what libfabric prints for `fi_info -p efa` on an EFA instance.
[[ "$*" == "-p efa" ]] || exit 1
printf 'provider: efa\\n    fabric: efa\\n    domain: rdmap0s6-rdm\\n'
"""


@pytest.fixture
def fake_efa(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An EFA device in a fake sysfs tree, fi_info on PATH; returns the sysfs root. No NCCL plugin yet."""
    sysfs = tmp_path / "sys" / "class" / "infiniband"
    driver = tmp_path / "sys" / "bus" / "pci" / "drivers" / "efa"
    driver.mkdir(parents=True)
    (sysfs / "rdmap0s6" / "device").mkdir(parents=True)
    (sysfs / "rdmap0s6" / "device" / "driver").symlink_to(driver)
    executable(tmp_path / "bin" / "fi_info", FI_INFO)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "lib"))
    return sysfs


def test_efa_with_nccl_plugin_passes(fake_efa: Path, tmp_path: Path) -> None:
    assert doctor.efa_devices(fake_efa) == ["rdmap0s6"]
    for efa in ("on", "auto"):
        result = doctor.check_network(context(efa=efa), uses_gpus=True, sysfs=fake_efa)
        assert result.status is Status.FAIL if efa == "on" else Status.WARN, result
        assert "no NCCL net plugin" in result.found and "aws-ofi-nccl" in result.fix
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnccl-net-ofi.so").write_bytes(b"")  # stand-in for aws-ofi-nccl's library
    result = doctor.check_network(context(efa="on"), uses_gpus=True, sysfs=fake_efa)
    assert result.status is Status.PASS, result
    assert "rdmap0s6" in result.found and "libnccl-net-ofi.so" in result.found
    # gloo on CPU ranks does not use NCCL's plugin
    assert doctor.check_network(context(efa="on"), uses_gpus=False, sysfs=fake_efa).status is Status.PASS


def test_the_health_gate_row_shows_the_floor_the_ranks_will_hold_each_node_to() -> None:
    """launch/health_gate.py's table for the instance type, across nodes or in one; the flag's floor; a type
    the table lacks warns with the fix; --health_gate off skips."""
    from model_utils.config.arguments import parse_args

    cfg = parse_args([])
    p5 = doctor.check_health_gate(cfg, context(), True, "p5.48xlarge")
    assert p5.status is Status.PASS
    assert p5.found == (
        "8 GPUs, 32 EFA devices where EFA is used; all-reduce bus bandwidth >= 80 GB/s over 2 node(s) "
        "(p5.48xlarge, 2026-11-26)"
    )
    assert (
        ">= 200 GB/s over 1 node(s)"
        in doctor.check_health_gate(cfg, context(nodes=1), True, "p5.48xlarge").found
    )
    unknown = doctor.check_health_gate(cfg, context(), True, None)
    assert unknown.status is Status.WARN and "--health_min_busbw" in unknown.fix
    assert "p4d.24xlarge" in unknown.found and "measured, not judged" in unknown.found
    flagged = doctor.check_health_gate(parse_args(["--health_min_busbw", "50"]), context(), True, None)
    assert flagged.status is Status.PASS and ">= 50 GB/s" in flagged.found
    off = doctor.check_health_gate(parse_args(["--health_gate", "off"]), context(), True, "p5.48xlarge")
    assert off.status is Status.SKIP


def test_efa_modes_without_efa(tmp_path: Path) -> None:
    no_sysfs = tmp_path / "none"
    assert doctor.check_network(context(efa="off"), True, no_sysfs).status is Status.SKIP
    assert doctor.check_network(context(efa="auto", nodes=1), True, no_sysfs).status is Status.SKIP
    auto = doctor.check_network(context(efa="auto"), True, no_sysfs)
    assert auto.status is Status.WARN and "NCCL uses TCP sockets" in auto.found
    on = doctor.check_network(context(efa="on", nodes=1), True, no_sysfs)
    assert on.status is Status.FAIL and "EFA=auto / EFA=off" in on.fix
    assert doctor.check_network(context(efa="maybe"), True, no_sysfs).status is Status.FAIL


# --- 7. datasets ---------------------------------------------------------------------------------------


def test_local_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    (tmp_path / "good.jsonl").write_text('{"text": "one document"}\n{"text": "two"}\n')
    (tmp_path / "other.jsonl").write_text('{"body": "one document"}\n')
    (tmp_path / "empty.txt").write_text("")
    datasets.Dataset.from_dict({"text": ["a", "b", "c"]}).save_to_disk(str(tmp_path / "saved"))

    def check(dataset: str, **kwargs: object) -> doctor.Result:
        return doctor.check_dataset(DataArgs(dataset=dataset, **kwargs))  # type: ignore[arg-type]

    assert check("embedded").status is Status.PASS
    good = check(str(tmp_path / "good.jsonl"))
    assert good.status is Status.PASS and "column 'text'" in good.found
    other = check(str(tmp_path / "other.jsonl"))
    assert other.status is Status.FAIL and "columns: body" in other.found and "--text_field" in other.fix
    assert check(str(tmp_path / "other.jsonl"), text_field="body").status is Status.PASS
    assert check(str(tmp_path / "empty.txt")).status is Status.FAIL
    # Conversations and prompt/completion rows: the columns their --data_format reads.
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "pc.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    chats = check(str(tmp_path / "chats.jsonl"))
    assert chats.status is Status.PASS and "column 'messages'" in chats.found
    pairs = check(str(tmp_path / "pc.jsonl"))
    assert pairs.status is Status.PASS and "columns 'prompt' and 'completion'" in pairs.found
    wrong = check(str(tmp_path / "good.jsonl"), data_format="messages")
    assert (
        wrong.status is Status.FAIL and "no column 'messages'" in wrong.found and "--data_format" in wrong.fix
    )
    missing = check(str(tmp_path / "nope.jsonl"))
    assert missing.status is Status.FAIL and "does not exist" in missing.found
    saved = check(str(tmp_path / "saved"))
    assert saved.status is Status.PASS and "3 rows" in saved.found
    assert check(str(tmp_path / "saved"), train_split="validation").status is Status.FAIL
    from dskit import prepare_data

    assert prepare_data.main([str(tmp_path / "prepared"), "--dataset", str(tmp_path / "good.jsonl")]) == 0
    prepared = check(str(tmp_path / "prepared"))
    assert (
        prepared.status is Status.PASS
        and "prepared dataset" in prepared.found
        and "tiny-qwen3" in prepared.found
    )
    (tmp_path / "prepared" / "manifest.json").unlink()  # as a killed preparation leaves it
    unfinished = check(str(tmp_path / "prepared"))
    assert unfinished.status is Status.FAIL and "unfinished preparation" in unfinished.found
    assert "re-run the same `dskit prepare-data`" in unfinished.fix


def test_hub_dataset_offline_says_what_it_can(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = doctor.check_dataset(DataArgs(dataset="dskit-test/no-such-dataset", local_dataset=False))
    assert (
        result.status is Status.WARN
        and "offline" in result.found
        and "not in the local caches" in result.found
    )


def test_s3_dataset_against_a_loopback_s3(s3: S3Env, tmp_path: Path) -> None:
    s3.client.put_object(Bucket=s3.bucket, Key="data/train.jsonl", Body=b'{"text": "a document"}\n')

    def check(uri: str) -> doctor.Result:
        return doctor.check_dataset(DataArgs(dataset=uri, data_cache_dir=str(tmp_path)))

    folder = check(s3.uri("data"))
    assert folder.status is Status.PASS and "1 objects readable" in folder.found
    assert check(s3.uri("data/train.jsonl")).status is Status.PASS
    missing = check(s3.uri("nothing-here"))
    assert missing.status is Status.FAIL and "no objects under" in missing.found
    no_bucket = check("s3://dskit-doctor-no-such-bucket/data")
    assert no_bucket.status is Status.FAIL and "does not exist" in no_bucket.found


# --- 8. DeepSpeed ops ---------------------------------------------------------------------------------


def test_ops_need_a_toolchain_when_not_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_node: Path
) -> None:
    ctx = context(extensions_dir=tmp_path / "extensions")  # nothing built there
    ops = ("ShareMemCommBuilder", "CPUAdamBuilder")
    result = doctor.check_ops(ctx, ops)
    assert (
        result.status is Status.PASS and "the ranks will build deepspeed_shm_comm, cpu_adam" in result.found
    )
    (tmp_path / "empty-bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("CXX", raising=False)
    result = doctor.check_ops(ctx, ops)
    assert result.status is Status.FAIL, result
    # ninja: the environment's, which the ranks find too (ops.prepare_jit_env), where it has one
    missing = (
        "a C++ compiler (c++) not found" if (Path(sys.executable).parent / "ninja").is_file() else "ninja"
    )
    assert "cpu_adam" in result.found and missing in result.found
    assert "ninja-build g++" in result.fix
    assert doctor.check_ops(ctx, ()).status is Status.PASS  # nothing to build: no toolchain needed


# A real op of torch's JIT build (whether a build holds is ninja's verdict on real files), loaded as DeepSpeed's
# builders load theirs: one C++ file without torch's headers, built in a second.
BUILD_IN_A_PROCESS = (
    "import sys; from model_utils.launch import ops; ops.prepare_jit_env(); "
    "from torch.utils import cpp_extension; cpp_extension.load(sys.argv[1], [sys.argv[2]], is_python_module=False)"
)


class TinyOpBuilder:
    def __init__(self, name: str, source: Path) -> None:
        self.name, self.source = name, source

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = False) -> str:
        from torch.utils import cpp_extension

        return cpp_extension.load(self.name, [str(self.source)], is_python_module=False, verbose=verbose)


def test_an_op_the_ranks_would_rebuild_is_not_called_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_node: Path
) -> None:
    """The ops row says what the ranks' load will do: an op built before ccache was installed is rebuilt by it
    (torch compiles through the ccache it finds on PATH), with ninja's reason. The check builds nothing."""
    extensions = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    source = tmp_path / "doctor_tiny_op.cpp"
    source.write_text('extern "C" int dskit_tiny_op() { return 42; }\n')
    # Built by an earlier launch (a process of its own) on this machine before it had ccache.
    env = {**os.environ, "TORCH_NO_COMPILER_WRAPPER": "1"}
    subprocess.run(
        [sys.executable, "-c", BUILD_IN_A_PROCESS, "doctor_tiny_op", str(source)], env=env, check=True
    )
    ctx = context(extensions_dir=extensions)
    create = {"TinyOpBuilder": TinyOpBuilder("doctor_tiny_op", source)}.get
    monkeypatch.setenv("TORCH_NO_COMPILER_WRAPPER", "1")  # as it was built
    assert doctor.check_ops(ctx, ("TinyOpBuilder",), create) == doctor.Result(
        "DeepSpeed ops", Status.PASS, f"built in {extensions}: doctor_tiny_op"
    )
    files = {p: p.stat().st_mtime_ns for p in extensions.rglob("*")}
    monkeypatch.delenv("TORCH_NO_COMPILER_WRAPPER")
    executable(tmp_path / "ccache-bin" / "ccache", '#!/bin/sh\nexec "$@"\n')  # stands in for ccache
    monkeypatch.setenv("PATH", f"{tmp_path / 'ccache-bin'}{os.pathsep}{os.environ['PATH']}")
    result = doctor.check_ops(ctx, ("TinyOpBuilder",), create)
    assert result.status is Status.PASS and result.found.startswith(
        f"none ready in {extensions}; the ranks will build doctor_tiny_op (out of date since its last build, "
        "ninja: command line changed for doctor_tiny_op.o) as they start"
    ), result
    assert {p: p.stat().st_mtime_ns for p in extensions.rglob("*")} == files  # nothing built, nothing written


@pytest.mark.parametrize(
    ("flags", "gpus", "ops"),
    [
        ([], NO_GPU, ("ShareMemCommBuilder", "CPUAdamBuilder")),  # the default: the optimizer offloaded
        (["--deepspeed_config", "deepspeed/ds_config_gpu.json"], NO_GPU, ("ShareMemCommBuilder",)),
        (["--backend", "fsdp"], NO_GPU, ("ShareMemCommBuilder",)),
        # 8 GPUs of 80 GB: the tiny model fits, so the ranks take the GPU-only default (torch's fused AdamW)
        ([], EIGHT_GPUS, ()),
    ],
)
def test_the_doctor_checks_the_ops_of_the_run_it_is_given(
    flags: list[str], gpus: GpuProbe, ops: tuple[str, ...], cpu_node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import resolver

    monkeypatch.chdir(REPO)
    cfg = parse_args(["--model", "tiny-qwen3", *flags])
    assert doctor.run_jit_ops(cfg, resolver.resolve_settings(cfg), context(), gpus) == ops
    if gpus is NO_GPU:  # without the model's settings (a hub model not reachable): from the flags alone
        assert doctor.run_jit_ops(cfg, None, context(), gpus) == ops


def test_the_ops_row_names_the_runs_ops(cpu_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, rows = run_doctor(capsys, "--deepspeed_config", str(REPO / "deepspeed" / "ds_config_gpu.json"))
    status, found, _ = rows["DeepSpeed ops"]
    assert status == "PASS" and "deepspeed_shm_comm" in found and "cpu_adam" not in found, found


# --- the launchers -------------------------------------------------------------------------------------

# Stands in for the repo's .venv/bin/python in a rendered script: the version probe gets fixed values, the log's
# run name none (test_render.py tests it), every other call is recorded (arguments, then the launch variables it
# was given); PREFLIGHT_EXIT sets the exit of `dskit preflight` (1: a doctor FAIL; 2: prepare's one-line error).
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ "$1 $2" == "-m dskit.env.python_env" ]]; then echo "0 3.11.7 2.6.0 none 0.19.8"; exit 0; fi
if [[ "$1 $2" == "-m model_utils.observe.run_name" ]]; then exit 0; fi
if [[ "$1 $2" == "-m dskit.env.lock_stamp" ]]; then exit 0; fi
if [[ "$1 $2" == "-m model_utils.launch.supervise" ]]; then shift 2; printf "%s\0" torchrun "$@" >"$CALLS/$(date +%s%N)"; exit; fi
printf '%s\0' "$@" "ENV CUDA_VERSION=$CUDA_VERSION GPUS_PER_NODE=$GPUS_PER_NODE CPU_RANKS=$CPU_RANKS EFA=$EFA NODES=$SLURM_JOB_NUM_NODES" \
  >"$CALLS/$(date +%s%N)"
if [[ "$3" == preflight ]]; then
  echo "doctor: (the stub's table)"
  if [[ "${PREFLIGHT_EXIT:-0}" == 2 ]]; then echo "error: prepare refused the run" >&2; fi
  exit "${PREFLIGHT_EXIT:-0}"
fi
"""
STUB = "#!/usr/bin/env bash\n"  # uv: succeeds, does nothing
SRUN = '#!/usr/bin/env bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n'
SCONTROL = '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && printf "n1\\nn2\\n"; exit 0\n'


def launch(
    tmp_path: Path, script: str, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    repo, calls, bin_dir = tmp_path / "repo", tmp_path / "calls", tmp_path / "bin"
    for d in (repo / "src", calls):
        d.mkdir(parents=True, exist_ok=True)
    (repo / "src" / "train_deepspeed.py").write_text("")
    for package in (
        "dskit",
        "model_utils",
    ):  # the launchers' own steps (src/dskit/launcher/) are the kit's code
        (repo / "src" / package).symlink_to(REPO / "src" / package)
    render.write_scripts(render.render_scripts(render.LaunchValues()), repo)
    executable(repo / ".venv" / "bin" / "python", FAKE_PYTHON)
    for name, text in {"uv": STUB, "srun": SRUN, "scontrol": SCONTROL}.items():
        executable(bin_dir / name, text)
    (bin_dir / "python3").symlink_to(sys.executable)  # the launchers' own steps, under this interpreter
    full_env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/root"),
        "CALLS": str(calls),
        "SLURM_SUBMIT_DIR": str(repo),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NAME": "t",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        **env,
    }
    proc = subprocess.run(
        [str(repo / script), "--seed", "3"],
        cwd=repo,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    recorded = [path.read_bytes().decode().split("\0")[:-1] for path in sorted(calls.iterdir())]
    return proc, recorded


@pytest.mark.parametrize("script", list(render.SCRIPTS))
def test_launchers_run_one_preflight_before_torchrun(tmp_path: Path, script: str) -> None:
    proc, calls = launch(tmp_path, script, {"CUDA_VERSION": "12.9", "CPU_RANKS": "3"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    preflight_call, torchrun_call = calls  # the doctor and prepare in one process, then the ranks
    assert preflight_call[:5] == ["-m", "dskit.cli", "preflight", "--seed", "3"]
    nodes, efa = ("2", "auto") if script == "train.sbatch" else ("1", "auto")
    assert preflight_call[-1] == f"ENV CUDA_VERSION=12.9 GPUS_PER_NODE=8 CPU_RANKS=3 EFA={efa} NODES={nodes}"
    assert torchrun_call[0] == "torchrun" and torchrun_call[-2:] == ["--seed", "3"]


@pytest.mark.parametrize("script", list(render.SCRIPTS))
def test_a_doctor_fail_stops_the_launch(tmp_path: Path, script: str) -> None:
    proc, calls = launch(tmp_path, script, {"PREFLIGHT_EXIT": "1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "error: dskit doctor stopped the launch on" in output and "fix what it reports above" in output
    assert len(calls) == 1, "torchrun ran after a FAIL"


@pytest.mark.parametrize("script", list(render.SCRIPTS))
def test_a_prepare_error_stops_the_launch_with_its_own_line(tmp_path: Path, script: str) -> None:
    """Preflight's exit 2 (prepare's one-line error, or a bad flag): that status, no doctor message."""
    proc, calls = launch(tmp_path, script, {"PREFLIGHT_EXIT": "2"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "error: prepare refused the run" in output
    assert "dskit doctor stopped the launch" not in output
    assert [call[2] for call in calls] == ["preflight"], "torchrun ran after prepare's error"


def test_committed_launchers_call_preflight_once() -> None:
    for name in render.SCRIPTS:
        text = (REPO / name).read_text()
        assert "dskit.cli doctor" not in text and "dskit.cli prepare" not in text, name
        assert text.count("dskit.cli preflight") == 1, name
        call = text.index("\n" + ("  " if name == "train-singlenode.sh" else "") + "run_preflight ")
        assert call < text.index('--nproc_per_node="$nproc_per_node"'), name


def test_doctor_run_alone_looks_for_the_ops_where_a_rank_builds_them() -> None:
    """No TORCH_EXTENSIONS_DIR (doctor typed by hand, not from a launcher): the checkout's dir, which a rank's
    ops.prepare_jit_env picks too, not torch's ~/.cache default, which no entry of the kit uses."""
    from model_utils import repo
    from model_utils.launch import ops

    assert doctor.LaunchContext.from_env({}).extensions_dir == repo.EXTENSIONS_DIR
    environ: dict[str, str] = {}
    ops.prepare_jit_env(environ)
    assert environ["TORCH_EXTENSIONS_DIR"] == str(repo.EXTENSIONS_DIR)
    assert doctor.LaunchContext.from_env({"TORCH_EXTENSIONS_DIR": "/x"}).extensions_dir == Path("/x")
