"""The SageMaker entry's contract end to end on CPU: two "instances" as two entry processes on loopback, each its
container's PID 1 (support/sagemaker_container.py) with its own /opt/ml-like tree (no shared filesystem, like
SageMaker), channels holding a Hugging Face model dir and a dataset. SIGTERM mid-run, during a periodic save
(what StopTrainingJob or a spot interruption sends) -> both save and stop at one step; SageMaker's checkpoint sync
(every instance's checkpoints/ up to one S3 prefix, the union down to every instance of the restarted job) is
simulated by a directory union; the restart resumes from the newest verified tag, finishes, and the first host
exports the model into model/ (a bind mount of its own, as on SageMaker), which from_pretrained loads. Three bad
inputs end with the kit's error line as the job's FailureReason.

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
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dskit import sagemaker
from support import step_control
from support.ports import free_port
from support.pretrained import save_tiny_qwen3
from support.sagemaker_container import HOSTS, Container, instance_tree, start_instances

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

MAX_STEPS = 16  # the stop lands in the step-3 save: the restart trains the rest


def start(
    bases: list[Path], port: int, logs: list[Path], model_volume: Path | None = None, **env: str
) -> list[Container]:
    # Each entry as its container's PID 1; the first host's model/ a bind mount of model_volume (its files outlive
    # the container, as the job's model.tar.gz does), the others' a tmpfs of their own.
    return start_instances(bases, port, logs, model_volume=model_volume, **env)


def wait_for(pattern: str, log: Path, procs: list[Container], timeout: float = 150) -> float:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text()):
        if any(
            p.proc.poll() is not None for p in procs
        ):  # read once more: it may have printed it and finished
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
        "max_steps": str(MAX_STEPS), "seq_length": "32", "logging_freq": "1", "checkpoint_freq": "3",
        "validation_freq": "1000", "observers": step_control.FLAGS[1],
    }  # fmt: skip
    bases = [tmp_path / f"instance{i}" / "opt-ml" for i in range(2)]
    for base, host in zip(bases, HOSTS, strict=True):
        instance_tree(base, host, model, hps)
    logs = [tmp_path / f"instance{i}.log" for i in range(2)]
    volume = tmp_path / "model-volume"  # where the first host's model/ files land
    volume.mkdir()

    started = time.monotonic()
    holds = tmp_path / "holds"  # each rank holds as its step-3 save starts, until the stop reaches it
    procs = start(bases, free_port(), logs, volume, **step_control.env("checkpoint@3", holds))
    first_step = wait_for(r"Step 1/", logs[0], procs)
    step_control.wait_held(holds, "checkpoint@3", alive=lambda: all(p.proc.poll() is None for p in procs))
    signalled = time.monotonic()
    for proc in procs:  # SageMaker stops every instance's container
        proc.stop()
    assert [p.wait(timeout=120) for p in procs] == [143, 143], logs[0].read_text()[-4000:]
    stopped = time.monotonic()
    assert sorted(p.name for p in holds.iterdir()) == [
        "held-checkpoint@3-0",
        "held-checkpoint@3-1",
        "released-checkpoint@3-0",
        "released-checkpoint@3-1",
    ]
    first = logs[0].read_text()
    # By "SIGUSR1" where this host's rank got its signal first, by "another rank" where the other host's did.
    preempted = re.search(r"Preempted: stop requested by (SIGUSR1|another rank); saved at step (\d+)", first)
    assert preempted, first[-4000:]
    saved = int(preempted[2])
    assert saved == 4  # the step-3 save went on; the next step's collective carried the stop to every rank
    tag = f"model-{saved}steps"  # the model's short name is its channel dir's
    # No shared filesystem: the first host committed the tag, the other kept its rank's files in staging.
    assert (bases[0] / "checkpoints" / tag / "dskit_manifest.json").is_file()
    # The periodic save the stop came in (step 3) finished and verifies too.
    assert (bases[0] / "checkpoints" / "model-3steps" / "dskit_manifest.json").is_file()
    assert (bases[1] / "checkpoints" / f".staging-{tag}" / "rng_state_rank1.pt").is_file()
    assert not list(volume.iterdir())  # stopped: nothing exported

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
    assert (volume / "config.json").is_file() and not list(volume.glob(".*"))
    assert not list((bases[0] / "model").iterdir())  # the files went to the mount, not under it

    import torch
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(volume)
    initial = AutoModelForCausalLM.from_pretrained(model)
    assert exported.config.model_type == "qwen3"
    assert exported.state_dict().keys() == initial.state_dict().keys()
    assert any(
        not torch.equal(p, initial.state_dict()[k]) for k, p in exported.state_dict().items()
    )  # trained
    # One host writes the model (no clashing names in S3); the other's model/ was a tmpfs, gone with its container.

    # SageMaker's metric regexes find the rank-0 lines, and the metrics file went to output/data.
    found = {m["Name"]: re.findall(m["Regex"], first + second) for m in sagemaker.METRIC_DEFINITIONS}
    assert len(found["train:loss"]) == MAX_STEPS and len(found["validation:loss"]) == 1, found
    assert list((bases[0] / "output" / "data").glob("*.metrics.jsonl"))
    print(
        f"\ntimings: start to first step {first_step - started:.1f} s, SIGTERM to saved and stopped "
        f"{stopped - signalled:.1f} s, restart to resumed step {resumed - restarted:.1f} s, restart to exported "
        f"model {finished - restarted:.1f} s, total {finished - started:.1f} s; export {exported_line[2]} s, "
        f"{exported_line[3]} MB into model/ (a mount)",
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
