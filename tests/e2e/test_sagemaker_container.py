"""SageMaker's container contract for stops: both hosts' entries as PID 1 of their own PID namespace with model/ a
mount of its own (support/sagemaker_container.py), SIGTERM from outside (StopTrainingJob) at each moment of a
job: before the entry handles it, before set-up, during set-up (`uv sync` of setup uv), while the ranks start, during the export (during
training and a save: test_sagemaker_job.py's stop, on the same containers). Every one ends in one line and exit 143, never in output/failure; a stop once the ranks run
still saves a checkpoint. Prints each moment's stop-to-exit time.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import step_control
from support.ports import free_port
from support.pretrained import save_tiny_qwen3
from support.sagemaker_container import HOSTS, Container, entry_env, instance_tree, start_instances
from support.torchrun import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

# The observer that paces steps when STEP_CONTROL_SECONDS is set (support/step_control.py): the stops hold at any step time.
HPS = {"seq_length": "32", "logging_freq": "1", "validation_freq": "1000", "observers": step_control.FLAGS[1]}
STOP_LINE = r"\[dskit-sagemaker\] SIGTERM {moment}: stopped"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("hf") / "hf-model")


@pytest.fixture
def job(tmp_path: Path, tiny_model: Path) -> Iterator[JobFactory]:
    factory = JobFactory(tmp_path, tiny_model)
    yield factory
    for container in factory.containers:
        container.kill()


class JobFactory:
    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model = root, model
        self.containers: list[Container] = []

    def bases(self, hps: dict[str, str]) -> list[Path]:
        bases = [self.root / f"instance{i}" / "opt-ml" for i in range(len(HOSTS))]
        for base, host in zip(bases, HOSTS, strict=True):
            instance_tree(base, host, self.model, hps)
        return bases

    def start(self, hps: dict[str, str], entry_start_delay_s: float = 0.0) -> list[Container]:
        bases = self.bases(hps)
        logs = [self.root / f"instance{i}.log" for i in range(len(HOSTS))]
        self.containers = start_instances(bases, free_port(), logs, entry_start_delay_s=entry_start_delay_s)
        return self.containers


def stop_all(containers: list[Container]) -> None:
    for container in containers:  # SageMaker stops every instance's container
        container.stop()


def assert_stopped(containers: list[Container], moment: str) -> None:
    statuses = [c.wait() for c in containers]
    text = containers[0].log.read_text()
    assert statuses == [143, 143], text[-4000:]
    for container in containers:
        log = container.log.read_text()
        assert re.search(moment, log), log[-4000:]
        # A rank that died, or torchrun failing (its exit-barrier noise when the master host ends first is not)
        assert "exitcode" not in log and "torchrun exited" not in log, log[-4000:]
        assert not (container.base / "output" / "failure").exists()  # a stop is not a failure
    took = ", ".join(f"{c.stop_to_exit_s():.1f} s" for c in containers)
    print(f"\nstop-to-exit {moment!r}: {took}", file=sys.stderr)


def test_stop_before_the_entry_handles_it_is_kept_and_exits_at_once(job: JobFactory) -> None:
    """The stop comes the moment the entry exists, before its handler: as PID 1 itself the entry would lose it (the
    kernel drops it); the bootstrap shell, PID 1, holds it until the entry handles SIGTERM. The interpreter starts
    1 s late here, so the stop surely lands in that moment on a loaded machine too."""
    containers = job.start({**HPS, "max_steps": "5"}, entry_start_delay_s=1.0)
    waiting, handled_at_stop = list(containers), []
    while waiting:  # each container stopped the moment its entry exists
        for container in [c for c in waiting if c.entry_pid() is not None]:
            handled_at_stop.append(container.handles_stop())
            container.stop()
            waiting.remove(container)
        assert all(c.proc.poll() is None for c in waiting), [c.log.read_text() for c in waiting]
        time.sleep(0.001)
    assert handled_at_stop == [False, False]  # the moment this test is about
    assert_stopped(containers, STOP_LINE.format(moment="(before|during) set-up"))
    for container in containers:  # nothing was started, nothing written (set-up may have made the dir)
        checkpoints = container.base / "checkpoints"
        assert not (checkpoints.exists() and any(checkpoints.iterdir()))
    assert max(c.stop_to_exit_s() for c in containers) < 6  # the 1 s start included


def test_stop_during_uv_sync_ends_it_and_exits(job: JobFactory, tmp_path: Path) -> None:
    """setup uv: the image's Python (not the kit's venv) runs `uv sync` first; a stop there ends the sync."""
    image_python = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    assert image_python, "a system python3 stands in for the image's"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    syncing = tmp_path / "syncing"
    uv = fake_bin / "uv"
    uv.write_text(f'#!/bin/sh\n[ "$1" = sync ] || exit 0\ntouch {syncing}\nexec sleep 60\n')
    uv.chmod(0o755)
    bases = job.bases({**HPS, "max_steps": "5"})
    env = entry_env(
        bases[0],
        free_port(),
        DSKIT_SM_SETUP="uv",
        PATH=f"{fake_bin}:/usr/bin:/bin",
        PYTHONPATH=str(REPO / "src"),
    )
    container = Container(bases[0], env, tmp_path / "instance0.log", python=image_python)
    job.containers = [container]
    while not syncing.exists():
        assert container.proc.poll() is None, container.log.read_text()
        time.sleep(0.01)
    container.stop()
    assert container.wait(timeout=30) == 143, container.log.read_text()
    log = container.log.read_text()
    assert "installing the locked environment" in log
    assert re.search(STOP_LINE.format(moment="during set-up"), log), log
    assert not (bases[0] / "output" / "failure").exists()
    assert container.stop_to_exit_s() < 5
    print(f"\nstop-to-exit during uv sync: {container.stop_to_exit_s():.1f} s", file=sys.stderr)


def test_stop_while_the_ranks_start_saves_nothing_broken_and_exits_143(job: JobFactory) -> None:
    """The stop comes before any rank handles USR1: it is sent to each rank once it does (it would kill it)."""
    containers = job.start({**HPS, "max_steps": "40", "checkpoint_freq": "1000"})
    deadline = time.monotonic() + 120
    # The moment every host has its ranks and one has not installed its handler yet (USR1 now would kill it:
    # exitcode -10). A host stopped before its ranks exist is the next test's case.
    while not (all(c.ranks() for c in containers) and any(c.starting_rank() for c in containers)):
        for container in containers:
            assert container.proc.poll() is None, container.log.read_text()[-4000:]
        assert time.monotonic() < deadline, "no moment with every host's ranks started and one starting"
        time.sleep(0.002)
    stop_all(containers)
    assert_stopped(containers, r"stopped early .* after SIGTERM")


def test_ranks_left_waiting_for_a_host_that_stopped_are_ended_after_the_grace(
    job: JobFactory, tmp_path: Path
) -> None:
    """The second host stops before its torchrun joins; the first host's torchrun waits for it (its rendezvous
    spawns no rank until every host's has joined, and a rank started would wait in its process group's start,
    where no signal handler runs): the entry ends it DSKIT_SM_STOP_GRACE_S after its own SIGTERM (100 s by
    default, before SageMaker's SIGKILL at 120 s), one line, exit 143."""
    bases = job.bases({**HPS, "max_steps": "40"})
    port = free_port()
    logs = [tmp_path / f"instance{i}.log" for i in range(len(HOSTS))]
    job.containers = start_instances(bases, port, logs, DSKIT_SM_STOP_GRACE_S="3")
    first, second = job.containers
    while not second.handles_stop():
        assert second.proc.poll() is None, second.log.read_text()
        time.sleep(0.005)
    second.stop()
    assert second.wait() == 143, second.log.read_text()
    first.wait_for(r"\[dskit-sagemaker\] host \S+ \(1 of 2\)")  # torchrun starts: waiting for the second host
    time.sleep(1.0)
    first.stop()
    assert first.wait() == 143, first.log.read_text()[-4000:]
    log = first.log.read_text()
    assert "the ranks did not stop within 3 s of SIGTERM" in log, log[-4000:]
    assert not (bases[0] / "output" / "failure").exists()
    assert first.stop_to_exit_s() < 30
    print(
        f"\nstop-to-exit, ranks left waiting for a stopped host: {first.stop_to_exit_s():.1f} s",
        file=sys.stderr,
    )


def test_stop_during_the_export_exits_143_with_the_final_checkpoint_kept(job: JobFactory) -> None:
    containers = job.start({**HPS, "max_steps": "2", "checkpoint_freq": "1000"})
    containers[0].wait_for(r"gathered \d+ files of other hosts")  # the export comes right after this line
    stop_all(containers)
    first_status = containers[0].wait()
    text = containers[0].log.read_text()
    assert first_status == 143, text[-4000:]
    assert re.search(STOP_LINE.format(moment="during the export"), text), text[-4000:]
    assert "Traceback" not in text
    assert (containers[0].base / "checkpoints" / "model-2steps" / "dskit_manifest.json").is_file()
    # The other host had nothing left to do after the gather: it may have finished before the stop came.
    assert containers[1].wait() in (0, 143), containers[1].log.read_text()[-4000:]
    for container in containers:
        assert not (container.base / "output" / "failure").exists()
    landed = sorted(p.name for p in (containers[0].base / "model").iterdir())
    print(
        f"\nstop-to-exit during the export: {containers[0].stop_to_exit_s():.1f} s; model/ holds {landed or 'nothing'}",
        file=sys.stderr,
    )
