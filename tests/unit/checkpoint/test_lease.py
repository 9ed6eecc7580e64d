"""One run per checkpoint dir: a second live run refused in one line naming the holder, a stale or requeued
holder taken over with one line, release at exit (normal or error), renewals, and the preflight's check that
touches nothing. Two real processes where it matters; the e2e launch is in tests/e2e/test_checkpoints.py."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model_utils.checkpoint import lease
from model_utils.errors import ConfigError

# A process that takes the lease, says so, and holds it until its stdin closes (then exits normally).
HOLDER_SCRIPT = """
import sys
from pathlib import Path
from model_utils.checkpoint import lease
held = lease.acquire(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()
held.release()
"""


def _holder_process(checkpoint_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(checkpoint_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _write_lease(checkpoint_dir: Path, **fields) -> lease.Holder:
    now = time.time()
    defaults = {"host": "other-node", "pid": 4242, "slurm_job_id": None, "sagemaker_job": None}
    holder = dataclasses.replace(
        lease.Holder.of_this_process(now), started=now - 3600, **{**defaults, **fields}
    )
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / lease.LEASE_FILE).write_text(holder.to_json())
    return holder


@pytest.fixture(autouse=True)
def _no_job(monkeypatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TRAINING_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)


def test_a_second_process_is_refused_naming_the_holder_until_the_first_exits(tmp_path: Path) -> None:
    first = _holder_process(tmp_path, env={**_env(), "SLURM_JOB_ID": "777"})
    try:
        record = json.loads((tmp_path / lease.LEASE_FILE).read_text())
        assert record["pid"] == first.pid and record["slurm_job_id"] == "777"
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(ConfigError) as refused:
            lease.acquire(tmp_path)
        line = str(refused.value)
        assert "\n" not in line
        assert f"checkpoint dir {tmp_path} is in use by another run" in line
        assert f"host {socket.gethostname()}, pid {first.pid}, SLURM job 777, since " in line
        assert "give this run its own --checkpoint_dir" in line
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing touched, no temp left
    finally:
        assert first.stdin is not None
        first.stdin.close()
        assert first.wait(timeout=30) == 0
    assert not (tmp_path / lease.LEASE_FILE).exists()  # released at its exit
    lease.acquire(tmp_path).release()


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_a_killed_holder_on_this_host_is_taken_over_at_once(tmp_path: Path, capsys) -> None:
    holder = _holder_process(tmp_path)
    holder.kill()  # kill -9: no release
    holder.wait(timeout=30)
    assert (tmp_path / lease.LEASE_FILE).exists()
    taken = lease.acquire(tmp_path)
    try:
        out = capsys.readouterr().out
        assert f"Taking over the lease on checkpoint dir {tmp_path}" in out
        assert f"its process {holder.pid} on this host is gone" in out
        assert json.loads((tmp_path / lease.LEASE_FILE).read_text())["token"] == taken.holder.token
    finally:
        taken.release()


def test_a_live_holder_elsewhere_is_refused_until_its_heartbeat_is_stale(tmp_path: Path, capsys) -> None:
    _write_lease(tmp_path, heartbeat=time.time() - lease.STALE_AFTER_S / 2)
    with pytest.raises(ConfigError, match="host other-node, pid 4242, no job id"):
        lease.acquire(tmp_path)
    _write_lease(tmp_path, heartbeat=time.time() - lease.STALE_AFTER_S - 5)
    taken = lease.acquire(tmp_path)
    taken.release()
    out = capsys.readouterr().out
    assert "from host other-node, pid 4242" in out and "its last heartbeat was" in out
    assert list(tmp_path.iterdir()) == []  # the old lease moved away and removed, ours released


@pytest.mark.parametrize(
    ("held_job", "held_restarts", "my_job", "my_restarts", "allowed"),
    [
        ("100", 0, "100", 1, True),  # SLURM requeued the job
        ("100", 2, "100", 3, True),
        ("100", 1, "100", 1, False),  # the same job's run, launched twice
        ("100", 0, "200", 1, False),  # another job
    ],
)
def test_a_slurm_requeue_takes_the_lease_over_and_another_job_does_not(
    tmp_path: Path, monkeypatch, held_job, held_restarts, my_job, my_restarts, allowed, capsys
) -> None:
    _write_lease(tmp_path, heartbeat=time.time(), slurm_job_id=held_job, slurm_restart_count=held_restarts)
    monkeypatch.setenv("SLURM_JOB_ID", my_job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(my_restarts))
    if not allowed:
        with pytest.raises(ConfigError, match=f"SLURM job {held_job}, since"):
            lease.acquire(tmp_path)
        lease_text = (tmp_path / lease.LEASE_FILE).read_text()
        assert json.loads(lease_text)["host"] == "other-node"  # untouched
        return
    taken = lease.acquire(tmp_path)
    try:
        assert f"SLURM requeued job {my_job} (restart {my_restarts})" in capsys.readouterr().out
        assert json.loads((tmp_path / lease.LEASE_FILE).read_text())["slurm_restart_count"] == my_restarts
    finally:
        taken.release()


def test_a_restarted_sagemaker_job_takes_the_lease_over(tmp_path: Path, monkeypatch, capsys) -> None:
    _write_lease(tmp_path, heartbeat=time.time(), sagemaker_job="job-a")
    monkeypatch.setenv("TRAINING_JOB_NAME", "job-b")
    with pytest.raises(ConfigError, match="SageMaker job job-a"):
        lease.acquire(tmp_path)
    monkeypatch.setenv("TRAINING_JOB_NAME", "job-a")
    lease.acquire(tmp_path).release()
    assert "SageMaker restarted training job job-a" in capsys.readouterr().out


def test_an_unreadable_lease_counts_as_stale(tmp_path: Path) -> None:
    (tmp_path / lease.LEASE_FILE).write_text('{"host": "torn')
    lease.acquire(tmp_path).release()
    assert not (tmp_path / lease.LEASE_FILE).exists()


def test_the_heartbeat_renews_and_a_lost_lease_is_said_and_left_alone(tmp_path: Path, capsys) -> None:
    held = lease.acquire(tmp_path, heartbeat_s=0.05)
    try:
        first = held.holder.heartbeat
        deadline = time.time() + 10
        while json.loads((tmp_path / lease.LEASE_FILE).read_text())["heartbeat"] == first:
            assert time.time() < deadline, "no renewal"
            time.sleep(0.02)
        other = _write_lease(tmp_path, heartbeat=time.time())  # taken by another run that judged us gone
        deadline = time.time() + 10
        while held.lost is None:
            assert time.time() < deadline, "the lost lease went unnoticed"
            time.sleep(0.02)
    finally:
        held.release()
    assert "lost the lease on checkpoint dir" in capsys.readouterr().out
    assert json.loads((tmp_path / lease.LEASE_FILE).read_text())["token"] == other.token  # not removed


def test_held_on_main_releases_on_error_and_other_ranks_hold_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), lease.held_on_main(str(tmp_path), True, lambda fn: fn()):
        assert (tmp_path / lease.LEASE_FILE).exists()
        raise RuntimeError("a rank failed")
    assert not (tmp_path / lease.LEASE_FILE).exists()
    with lease.held_on_main(str(tmp_path / "other"), False, lambda fn: None):
        assert not (tmp_path / "other").exists()  # only the main rank takes it


def test_check_free_refuses_a_live_holder_and_touches_nothing(tmp_path: Path) -> None:
    lease.check_free(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()
    _write_lease(tmp_path, heartbeat=time.time())
    with pytest.raises(ConfigError, match="is in use by another run"):
        lease.check_free(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [lease.LEASE_FILE]
    _write_lease(tmp_path, heartbeat=time.time() - lease.STALE_AFTER_S - 1)
    lease.check_free(tmp_path)


def test_a_killed_holder_not_yet_reaped_counts_as_gone(tmp_path: Path) -> None:
    holder = _holder_process(tmp_path)
    holder.kill()
    deadline = time.time() + 10
    while Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline, "never a zombie"
        time.sleep(0.01)
    try:
        lease.acquire(tmp_path).release()  # its parent (this test) has not waited for it yet
    finally:
        holder.wait(timeout=30)


def test_a_run_that_made_the_dir_and_saved_nothing_leaves_no_dir_behind(tmp_path: Path) -> None:
    """A launch refused after taking the lease (a config the ranks reject) must not leave a new empty dir."""
    made = tmp_path / "new" / "ck"
    lease.acquire(made).release()
    assert not made.exists()
    kept = tmp_path / "kept"
    held = lease.acquire(kept)
    (kept / "model-3steps").mkdir()  # a save happened: the dir and its checkpoints stay
    held.release()
    assert sorted(p.name for p in kept.iterdir()) == ["model-3steps"]
    existing = tmp_path / "existing"
    existing.mkdir()
    lease.acquire(existing).release()  # not made by the lease: left as it was
    assert existing.is_dir()


def test_a_launch_takes_the_lease_in_its_preflight_and_its_rank_0_adopts_it(
    tmp_path: Path, monkeypatch
) -> None:
    """The launchers' preflight takes the lease for the launcher (its parent process), not renewed, under the
    launch's token; that launch's rank 0 (the same token) adopts it; another launch is refused meanwhile."""
    ck = tmp_path / "ck"
    monkeypatch.delenv("DSKIT_LEASE_TOKEN", raising=False)
    assert lease.take_for_launch(ck) is None and not ck.exists()  # no launcher's token: only checked
    monkeypatch.setenv("DSKIT_LEASE_TOKEN", "node1-4242-1.5")
    taken = lease.take_for_launch(ck)
    assert taken is not None and taken._thread is None  # nobody renews it: the ranks follow within seconds
    held = json.loads((ck / lease.LEASE_FILE).read_text())
    assert (held["pid"], held["token"]) == (os.getppid(), "node1-4242-1.5")
    # Another launch (another token), in the preflight or on its ranks: refused in one line naming the launcher.
    other = subprocess.run(
        [sys.executable, "-c", HOLDER_SCRIPT, str(ck)],
        input="",
        capture_output=True,
        text=True,
        env={**os.environ, "DSKIT_LEASE_TOKEN": "node1-4343-2.5"},
    )
    assert (
        other.returncode != 0
        and f"pid {os.getppid()}" in other.stderr
        and "in use by another run" in (other.stderr)
    )
    # This launch's rank 0 (this process here) adopts it: held by it now, renewed, released at its end.
    adopted = lease.acquire(ck, heartbeat_s=3600)
    held = json.loads((ck / lease.LEASE_FILE).read_text())
    assert (held["pid"], held["token"]) == (os.getpid(), "node1-4242-1.5")
    adopted.release()
    assert not (ck / lease.LEASE_FILE).exists()


def test_a_preflights_lease_is_released_when_the_launch_stops_before_its_ranks(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("DSKIT_LEASE_TOKEN", "node1-4242-1.5")
    taken = lease.take_for_launch(tmp_path / "new")
    assert taken is not None
    taken.release()
    assert not (tmp_path / "new").exists()  # it made the dir: nothing left
