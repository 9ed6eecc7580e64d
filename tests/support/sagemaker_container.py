"""The SageMaker entry run the way a training job's container runs it, on this machine.

Each "instance" gets its own /opt/ml-like tree (no shared filesystem) and runs the job's command (the bootstrap
shell, sagemaker.BOOTSTRAP, which starts `python3 -m dskit.sagemaker.entry`) as PID 1 of a PID namespace of its
own (the job's exec-form entrypoint), in a private mount namespace where model/ is a mount point of its own (a
tmpfs), so the platform's rules hold here too: the kernel drops a signal that PID 1 has no handler for, and
model/ can be neither removed nor renamed (EBUSY). The code channel holds an empty source tarball: the entry runs
from this checkout (PYTHONPATH), and `python3` on PATH is the given interpreter. `stop` sends SIGTERM from
outside the namespace to PID 1's host pid, as StopTrainingJob does. Needs root (unshare, mount).

    containers = start_instances(bases, port, logs)   # one per host, HOSTS[i] in bases[i]
    containers[0].wait_for(r"Step 2/")
    for c in containers: c.stop()
    assert [c.wait() for c in containers] == [143, 143]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from dskit import sagemaker
from model_utils.launch import preemption
from support.torchrun import ENV, REPO

HOSTS = ["127.0.0.1", "localhost"]  # both name this machine: the first is the master's address
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
# PID 1 of the namespace: mount model/ as its own filesystem, then become the job's command (same pid: exec): a
# tmpfs, or a dir outside bind-mounted there (its files outlive the container, as a job's model.tar.gz does).
MOUNTED_MODEL = 'mount -t tmpfs -o size=256m dskit-model "$1" && shift && exec "$@"'
BOUND_MODEL = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
PLAIN_MODEL = 'shift && exec "$@"'


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
    (config / "hyperparameters.json").write_text(
        json.dumps(hyperparameters)
    )  # values are strings, as SageMaker's
    (config / "inputdataconfig.json").write_text(
        json.dumps({c: {"TrainingInputMode": "File"} for c in ("model", "train", "validation")})
    )
    data = base / "input" / "data"
    shutil.copytree(model, data / "model")
    write_dataset(data / "train", 400, seed=0)
    write_dataset(data / "validation", 20, seed=1)


def entry_env(base: Path, port: int, **extra: str) -> dict[str, str]:
    return {
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
        **extra,
    }


def _job_command_inputs(base: Path, python: str, start_delay_s: float) -> Path:
    """The code channel's (empty) source tarball, and a bin dir whose `python3` is `python` (started after
    start_delay_s: a slow interpreter start, the moment before the entry's handler exists made wide)."""
    code = base / "input" / "data" / "code"
    code.mkdir(parents=True, exist_ok=True)
    with tarfile.open(code / sagemaker.SOURCE_ARCHIVE, "w:gz"):
        pass
    bin_dir = base.parent / "image-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nsleep {start_delay_s}\nexec {python} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    return bin_dir


