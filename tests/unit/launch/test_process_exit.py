"""launch.process_exit: a process leaves without the module teardown, but with everything its end is observed
by: non-daemon threads joined, atexit handlers run, stdio flushed, the status given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = """
import atexit, sys, threading, time
from model_utils.launch import process_exit

def late_writer():
    time.sleep(0.3)
    print("thread done", flush=True)

threading.Thread(target=late_writer).start()  # non-daemon: joined before the exit
atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
sys.stdout.write("buffered, no newline")  # flushed on the way out
process_exit.exit_now(7)
print("never")
"""


def test_exit_now_joins_threads_runs_atexit_flushes_and_exits_with_the_status(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    src = Path(__file__).resolve().parents[3] / "src"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(marker)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(src)},
    )
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "buffered, no newlinethread done\n"
    assert marker.read_text() == "atexit ran"
