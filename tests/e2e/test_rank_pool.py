"""The rank pool (tests/support/rank_pool.py) stands in for torchrun: its ranks must see what torchrun's workers
see, and a failure or a timeout must end a run as torchrun ends it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from support.rank_pool import ENV, run_ranks
from support.torchrun import run_torchrun

pytestmark = pytest.mark.e2e

# What a worker sees: torchrun's variables, its threads, cwd, argv, sys.path[0], unbuffered stdio.
REPORT = """
import json, os, sys
import torch
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "MARKER")
report = {
    "env": {k: os.environ.get(k) for k in keys}, "has_port": os.environ.get("MASTER_PORT", "").isdigit(),
    "threads": torch.get_num_threads(), "cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0],
    "unbuffered": sys.stdout.write_through, "session_leader": os.getsid(0) == os.getpid(),
}
# One write (atomic on a pipe below 4 KiB): print's separate newline let two ranks' lines interleave.
os.write(1, ("REPORT " + json.dumps(report, sort_keys=True) + "\\n").encode())
"""


def reports(out: str) -> list[dict]:
    """Each rank's report, its environment variables among the other keys, in rank order."""
    found = [
        json.loads(line.removeprefix("REPORT ")) for line in out.splitlines() if line.startswith("REPORT ")
    ]
    flat = [{**{k: v for k, v in r.items() if k != "env"}, **r["env"]} for r in found]
    return sorted(flat, key=lambda r: r["RANK"])


@pytest.mark.parametrize("nproc", [1, 2])
def test_ranks_see_what_torchruns_workers_see(tmp_path: Path, nproc: int) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    env = {**ENV, "MARKER": "from the request"}
    env.pop("OMP_NUM_THREADS", None)
    runs = {
        "torchrun": run_torchrun(["a", "--b"], script=script, nproc=nproc, cwd=tmp_path, env=env),
        "pool": run_ranks(["a", "--b"], script=script, nproc=nproc, cwd=tmp_path, env=env),
    }
    for name, proc in runs.items():
        assert proc.returncode == 0, (name, proc.stdout + proc.stderr)
    pool, torchrun = reports(runs["pool"].stdout), reports(runs["torchrun"].stdout)
    assert len(pool) == len(torchrun) == nproc
    for mine, theirs in zip(pool, torchrun, strict=True):
        assert {k: (v, theirs[k]) for k, v in mine.items() if v != theirs[k]} == {}  # (pool, torchrun)
    assert [r["RANK"] for r in pool] == [str(rank) for rank in range(nproc)]
    assert all(r["MARKER"] == "from the request" and r["cwd"] == str(tmp_path) for r in pool)
    assert all(r["has_port"] and r["argv"] == [str(script), "a", "--b"] for r in pool)


FAIL = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("rank 1 fails", file=sys.stderr)
    sys.exit(3)
print("rank 0 waits", flush=True)
time.sleep(120)
"""


def test_a_failing_rank_ends_the_others_as_torchrun_does(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    started = time.monotonic()
    proc = run_ranks([], script=script, cwd=tmp_path)
    assert time.monotonic() - started < 60  # rank 0 did not sleep its 120 s
    assert proc.returncode == 1 and proc.exitcodes == [-15, 3]  # SIGTERM to the survivor (torchrun's close)
    assert "rank 0 waits" in proc.stdout and "rank 1 fails" in proc.stderr


def test_a_run_past_its_timeout_is_killed_and_raises(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(120)\n")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_ranks([], script=script, cwd=tmp_path, timeout=5)
    assert time.monotonic() - started < 60
    assert "started" in expired.value.output
    # One write per rank: the ranks are unbuffered, so print's two writes ("ok", "\n") can interleave
    (tmp_path / "ok.py").write_text("import os\nos.write(1, b'ok\\n')\n")
    after = run_ranks([], script=tmp_path / "ok.py", cwd=tmp_path)  # the pool serves the next run
    assert after.returncode == 0 and after.stdout == "ok\nok\n"
