"""launcher/stop.py with real processes: a launcher that starts ranks as torchrun does (`<python> -u
src/train_deepspeed.py`), ranks that take a stop as preemption.install makes them (a USR1 and SIGINT handler),
and the stop signals sent as a terminal and SLURM send them. The launchers with real ranks:
tests/e2e/test_interrupt.py, tests/slurm/test_slurm.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dskit.launcher import stop
from model_utils import processes

REPO = Path(__file__).resolve().parents[4]

# A rank: handles a stop once its start-up (argv[2] seconds) is over, says so, and exits; or keeps running after
# it (argv[3] == "stays", a rank in its save); rank 0 writes the stop's reason once "saved" (the trainer does).
RANK = """
import os, signal, sys, time
from pathlib import Path
out, startup, after = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(startup)
got = []
for sig in (signal.SIGUSR1, signal.SIGINT):
    signal.signal(sig, lambda signum, frame: got.append(signal.Signals(signum).name))
(out / f"ready-{os.getpid()}").write_text("")
while not got:
    time.sleep(0.02)
(out / f"got-{os.getpid()}").write_text(got[0])
if os.environ.get("RANK") == "0" and after == "saves":
    Path(os.environ["DSKIT_STOP_REASON_FILE"]).write_text("interrupted\\n")
while after != "exits":
    time.sleep(0.1)
