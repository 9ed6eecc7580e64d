"""Ctrl-C on `./train-singlenode.sh`: a stop request, not a crash.

The launcher runs in a process group of its own here, and SIGINT goes to that whole group, as a terminal sends
it on Ctrl-C (to bash, tee, the preflight, whatever is in the foreground). The ranks (2 CPU ranks of the tiny
default model) must then save a verified checkpoint at the step they agree on, say so in one line and exit
130 without a traceback; a second Ctrl-C aborts at once, without saving, as quietly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from model_utils.checkpoint import protocol
from support import step_control
from support.singlenode import launch_and_interrupt
from support.torchrun import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

INTERRUPTED = re.compile(
    r"interrupted \(Ctrl-C\): saving a checkpoint at step (\d+), then stopping; Ctrl-C again to abort without "
    r"saving"
)


def test_ctrl_c_saves_a_checkpoint_and_stops_quietly(tmp_path: Path) -> None:
    # docs/fsdp.md's `./train-singlenode.sh --backend fsdp`: FSDP2 through the launcher, trained, saved and stopped
    # The Ctrl-C comes as both ranks start step 3 (support/step_control.py), on any machine.
    status, output, _ = launch_and_interrupt(
        tmp_path, f"interrupt-test-{os.getpid()}", lambda group: os.killpg(group, signal.SIGINT),
        "--backend", "fsdp", when="data@3",
    )  # fmt: skip
    assert "Training tiny-qwen3 with FSDP2 for 200 steps" in output, output[-4000:]
    assert status == 130, output[-4000:]
    said = INTERRUPTED.findall(output)
    assert said == ["3"], output[-4000:]  # rank 0's one line: step 3's collective carried the stop
    step = int(said[0])
    target = protocol.newest_verified(tmp_path / "ckpt")
    assert target is not None and protocol.tag_step(target.tag) == step, output[-4000:]
    assert f"stop requested by Ctrl-C; saved at step {step}" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    assert re.search(r"^END \S+ exit status 130$", output, re.M), output[-4000:]


def test_a_second_ctrl_c_aborts_at_once_without_saving(tmp_path: Path) -> None:
    def twice(group: int) -> None:
        os.killpg(group, signal.SIGINT)
        time.sleep(0.5)  # two signals at once would be one to bash, as two keys pressed at once would
        os.killpg(group, signal.SIGINT)

    # The ranks hold as they start step 3 until they have both Ctrl-Cs (support/step_control.py): the second comes
    # while they are still in the step the first one interrupted, before they could start to save, on any machine.
    status, output, seconds = launch_and_interrupt(
        tmp_path, f"abort-test-{os.getpid()}", twice, when="data@3x2"
    )
    assert status == 130, output[-4000:]
    assert "aborted (Ctrl-C again): the ranks are stopped without saving" in output, output[-4000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    assert seconds < 30, f"{seconds:.0f} s from the first Ctrl-C to the exit"
    assert protocol.newest_verified(tmp_path / "ckpt") is None  # nothing saved


def test_a_second_ctrl_c_once_the_ranks_saved_says_so(tmp_path: Path) -> None:
    """A quick second Ctrl-C after the save ("saved at step 3"): the ranks are ending, not stopped without saving;
    the last line says what happened. The ranks hold at their end (after the save) until it comes."""
    job = f"saved-abort-test-{os.getpid()}"

    def twice(group: int) -> None:
        os.killpg(group, signal.SIGINT)
        step_control.wait_held(tmp_path / "holds", "end@3")
        os.killpg(group, signal.SIGINT)

    status, output, _ = launch_and_interrupt(tmp_path, job, twice, when="data@3,end@3x2")
    assert status == 130, output[-4000:]
    assert re.search(r"\| Saved checkpoint \S+/tiny_qwen3-3steps ", output), output[-4000:]
    last = output.rstrip().splitlines()[-2]  # before the END line
    assert (
        last == "Ctrl-C again: the ranks had saved their checkpoint already and were ending: ended them now"
    )
    assert "aborted" not in output and "Traceback" not in output, output[-4000:]
    target = protocol.newest_verified(tmp_path / "ckpt")
    assert target is not None and protocol.tag_step(target.tag) == 3


def test_usr1_to_the_pid_the_log_names_while_the_ranks_start_saves_and_stops(tmp_path: Path) -> None:
    """docs/launchers.md's command for a run without its terminal (the pid from the log's `Ranks started` line),
    sent as that line appears, while torchrun starts the ranks: the launcher's trap holds the stop (Ctrl-C's and
    USR1's alike) until a rank handles it, instead of it being lost or killing a rank in its imports."""
    job = f"usr1-test-{os.getpid()}"

    def usr1_from_the_log(group: int) -> None:
        # tee writes the launcher's output here before it writes the log file: on a busy machine the line can be
        # read here a moment before the file holds it (a person reading the log reads the file itself).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            "kill -USR1 " in log.read_text(errors="replace") for log in (REPO / "logs").glob(f"{job}_*.out")
        ):
            time.sleep(0.05)
        subprocess.run(
            ["bash", "-c", f"kill -USR1 \"$(grep -ho 'kill -USR1 [0-9]*' logs/{job}_*.out | tail -1 | cut -d' ' -f3)\""],
            cwd=REPO, check=True, timeout=30,
        )  # fmt: skip

    status, output, _ = launch_and_interrupt(
        tmp_path, job, usr1_from_the_log, when=re.compile(r"^Ranks started: ")
    )
    assert status == 0, output[-4000:]
    saved = re.findall(r"Preempted: stop requested by SIGUSR1; saved at step (\d+)", output)
    assert len(saved) == 1, output[-4000:]
    target = protocol.newest_verified(tmp_path / "ckpt")
    assert target is not None and protocol.tag_step(target.tag) == int(saved[0]), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