class Container:
    """One instance's job command as PID 1 (`host_pid` outside the namespace), the entry its child."""

    def __init__(
        self,
        base: Path,
        env: dict[str, str],
        log: Path,
        python: str = sys.executable,
        model_mount: bool = True,
        model_volume: Path
        | None = None,  # bind-mounted on model/ (else a tmpfs, or a plain dir: model_mount)
        entry_start_delay_s: float = 0.0,
    ) -> None:
        if os.geteuid() != 0:
            raise RuntimeError(
                "the container contract test needs root (unshare --pid, mount): run it as root"
            )
        self.base, self.log = base, log
        (base / "model").mkdir(exist_ok=True)
        script, mount = (MOUNTED_MODEL, []) if model_mount else (PLAIN_MODEL, [])
        if model_volume is not None:
            script, mount = BOUND_MODEL, [str(model_volume)]
        bin_dir = _job_command_inputs(base, python, entry_start_delay_s)
        env = {**env, "PATH": f"{bin_dir}:{env.get('PATH', os.defpath)}"}
        cmd = [
            "unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private",
            "sh", "-c", script, "sh", *mount, str(base / "model"), "bash", "-c", sagemaker.BOOTSTRAP,
        ]  # fmt: skip
        with log.open("a") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.host_pid = self._forked_child()
        self.stopped_at: float | None = None
        self.exited_at: float | None = None

    def _forked_child(self) -> int:
        """unshare --fork's child: PID 1 inside, this pid outside."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = children.read_text().split() if children.exists() else []
            if pids:
                return int(pids[0])
            assert self.proc.poll() is None, f"unshare exited {self.proc.returncode}: {self.log.read_text()}"
            time.sleep(0.005)
        raise AssertionError("unshare started no child within 10 s")

    def entry_pid(self) -> int | None:
        """The entry (the child of PID 1 with the argument dskit.sagemaker.entry: not the shell's fork before its
        exec), once the bootstrap started it."""
        for child in _children(self.host_pid):
            with contextlib.suppress(OSError):
                if b"dskit.sagemaker.entry" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                    return child
        return None

    def handles_stop(self) -> bool:
        """Whether the entry has its SIGTERM handler (before that, the bootstrap holds a stop)."""
        entry = self.entry_pid()
        return entry is not None and preemption.catches(entry, signal.SIGTERM)

    def ranks(self) -> list[int]:
        """The ranks (children of the entry's torchrun) running now."""
        entry = self.entry_pid()
        return [rank for torchrun in _children(entry) for rank in _children(torchrun)] if entry else []

    def starting_rank(self) -> int | None:
        """A rank that does not handle USR1 yet, if there is one now."""
        return next((r for r in self.ranks() if not preemption.catches(r, signal.SIGUSR1)), None)

    def wait_for(self, pattern: str, timeout: float = 150, offset: int = 0) -> float:
        """Until the log (from offset) matches; the time it did."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.log.read_text()[offset:]):
            text = self.log.read_text()[offset:]
            assert self.proc.poll() is None or re.search(pattern, text), (
                f"exited without {pattern!r}: {text[-4000:]}"
            )
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s: {text[-4000:]}"
            time.sleep(0.05)
        return time.monotonic()

    def stop(self) -> None:
        """StopTrainingJob: SIGTERM to the container's PID 1, from outside its namespace."""
        self.stopped_at = self.stopped_at or time.monotonic()
        os.kill(self.host_pid, signal.SIGTERM)

    def wait(self, timeout: float = 120) -> int:
        """The entry's exit status (unshare passes it on)."""
        status = self.proc.wait(timeout=timeout)
        self.exited_at = time.monotonic()
        return status

    def stop_to_exit_s(self) -> float:
        assert self.stopped_at is not None and self.exited_at is not None
        return self.exited_at - self.stopped_at

    def kill(self) -> None:
        """PID 1 gone takes every process of its namespace along (torchrun, the ranks)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.host_pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    except OSError:  # it ended meanwhile (e.g. a short-lived child of the entry's): no children
        return found
    for task in tasks:
        with contextlib.suppress(OSError):
            found += [int(child) for child in task.read_text().split()]
    return found


def start_instances(
    bases: list[Path],
    port: int,
    logs: list[Path],
    model_mount: bool = True,
    model_volume: Path | None = None,  # the first host's model/ (SageMaker uploads that host's model only)
    entry_start_delay_s: float = 0.0,
    **extra_env: str,
) -> list[Container]:
    return [
        Container(
            base,
            entry_env(base, port, **extra_env),
            log,
            model_mount=model_mount,
            model_volume=model_volume if i == 0 else None,
            entry_start_delay_s=entry_start_delay_s,
        )
        for i, (base, log) in enumerate(zip(bases, logs, strict=True))
    ]