"""
# A launcher: the ranks as its children, its status theirs (argv[4]: its own status instead).
LAUNCHER = """
import os, subprocess, sys
ranks = [
    subprocess.Popen([sys.executable, "-u", "src/train_deepspeed.py", *sys.argv[1:4]], env={**os.environ, "RANK": str(r)})
    for r in range(2)
]
status = max(rank.wait() for rank in ranks)
sys.exit(int(sys.argv[4]) if len(sys.argv) > 4 else status)
"""


class Launch:
    """`python3 -m dskit.launcher.stop run` of the launcher above, in tmp_path (its own session, like a terminal's
    foreground job)."""

    def __init__(
        self, tmp_path: Path, startup: float = 0.0, after: str = "exits", status: str | None = None
    ) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir()
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "train_deepspeed.py").write_text(RANK)
        (tmp_path / "launcher.py").write_text(LAUNCHER)
        args = [str(self.out), str(startup), after, *([status] if status else [])]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dskit.launcher.stop", "run", sys.executable, "launcher.py", *args],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO / "src"), "TMPDIR": str(tmp_path)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.started = self.proc.stdout.readline()

    def wait_for(self, what: str, check: Callable[[], object], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline and self.proc.poll() is None, f"no {what}"
            time.sleep(0.02)

    def ranks(self, kind: str) -> dict[int, str]:
        return {int(p.name.split("-")[1]): p.read_text() for p in self.out.glob(f"{kind}-*")}

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def end(self) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=60)
        return self.proc.returncode, self.started + out


def test_ctrl_c_reaches_the_ranks_and_the_launch_exits_130(tmp_path: Path) -> None:
    launch = Launch(tmp_path)
    assert launch.started == (
        f"Ranks started: Ctrl-C here or `kill -USR1 {launch.proc.pid}` saves a checkpoint and stops them\n"
    )
    launch.wait_for("ranks", lambda: len(launch.ranks("ready")) == 2)
    launch.signal(signal.SIGINT)
    status, out = launch.end()
    assert status == 130, out  # as for any command a Ctrl-C ended
    assert "SIGINT" in launch.ranks("got").values()  # one is enough: the ranks agree after each step
    assert list(tmp_path.glob("dskit-stop-reason-*")) == []  # its temporary file removed


def test_usr1_to_the_pid_it_names_stops_the_ranks_with_the_launchers_status(tmp_path: Path) -> None:
    launch = Launch(tmp_path)
    launch.wait_for("ranks", lambda: len(launch.ranks("ready")) == 2)
    launch.signal(signal.SIGUSR1)
    assert launch.end()[0] == 0
    assert "SIGUSR1" in launch.ranks("got").values()


def test_a_stop_before_any_rank_takes_it_is_sent_again_until_one_does(tmp_path: Path) -> None:
    """A rank still starting would die of USR1 (or raise KeyboardInterrupt): the stop waits until one handles it."""
    launch = Launch(tmp_path, startup=2.0)
    launch.signal(signal.SIGINT)  # as the launcher starts the ranks
    status, out = launch.end()
    assert status == 130, out
    assert "SIGINT" in launch.ranks("got").values()


@pytest.mark.parametrize(
    ("after", "said"),
    [
        ("stays", "aborted (Ctrl-C again): the ranks are stopped without saving"),
        (
            "saves",
            "Ctrl-C again: the ranks had saved their checkpoint already and were ending: ended them now",
        ),
    ],
)
def test_a_second_ctrl_c_ends_the_ranks_and_the_launcher_at_once(
    tmp_path: Path, after: str, said: str
) -> None:
    launch = Launch(tmp_path, after=after)
    launch.wait_for("ranks", lambda: len(launch.ranks("ready")) == 2)
    launch.signal(signal.SIGINT)
    launch.wait_for("the stop", lambda: launch.ranks("got"))
    if after == "saves":
        launch.wait_for(
            "the save", lambda: any(p.stat().st_size for p in tmp_path.glob("dskit-stop-reason-*"))
        )
    launch.signal(signal.SIGINT)
    status, out = launch.end()
    assert status == 130
    assert out.splitlines()[-1] == said, out
    assert not any(processes.running(pid) for pid in launch.ranks("ready")), "a rank outlived the abort"


@pytest.mark.parametrize(("status", "expected"), [("3", 3), ("0", 0)])
def test_the_launchers_status_is_its_own_without_a_stop(tmp_path: Path, status: str, expected: int) -> None:
    launch = Launch(tmp_path, status=status)
    launch.wait_for("ranks", lambda: len(launch.ranks("ready")) == 2)
    for pid in launch.ranks("ready"):
        os.kill(pid, signal.SIGTERM)  # the ranks end on their own
    assert launch.end()[0] == expected


def test_forward_sends_usr1_to_this_jobs_ranks_on_this_node_only(tmp_path: Path) -> None:
    """train.sbatch's USR1, on each node (srun): the ranks of this SLURM job, never another job's on a shared node."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train_deepspeed.py").write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()
    ranks = {
        job: subprocess.Popen(
            [sys.executable, "-u", "src/train_deepspeed.py", str(out), "0", "exits"],
            cwd=tmp_path,
            env={**os.environ, "SLURM_JOB_ID": job},
        )
        for job in ("7", "8")
    }
    try:
        deadline = time.monotonic() + 30
        while len(list(out.glob("ready-*"))) < 2:
            assert time.monotonic() < deadline, "no ranks"
            time.sleep(0.02)
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "SLURM_JOB_ID": "7"}
        subprocess.run(
            [sys.executable, "-m", "dskit.launcher.stop", "forward"], env=env, check=True, timeout=60
        )
        assert ranks["7"].wait(timeout=30) == 0
        assert (out / f"got-{ranks['7'].pid}").read_text() == "SIGUSR1"
        assert ranks["8"].poll() is None  # another job's rank: untouched
    finally:
        for rank in ranks.values():
            rank.kill()
            rank.wait()


def test_a_rank_is_what_torchrun_starts() -> None:
    assert stop.is_rank(["/x/.venv/bin/python", "-u", "src/train_deepspeed.py", "--max_steps", "5"])
    assert stop.is_rank(["python3.11", "-u", "/repo/src/train_deepspeed.py"])
    # torchrun's, srun's and the launchers' own command lines name the script too, never so
    assert not stop.is_rank(
        ["/x/python", "-m", "model_utils.launch.supervise", "--standalone", "src/train_deepspeed.py"]
    )
    assert not stop.is_rank(["srun", "-u", "src/train_deepspeed.py"])
    assert not stop.is_rank(["python"])
