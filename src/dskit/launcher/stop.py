"""A stop request (Ctrl-C, USR1) handed to the ranks themselves: they save a checkpoint after the step they are in
and exit (model_utils/launch/preemption.py). torchrun (or accelerate) forwards neither: USR1 kills it, and its own
Ctrl-C handling kills the ranks 30 s into their save.

    python3 -m dskit.launcher.stop run LAUNCHER...   # train-singlenode.sh: the launcher, stops handed to its ranks
    python3 -m dskit.launcher.stop forward           # train.sbatch, on each node (srun): USR1 to this job's ranks

`run` starts the launcher in a session of its own (torchrun starts each rank in one of its own too), so the
terminal's SIGINT reaches this process only. It sends SIGINT to the launcher's ranks, which stop as for USR1; USR1
to this process (the pid its `Ranks started` line names) sends USR1. Only to ranks that handle USR1 already
(preemption.install has run; before that SIGINT would be a KeyboardInterrupt); one is enough, the ranks agree
after each step; none yet (still starting): sent again each second. A second Ctrl-C kills the ranks and the
launcher at once, without saving. Its exit status is the launcher's, 130 after a Ctrl-C (as for any command a
Ctrl-C ended); rank 0 writes why it stopped into DSKIT_STOP_REASON_FILE (a temporary file this sets) once its
stop's checkpoint is saved, so a second Ctrl-C says whether the ranks had saved.

`forward` sends USR1 to every rank of this SLURM job on this node (SLURM_JOB_ID in its environment, never
another job's ranks on a shared node), started or not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from dskit.launcher import main
from model_utils import launch_env
from model_utils.errors import ConfigError
from model_utils.launch import preemption

RANK_SCRIPT = "src/train_deepspeed.py"
PROC = Path("/proc")


def is_rank(argv: list[str]) -> bool:
    """`<python> -u src/train_deepspeed.py ...`: a rank as torchrun starts it (torchrun's, srun's and the
    launchers' own command lines name the script too, never so)."""
    return len(argv) > 2 and "python" in argv[0] and argv[1] == "-u" and argv[2].endswith(RANK_SCRIPT)


def _processes() -> Iterator[tuple[int, int, list[str]]]:
    """(pid, parent pid, command line) of every process that can be read."""
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        yield int(entry.name), parent, argv


def children(parent: int) -> list[int]:
    return [pid for pid, ppid, _ in _processes() if ppid == parent]


def ranks(parent: int | None = None, job: str | None = None) -> list[int]:
    """The ranks on this host: the children of `parent`, or this user's ranks of SLURM job `job`."""
    found = []
    for pid, ppid, argv in _processes():
        if not is_rank(argv) or (parent is not None and ppid != parent):
            continue
        if job is not None:
            try:
                mine = (PROC / str(pid)).stat().st_uid == os.getuid()
                environ = (PROC / str(pid) / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if not mine or f"SLURM_JOB_ID={job}".encode() not in environ:
                continue
        found.append(pid)
    return found


def _send(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
    except OSError:
        return False  # ended meanwhile
    return True


class Stopper:
    """The stop signals this process gets while `launcher` runs, handed to its ranks."""

    def __init__(self, launcher: subprocess.Popen[bytes], stop_reason: Path) -> None:
        self.launcher = launcher
        self.stop_reason = stop_reason
        self.interrupts = 0
        self.undelivered: signal.Signals | None = None  # a stop no rank could take yet

    def handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if sig == signal.SIGINT:
            self.interrupts += 1
        if self.interrupts > 1:
            self.abort()
        else:
            self.deliver(sig)

    def deliver(self, sig: signal.Signals) -> None:
        self.undelivered = sig
        for pid in ranks(parent=self.launcher.pid):
            if preemption.catches(pid, signal.SIGUSR1) and _send(pid, sig):
                self.undelivered = None

    def abort(self) -> None:
        saved = self.stop_reason.is_file() and self.stop_reason.stat().st_size > 0
        if saved:
            print(
                "Ctrl-C again: the ranks had saved their checkpoint already and were ending: ended them now"
            )
        else:
            print("aborted (Ctrl-C again): the ranks are stopped without saving")
        sys.stdout.flush()
        # The ranks first (their parent names them), at once with their launcher, so it has no time to report.
        for pid in [*children(self.launcher.pid), self.launcher.pid]:
            _send(pid, signal.SIGKILL)


def run(command: list[str]) -> int:
    fd, name = tempfile.mkstemp(prefix="dskit-stop-reason-")
    os.close(fd)
    stop_reason = Path(name)
    try:
        # Ignored from before the fork: a Ctrl-C must not reach the launcher before it has a session of its own.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        env = {**os.environ, launch_env.STOP_REASON_FILE: name}
        launcher = subprocess.Popen(command, env=env, start_new_session=True)
        stopper = Stopper(launcher, stop_reason)
        for sig in (signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, stopper.handle)
        print(
            f"Ranks started: Ctrl-C here or `kill -USR1 {os.getpid()}` saves a checkpoint and stops them",
            flush=True,
        )
        while True:
            try:
                status = launcher.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if stopper.undelivered is not None:
                    stopper.deliver(stopper.undelivered)
    finally:
        stop_reason.unlink(missing_ok=True)
    if status < 0:
        status = 128 - status  # a signal's end, as a shell reports it
    if stopper.interrupts and (status == 0 or stopper.interrupts > 1):
        return preemption.INTERRUPTED_EXIT
    return status


def forward(job: str) -> None:
    for pid in ranks(job=job):
        _send(pid, signal.SIGUSR1)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["run"] and len(argv) > 1:
        return run(argv[1:])
    if argv == ["forward"] and os.environ.get("SLURM_JOB_ID"):
        forward(os.environ["SLURM_JOB_ID"])
        return 0
    raise ConfigError("usage: python3 -m dskit.launcher.stop run LAUNCHER... | forward (in a SLURM job)")


if __name__ == "__main__":
    try:
        main(_main)
    except KeyboardInterrupt:  # a Ctrl-C before the launcher started: nothing to stop
        sys.exit(preemption.INTERRUPTED_EXIT)
