"""The SageMaker entry's contract end to end on CPU: two "instances" as two entry processes on loopback, each with
its own /opt/ml-like tree (no shared filesystem, like SageMaker), channels holding a Hugging Face model dir and a
dataset. SIGTERM mid-run (what StopTrainingJob or a spot interruption sends) -> both save and stop at one step;
SageMaker's checkpoint sync (every instance's checkpoints/ up to one S3 prefix, the union down to every instance
of the restarted job) is simulated by a directory union; the restart resumes from the newest verified tag,
finishes, and the first host exports the model into model/ (as root: a bind mount of its own, as on SageMaker),
which from_pretrained loads. Three bad inputs end with the kit's error line as the job's FailureReason.

Not real here: SageMaker itself, the image and S3 sync of checkpoints (a copy stands in for it).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dskit import sagemaker
from support.pretrained import save_tiny_qwen3
from support.s3_server import free_port
from support.torchrun import ENV, REPO

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

HOSTS = ["127.0.0.1", "localhost"]  # both name this machine: the first is the master's address
MAX_STEPS = 60
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
    "near",
    "the",
    "old",
    "river",
    "bank",
]


def write_dataset(path: Path, docs: int, seed: int) -> None:
    path.mkdir(parents=True)
    lines = []
    for i in range(docs):
        words = [WORDS[(i * 7 + j * (seed + 3)) % len(WORDS)] for j in range(40)]
        lines.append(json.dumps({"text": " ".join(words) + f" {i}."}))
    (path / "part-0.jsonl").write_text("\n".join(lines) + "\n")


def instance_tree(
    base: Path, host: str, model: Path, hyperparameters: dict[str, str], hosts: list[str] = HOSTS
) -> None:
    """What SageMaker lays out on an instance before the container starts."""
    config = base / "input" / "config"
    config.mkdir(parents=True)
    resource = {"current_host": host, "hosts": hosts, "network_interface_name": "lo"}
    (config / "resourceconfig.json").write_text(json.dumps(resource))
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    (config / "inputdataconfig.json").write_text(
        json.dumps({c: {"TrainingInputMode": "File"} for c in ("model", "train", "validation")})
    )
    data = base / "input" / "data"
    shutil.copytree(model, data / "model")
    write_dataset(data / "train", 400, seed=0)
    write_dataset(data / "validation", 20, seed=1)


# As root: the first host's model/ a mount point of its own, as on SageMaker (the entry in a private mount
# namespace with a dir bind-mounted there; the files land in that dir). Elsewhere a plain dir.
MOUNTS_MODEL_DIR = os.geteuid() == 0 and shutil.which("unshare") is not None


def entry_command(base: Path, model_volume: Path | None) -> list[str]:
    entry = [sys.executable, "-m", "dskit.sagemaker.entry"]
    if model_volume is None:
        return entry
    model_volume.mkdir(parents=True, exist_ok=True)
    mount = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh",
            str(model_volume), str(base / "model"), *entry]  # fmt: skip


def start(
    bases: list[Path], port: int, logs: list[Path], model_volume: Path | None = None
) -> list[subprocess.Popen]:
    procs = []
    for i, (base, log) in enumerate(zip(bases, logs, strict=True)):
        env = {
            **ENV,
            "DSKIT_SM_BASE": str(base),
            "DSKIT_SM_MASTER_PORT": str(port),
            "DSKIT_SM_CPU_RANKS": "1",
            "SM_NUM_GPUS": "0",
            "SM_NUM_CPUS": "1",
            # DeepSpeed's ops as `make warm` built them, not rebuilt in each instance's tree (minutes)
            "TORCH_EXTENSIONS_DIR": os.environ.get(
                "TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")
            ),
        }
        with log.open("a") as out:
            procs.append(
                subprocess.Popen(
                    entry_command(base, model_volume if i == 0 else None),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def wait_for(pattern: str, log: Path, procs: list[subprocess.Popen], timeout: float = 150) -> float:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text()):
        if any(p.poll() is not None for p in procs):  # read once more: it may have printed it and finished
            text = log.read_text()
            assert re.search(pattern, text), f"exited without {pattern!r}: " + text[-4000:]
            break
        assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s: " + log.read_text()[-4000:]
        time.sleep(0.1)
    return time.monotonic()


def sync_checkpoints(bases: list[Path]) -> None:
    """SageMaker's checkpoint sync across a restart: the union of every instance's checkpoints/ on each."""
    union = bases[0].parent / "s3-checkpoints"
    for base in bases:
        shutil.copytree(base / "checkpoints", union, dirs_exist_ok=True)
    for base in bases:
        shutil.copytree(union, base / "checkpoints", dirs_exist_ok=True)


def kill_leftovers(root: Path) -> None:
    """After a failure: every process of this test (entries, torchruns, ranks), found by its base dir."""
    for stat in Path("/proc").glob("[0-9]*/environ"):
        try:
            mine = f"DSKIT_SM_BASE={root}".encode() in stat.read_bytes()
        except OSError:
            continue
        if mine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kill_leftovers(tmp_path)


def test_two_instances_train_stop_on_sigterm_resume_and_export(work: Path) -> None:
    tmp_path = work
    model = save_tiny_qwen3(tmp_path / "hf-model")
    hps = {
        "max_steps": str(MAX_STEPS), "seq_length": "32", "logging_freq": "1", "checkpoint_freq": "1000",
        "validation_freq": "1000",
    }  # fmt: skip
    bases = [tmp_path / f"instance{i}" / "opt-ml" for i in range(2)]
    for base, host in zip(bases, HOSTS, strict=True):
        instance_tree(base, host, model, hps)
    logs = [tmp_path / f"instance{i}.log" for i in range(2)]

    (bases[0] / "model").mkdir()
    volume = tmp_path / "model-volume" if MOUNTS_MODEL_DIR else None
    model_dir = volume or bases[0] / "model"  # where the first host's model/ files land
    started = time.monotonic()
    procs = start(bases, free_port(), logs, volume)
    first_step = wait_for(r"Step 1/", logs[0], procs)
    wait_for(r"Step 3/", logs[0], procs)
    signalled = time.monotonic()
    for proc in procs:  # SageMaker stops every instance's container
        proc.send_signal(signal.SIGTERM)
    assert [p.wait(timeout=120) for p in procs] == [143, 143], logs[0].read_text()[-4000:]
    stopped = time.monotonic()
    first = logs[0].read_text()
    saved = int(re.search(r"Preempted: stop requested by \S+; saved at step (\d+)", first)[1])  # type: ignore[index]
    assert 3 <= saved < MAX_STEPS
    tag = f"model-{saved}steps"  # the model's short name is its channel dir's
    # No shared filesystem: the first host committed the tag, the other kept its rank's files in staging.
    assert (bases[0] / "checkpoints" / tag / "dskit_manifest.json").is_file()
    assert (bases[1] / "checkpoints" / f".staging-{tag}" / "rng_state_rank1.pt").is_file()
    assert not list(model_dir.iterdir())  # stopped: nothing exported

    sync_checkpoints(bases)
    restarted = time.monotonic()
    procs = start(bases, free_port(), logs, volume)
    resumed = wait_for(rf"Resumed from .*{tag} at step {saved} ", logs[0], procs)
    assert [p.wait(timeout=180) for p in procs] == [0, 0], logs[0].read_text()[-4000:]
    finished = time.monotonic()
    second = logs[0].read_text()[len(first) :]
    assert f"merged 2 files of other hosts into {tag}" in second  # rank 1's optimizer shard and RNG state
    assert f"gathered 2 files of other hosts into model-{MAX_STEPS}steps" in second
    assert f"Step {saved + 1}/{MAX_STEPS}" in second and f"Step {MAX_STEPS}/{MAX_STEPS}" in second
    assert f"Step {saved}/" not in second  # continued, not repeated
    # Into model/ itself (a mount point: never removed or renamed), staged on the ML volume, which keeps nothing.
    exported_line = re.search(
        r"exported the newest verified checkpoint to (\S+) in ([\d.]+) s \(([\d.]+) MB", second
    )
    assert exported_line and exported_line[1] == str(bases[0] / "model"), second[-3000:]
    assert not list((bases[0] / "input" / "dskit" / "export").iterdir())

    import torch
    from transformers import AutoModelForCausalLM

    assert (model_dir / "config.json").is_file() and not list(model_dir.glob(".*"))
    if volume is not None:
        assert not list((bases[0] / "model").iterdir())  # the files went to the mount, not under it
    exported = AutoModelForCausalLM.from_pretrained(model_dir)
    initial = AutoModelForCausalLM.from_pretrained(model)
    assert exported.config.model_type == "qwen3"
    assert exported.state_dict().keys() == initial.state_dict().keys()
    assert any(
        not torch.equal(p, initial.state_dict()[k]) for k, p in exported.state_dict().items()
    )  # trained
    assert not list((bases[1] / "model").iterdir())  # one host writes the model: no clashing names in S3

    # SageMaker's metric regexes find the rank-0 lines, and the metrics file went to output/data.
    found = {m["Name"]: re.findall(m["Regex"], first + second) for m in sagemaker.METRIC_DEFINITIONS}
    assert len(found["train:loss"]) == MAX_STEPS and len(found["validation:loss"]) == 1, found
    assert list((bases[0] / "output" / "data").glob("*.metrics.jsonl"))
    print(
        f"\ntimings: start to first step {first_step - started:.1f} s, SIGTERM to saved and stopped "
        f"{stopped - signalled:.1f} s, restart to resumed step {resumed - restarted:.1f} s, restart to exported "
        f"model {finished - restarted:.1f} s, total {finished - started:.1f} s; export {exported_line[2]} s, "
        f"{exported_line[3]} MB into model/{' (a mount)' if volume else ''}",
        file=sys.stderr,
    )


def test_the_failure_reason_is_the_kits_own_error_line(work: Path) -> None:
    """Three bad inputs, each a one-host job (run side by side): output/failure, the job's FailureReason, is the
    kit's `error:` line, whether the entry or a rank found the mistake."""
    model = save_tiny_qwen3(work / "hf-model")
    cases = ("no-train-files", "mixed-types", "pipe-mode")
    bases = [work / case / "opt-ml" for case in cases]
    for base in bases:
        instance_tree(base, HOSTS[0], model, {"max_steps": "2", "seq_length": "32"}, hosts=HOSTS[:1])
    train = [base / "input" / "data" / "train" for base in bases]
    shutil.rmtree(train[0])  # a channel with nothing downloaded (Pipe mode leaves no files there)
    (train[1] / "part-1.jsonl.gz").write_bytes(gzip.compress(b'{"text": "more"}\n'))
    config = bases[2] / "input" / "config" / "inputdataconfig.json"
    config.write_text(
        json.dumps({"model": {"TrainingInputMode": "File"}, "train": {"TrainingInputMode": "Pipe"}})
    )
    logs = [work / f"{case}.log" for case in cases]
    procs = [start([base], free_port(), [log])[0] for base, log in zip(bases, logs, strict=True)]
    statuses = [p.wait(timeout=150) for p in procs]
    reasons = [(base / "output" / "failure").read_text() for base in bases]
    assert statuses == [1, 1, 2], [log.read_text()[-2000:] for log in logs]
    assert reasons == [
        f"error: dataset path {train[0]} does not exist: check --dataset (or --local_dataset false for a hub name)",
        f"error: dataset dir {train[1]} mixes file types ['.jsonl', '.jsonl.gz']: keep one kind per dataset",
        "error: channel train is in Pipe input mode, which the kit cannot read (it reads files): submit the job "
        "with input_mode File or FastFile in the values file",
    ], reasons
    for reason, log in zip(reasons, logs, strict=True):
        assert reason in log.read_text()  # the same line the job's log shows
    print("\nfailure reasons:\n" + "\n".join(reasons), file=sys.stderr)
