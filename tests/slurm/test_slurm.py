"""The rendered launchers on a real 2-node SLURM cluster (tests/slurm/cluster.sh), training on CPU.

Slow (minutes: each 2-node job spends ~60 s starting up on 2 shared cores). The nodes share this machine's
filesystem, so jobs run from the repo itself; each test has its own scripts, log and checkpoint dir in tmp_path.
Off Debian or without root the tests skip, except under CI=true, where a skip would hide a broken setup: fail.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import re
import shlex
import shutil
import signal
import string
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dskit import render
from support import step_control
from support.torchrun import ENV

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
# Nodes cannot reach the internet: never let a rank try the hub. tests/ on the path: the observers tests add.
JOB_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ENV["PYTHONPATH"]}
DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but the SLURM tests cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(timing: Callable[[str, float], None]):
    if os.geteuid() != 0:
        _unavailable("the SLURM test cluster needs root (network namespaces, slurmd)")
    if not Path("/etc/debian_version").is_file():
        _unavailable("the SLURM test cluster needs Debian (it installs slurm with apt)")
    start = time.monotonic()
    subprocess.run([str(CLUSTER), "up"], check=True, timeout=900)
    timing("cluster bring-up (cluster.sh up)", time.monotonic() - start)
    yield
    subprocess.run([str(CLUSTER), "down"], check=True, timeout=300)


def wait_for(what: str, timeout: float, check: Callable[[], object], every: float = 0.5) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_field(job_id: str, name: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(rf"\b{name}=(\S+)", out)
    assert match, f"no {name} in scontrol show job {job_id}:\n{out}"
    return match.group(1)


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class Job:
    """One sbatch submission of a freshly rendered train.sbatch (2 nodes, 1 CPU rank per node; `values`: more
    launch values)."""

    def __init__(
        self,
        tmp_path: Path,
        *train_args: str,
        env: dict[str, str] | None = None,
        sbatch_args: tuple[str, ...] = (),
        values: dict[str, object] | None = None,
    ) -> None:
        values = render.LaunchValues(**{"cpu_ranks_per_node": 1, "job_name": "dskit-test", **(values or {})})
        render.write_scripts(render.render_scripts(values), tmp_path)
        self.checkpoints = tmp_path / "ck"
        # The job must be submitted from the repo root: that is how the script finds the repo.
        out = subprocess.run(
            ["sbatch", "--parsable", f"--output={tmp_path}/%x_%j.out", *sbatch_args, str(tmp_path / "train.sbatch"),
             "--checkpoint_dir", str(self.checkpoints), *train_args],
            cwd=REPO, env={**JOB_ENV, **(env or {})}, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        self.id = out.strip().split(";")[0]
        self.log = tmp_path / f"dskit-test_{self.id}.out"
        self.started = time.monotonic()

    def state(self) -> str:
        return job_field(self.id, "JobState")

    def wait_log(self, pattern: str, timeout: float) -> re.Match[str]:
        return wait_for(  # type: ignore[return-value]
            f"/{pattern}/ in {self.log} (job {self.id}: {self.state()})",
            timeout,
            lambda: re.search(pattern, read(self.log), re.MULTILINE),
        )

    def wait_done(self, timeout: float) -> str:
        wait_for(f"job {self.id} to finish", timeout, lambda: self.state() in DONE_STATES, every=2)
        return self.state()

    def text(self) -> str:
        return read(self.log)


def latest_tag(checkpoints: Path) -> str:
    return (checkpoints / "latest").read_text().strip()


def test_sbatch_trains_on_both_nodes_and_usr1_requeues_and_resumes(cluster, tmp_path: Path, timing) -> None:
    """One 2-node job: its first run trains on both nodes until USR1 (checkpoint, stop, requeue); the requeued
    run resumes from that checkpoint and finishes, in the same log, metrics file and MLflow run."""
    logs = tmp_path / "logs"
    # MAX_STEPS comes from the environment (the rendered default's override), the rest from flags.
    holds = tmp_path / "holds"  # both ranks hold as they start step 11, until the USR1 reaches them
    job = Job(
        tmp_path, "--checkpoint_freq", "1000", "--logging_freq", "5", "--report_to", "mlflow",
        "--report_dir", str(logs), *step_control.FLAGS, sbatch_args=("--time=20",),
        env={"MAX_STEPS": "60", **step_control.env("data@11", holds)},
    )  # fmt: skip
    step_control.wait_held(holds, "data@11")
    timing("2-node sbatch job: submit to step 11", time.monotonic() - job.started)
    signalled = time.monotonic()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True)
    saved = job.wait_log(r"Preempted: stop requested by SIGUSR1; saved at step (\d+)", timeout=120)
    step = int(saved.group(1))
    assert step == 11, saved[0]
    resumed = job.wait_log(rf"Resumed from \S+/tiny_qwen3-{step}steps at step (\d+)", timeout=400)
    assert int(resumed.group(1)) == step
    wait_for(
        "the requeued run's first step",
        120,
        lambda: re.search(r"\| Step \d+/60 \|", job.text().partition("SLURM_RESTART_COUNT=1")[2]),
    )
    timing("USR1 to the requeued run's first logged step", time.monotonic() - signalled)
    state = job.wait_done(timeout=300)
    timing("preemption test job (submit to end of the requeued run)", time.monotonic() - job.started)
    log = job.text()
    assert state == "COMPLETED", log
    assert job_field(job.id, "Restarts") == "1"
    # Both runs are in the one log: two STARTs, the requeue, and the finish.
    assert log.startswith("START "), log[:500]
    assert log.count("\nSTART ") + 1 == 2, log
    first, second = log.split("SLURM_RESTART_COUNT=1", 1)
    for run in (first, second):
        assert "Node node1 (SLURM_NODEID=0)" in run and "Node node2 (SLURM_NODEID=1)" in run, run
        assert "Versions: python" in run, run
    assert "preempted, requeueing job" in first
    assert f"SLURM job {job.id}, SLURM_RESTART_COUNT=0" in first
    # The job's real end time (squeue) is read: a time limit of 20 minutes, minus the start-up.
    left = re.search(r"Job time limit: 0:(\d\d):\d\d left", first)
    assert left and 10 <= int(left.group(1)) < 20, first
    assert re.search(r"\| Step 60/60 \|.*\| ETA 0:00:00 \(job time left 0:1\d:\d\d\)$", second, re.M), second
    assert "Done: step 60/60" in second, second
    assert re.search(r"^END .* exit status 0$", second, re.MULTILINE), second
    assert latest_tag(job.checkpoints) == "tiny_qwen3-60steps"
    # Metrics land next to the job's log, both runs in one file: every logged step once, one world of 2 each.
    records = [json.loads(line) for line in job.log.with_suffix(".metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(5, 61, 5))
    assert [r["world_size"] for r in records if r.get("event") == "start"] == [2, 2]
    # The requeued job continued the same MLflow run: one run holds the steps of both.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{logs}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss"))
    assert steps == list(range(5, 61, 5))  # before and after the requeue, none twice


def test_accelerate_sbatch_trains_one_world_across_both_nodes_and_resumes(
    cluster, tmp_path: Path, timing
) -> None:
    """launcher: accelerate with the shipped accelerate config (DeepSpeed, ZeRO-2): one `accelerate launch` per
    node, machine ranks 0 and 1 from each node's SLURM_NODEID, one world of 2; USR1, checkpoint, requeue and
    resume as with torchrun."""
    holds = tmp_path / "holds"  # both ranks hold as they start step 11, until the USR1 reaches them
    job = Job(
        tmp_path, "--max_steps", "40", "--checkpoint_freq", "1000", "--logging_freq", "5", *step_control.FLAGS,
        values={"launcher": "accelerate", "accelerate_config": "configs/accelerate/deepspeed-zero2.yaml"},
        env=step_control.env("data@11", holds),
    )  # fmt: skip
    step_control.wait_held(holds, "data@11")
    timing("accelerate: submit to step 11 of the first run", time.monotonic() - job.started)
    signalled = time.monotonic()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True)
    saved = job.wait_log(r"Preempted: stop requested by SIGUSR1; saved at step (\d+)", timeout=120)
    step = int(saved.group(1))
    assert step == 11, saved[0]
    resumed = job.wait_log(rf"Resumed from \S+/tiny_qwen3-{step}steps at step (\d+)", timeout=400)
    assert int(resumed.group(1)) == step
    timing("accelerate: USR1 to the requeued run's resume", time.monotonic() - signalled)
    state = job.wait_done(timeout=300)
    timing(
        "accelerate: preemption test job (submit to end of the requeued run)", time.monotonic() - job.started
    )
    log = job.text()
    assert state == "COMPLETED", log
    assert job_field(job.id, "Restarts") == "1"
    # Each run: both hosts, each as its own machine rank (an unescaped $SLURM_NODEID would make both 0).
    runs = re.split(r"^START ", log, flags=re.MULTILINE)[1:]
    assert len(runs) == 2, log
    for run in runs:
        assert "accelerate launch: 2 machine(s) x 1 process(es), config configs/accelerate/" in run, run
        assert "Node node1 (SLURM_NODEID=0): accelerate launch with 1 ranks" in run, run
        assert "Node node2 (SLURM_NODEID=1): accelerate launch with 1 ranks" in run, run
        # one world of 2, not two worlds of 1 (those would train alone and print twice)
        assert run.count("2 ranks x micro batch 1") == 1, run
    assert "preempted, requeueing job" in log
    assert "Done: step 40/40" in log, log
    assert latest_tag(job.checkpoints) == "tiny_qwen3-40steps"
    records = [json.loads(line) for line in job.log.with_suffix(".metrics.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in records if r.get("event") == "start"] == [2, 2]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 40  # the requeued run went on, none twice


def test_node_failure_ends_job_and_requeued_run_resumes(cluster, tmp_path: Path, timing) -> None:
    holds = (
        tmp_path / "holds"
    )  # both ranks hold as they start step 11 (after the step-10 save): node2 fails there
    job = Job(
        tmp_path, "--max_steps", "80", "--checkpoint_freq", "5", "--logging_freq", "5", *step_control.FLAGS,
        env=step_control.env("data@11", holds),
    )  # fmt: skip
    step_control.wait_held(holds, "data@11")
    failed = time.monotonic()
    try:
        subprocess.run(
            ["scontrol", "update", "nodename=node2", "state=down", "reason=dskit-test"], check=True
        )
        # No hang: the running job ends (SLURM requeues it, as it was submitted with --requeue).
        wait_for(
            "the job to leave RUNNING after node2 went down", 90, lambda: job.state() != "RUNNING", every=1
        )
        timing("node2 down to the job leaving RUNNING", time.monotonic() - failed)
        assert job_field(job.id, "Restarts") == "1"
    finally:
        # cluster.sh up resumes downed nodes
        subprocess.run([str(CLUSTER), "up"], check=True, timeout=300)
    resumed = job.wait_log(r"Resumed from \S+/tiny_qwen3-(\d+)steps at step (\d+)", timeout=400)
    assert resumed.group(1) == resumed.group(2)
    # It resumes from the first run's last checkpoint, saved before the ranks held.
    before = job.text()[: resumed.start()]
    last_saved = int(re.findall(r"Saved checkpoint \S+/tiny_qwen3-(\d+)steps", before)[-1])
    assert int(resumed.group(2)) == last_saved == 10
    state = job.wait_done(timeout=300)
    timing("node failure test job (submit to end of the requeued run)", time.monotonic() - job.started)
    log = job.text()
    assert state == "COMPLETED", log
    assert "SLURM_RESTART_COUNT=1" in log
    assert "Done: step 80/80" in log, log
    # The run's cost: two attempts on two nodes each, with SLURM's real submit time.
    costed = subprocess.run(
        [str(REPO / ".venv/bin/dskit"), "cost", str(job.checkpoints), "--instance_type", "p5.48xlarge", "--json"],
        env=JOB_ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert costed.returncode == 0, costed.stderr
    account = json.loads(costed.stdout)
    first, second = account["attempts"]
    assert (first["nodes"], second["nodes"], second["start_step"]) == (2, 2, last_saved)
    assert first["ended"] == "crashed" and second["ended"] == "done" and account["trained_steps"] == 80
    assert first["queue_s"] is not None and second["queue_s"] is not None  # scontrol's SubmitTime
    # Steps past the resumed checkpoint are lost only as far as the ledger heard of them before the crash.
    assert first["seconds"]["restarts"] >= 0 and second["seconds"]["restarts"] == 0
    assert first["seconds"]["productive"] > 0 and second["seconds"]["productive"] > 0
    assert sum(account["by_cause_node_seconds"].values()) == pytest.approx(account["paid_node_seconds"])
    report = subprocess.run(
        [str(REPO / ".venv/bin/dskit"), "cost", str(job.checkpoints), "--instance_type", "p5.48xlarge"],
        env=JOB_ENV, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    print(report)  # the closing note's example (pytest -s)


def job_rank_pids(job_id: str) -> dict[int, tuple[int, str]]:
    """{rank: (pid, node)} of a job's training ranks (the nodes share this machine's process table)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = dict(
                v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v
            )
        except OSError:
            continue
        ours = b"train_deepspeed.py" in cmdline and environ.get(b"SLURM_JOB_ID") == job_id.encode()
        if ours and b"RANK" in environ:
            found[int(environ[b"RANK"])] = (int(proc.name), environ.get(b"SLURMD_NODENAME", b"").decode())
    return found


def test_a_hung_rank_requeues_the_job_without_its_node_and_it_resumes(
    cluster, tmp_path: Path, timing
) -> None:
    """A 1-node job of 2 ranks; rank 1 frozen with SIGSTOP after a checkpoint: the watchdog names it and its node
    with its stack, the job is requeued without that node and resumes on the other from the newest verified
    checkpoint, within --hang_timeout + 60 s of the freeze (issue #28)."""
    hang_timeout = 10
    holds = (
        tmp_path / "holds"
    )  # rank 1 holds as it starts step 6 (after the step-5 save), and is frozen there
    job = Job(
        tmp_path, "--max_steps", "400", "--checkpoint_freq", "5", "--logging_freq", "5",
        "--hang_timeout", str(hang_timeout), *step_control.FLAGS, values={"nodes": 1, "cpu_ranks_per_node": 2},
        env=step_control.env("data@6/1", holds),
    )  # fmt: skip
    step_control.wait_held(holds, "data@6/1")
    ranks = wait_for(
        "the job's 2 ranks", 60, lambda: (found := job_rank_pids(job.id)) and len(found) == 2 and found
    )
    pid, node = ranks[1]  # type: ignore[index]
    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        resumed = job.wait_log(r"Resumed from \S+/tiny_qwen3-(\d+)steps at step (\d+)", timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a failed test leaves no stopped process behind
    took = time.monotonic() - frozen
    timing("a frozen rank to the requeued run's resume (--hang_timeout 10)", took)
    first, second = job.text().split("SLURM_RESTART_COUNT=1", 1)
    assert re.search(rf"^error: hang: rank 1 \(pid {pid}\) on {node} stopped advancing", first, re.M), first[
        -5000:
    ]
    assert "(most recent call first)" in first, first[-5000:]  # the frozen rank's stacks
    assert f"requeueing job {job.id} without {node} (hang requeue 1 of 2" in first, first[-3000:]
    other = {"node1": "node2", "node2": "node1"}[node]
    assert job_field(job.id, "ExcNodeList") == node
    assert f"Node {other} (SLURM_NODEID=0)" in second, second[:3000]
    # The newest verified checkpoint of the first run: the last save the log completed before the hang line.
    saved = [int(s) for s in re.findall(r"Saved checkpoint \S+/tiny_qwen3-(\d+)steps", first)]
    assert resumed.group(1) == resumed.group(2) and int(resumed.group(2)) == max(saved) == 5, (
        saved,
        resumed[0],
    )
    assert took < hang_timeout + 60, f"{took:.0f} s from the freeze to the resume"
    subprocess.run(["scancel", job.id], check=True)


def test_a_node_failing_the_health_gate_is_excluded_before_any_step(cluster, tmp_path: Path, timing) -> None:
    """A 1-node job whose all-reduce cannot meet --health_min_busbw: its node is named before the first step and
    the job requeued without it; the requeued run, on the other node, fails the same way and, its one requeue
    (max_hang_requeues 1) spent, ends with 75 saying why (issue #28)."""
    job = Job(
        tmp_path, "--max_steps", "5", "--health_min_busbw", "1000000",
        values={"nodes": 1, "cpu_ranks_per_node": 2, "max_hang_requeues": 1},
    )  # fmt: skip
    state = job.wait_done(timeout=400)
    timing("health-gate test job (two gated attempts, one requeue)", time.monotonic() - job.started)
    log = job.text()
    assert state == "FAILED", log[-4000:]
    first, second = log.split("SLURM_RESTART_COUNT=1", 1)
    failed = re.search(r"^error: health gate: node (node\d) failed: all-reduce bus bandwidth", first, re.M)
    assert failed, first[-4000:]
    node = failed.group(1)
    other = {"node1": "node2", "node2": "node1"}[node]
    assert f"requeueing job {job.id} without {node} (hang requeue 1 of 1" in first, first[-3000:]
    assert f"Node {other} (SLURM_NODEID=0)" in second and f"health gate: node {other} failed" in second, (
        second
    )
    assert job_field(job.id, "ExcNodeList") == node
    assert "| Step " not in log  # stopped before any step, both times
    assert "after 1 hang requeues (max_hang_requeues 1): not requeueing" in second
    assert re.search(r"^END .* exit status 75$", second, re.M), second[-2000:]


def job_records(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job` of a job, one dict per record (an array job has one per task once they are split)."""
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    return [dict(re.findall(r"\b(\w+)=(\S*)", block)) for block in re.split(r"\n\s*\n", out.strip())]


def slurm_time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value)


def write_corpus(path: Path, megabytes: float) -> None:
    """JSON lines of made-up words: enough bytes for several --unit_mb 1 units, tokenized in seconds."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(3000)]
    with path.open("w") as f:
        while f.tell() < megabytes * 2**20:
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(100, 400)))}) + "\n")


def test_prepare_data_array_then_training_on_it(cluster, tmp_path: Path, timing) -> None:
    """prepare-data.sbatch as an array of 2 tasks (2 CPUs each, so one per node), then a 2-node training job
    that depends on it (afterok) and trains on what it prepared."""
    corpus, out = tmp_path / "corpus.jsonl", tmp_path / "prepared"
    write_corpus(corpus, 3.5)  # 4 units of 1 MB: 2 per task
    scripts = tmp_path / "scripts"  # not tmp_path: Job renders its own scripts there
    scripts.mkdir()
    values = render.LaunchValues(
        job_name="dskit-test", prepare_tasks=2, prepare_cpus_per_task=2, prepare_dataset=str(corpus),
        prepared_dir=str(out), prepare_args="--unit_mb 1",
    )  # fmt: skip
    render.write_scripts(render.render_scripts(values), scripts)
    submitted = time.monotonic()
    array_id = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/%x_%A_%a.out", str(scripts / "prepare-data.sbatch")],
        cwd=REPO, env=JOB_ENV, capture_output=True, text=True, check=True,
    ).stdout.strip().split(";")[0]  # fmt: skip
    job = Job(
        tmp_path, "--dataset", str(out), "--max_steps", "10",
        sbatch_args=(f"--dependency=afterok:{array_id}", "--kill-on-invalid-dep=yes"),
    )  # fmt: skip
    (pending,) = job_records(job.id)
    assert pending["JobState"] == "PENDING" and f"afterok:{array_id}" in pending["Dependency"], pending

    def array_done() -> list[dict[str, str]] | None:
        tasks = job_records(array_id)
        return tasks if len(tasks) == 2 and all(t["JobState"] in DONE_STATES for t in tasks) else None

    tasks = wait_for(f"array job {array_id} to finish", 300, array_done, every=1)
    timing(
        "prepare-data array, 2 tasks x 2 CPUs, 3.5 MB (submit to both tasks done)",
        time.monotonic() - submitted,
    )
    array_end = max(slurm_time(t["EndTime"]) for t in tasks)  # type: ignore[union-attr]
    logs = [tmp_path / f"dskit-test-prepare-data_{array_id}_{i}.out" for i in range(2)]
    texts = [read(log) for log in logs]
    assert [t["JobState"] for t in tasks] == ["COMPLETED"] * 2, "\n".join(texts)  # type: ignore[index]

    # Each task tokenized its own share of the units (task i: units i, i+2, ...), with one process per CPU.
    units = len(json.loads((out / "plan.json").read_text())["units"])
    assert units == 4, units
    for i, text in enumerate(texts):
        assert text.startswith("START ") and f"task {i} of 2 on node" in text and ", 2 CPUs" in text, text
        share = f"prepare-data: task {i}/2: 2 of 4 units of {corpus} to tokenize with 2 processes into {out}"
        assert share in text, text
        assert re.search(r"^END .* exit status 0$", text, re.MULTILINE), text
    # The one that finished the last unit wrote the manifest (both may, finishing at once: same manifest).
    assert any(f"prepared {out}: " in text for text in texts), texts
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["units"] == 4 and len(list((out / "units").glob("*.json"))) == 4
    train_tokens, val_tokens = manifest["tokens"]["train"], manifest["tokens"]["validation"]
    assert train_tokens > 0 and val_tokens > 0

    state = job.wait_done(timeout=420)
    timing(
        "training job after the array (submit to end, incl. waiting for it)", time.monotonic() - job.started
    )
    (record,) = job_records(job.id)
    started, ended = slurm_time(record["StartTime"]), slurm_time(record["EndTime"])
    timing(
        "2-node training on the prepared data, 10 steps (job start to end)", (ended - started).total_seconds()
    )
    log = job.text()
    assert state == "COMPLETED", log
    assert started >= array_end, (started, array_end)  # afterok: not before the last task ended
    # It read the prepared shards (block counts from the manifest's tokens) and tokenized nothing itself.
    ok = re.search(r"^ok: \S+, train (\d+) blocks x (\d+) tokens, validation (\d+) blocks", log, re.MULTILINE)
    assert ok, log
    seq = int(ok.group(2))
    assert (int(ok.group(1)), int(ok.group(3))) == (train_tokens // seq, val_tokens // seq), log
    assert "Data: tokenized" not in log
    assert "Node node1 (SLURM_NODEID=0)" in log and "Node node2 (SLURM_NODEID=1)" in log, log
    assert "Done: step 10/10" in log, log
    assert re.search(r"^END .* exit status 0$", log, re.MULTILINE), log


def test_api_trains_through_sbatch_and_follows_the_job(cluster, tmp_path: Path, timing) -> None:
    """dskit.api.train(slurm=True): one sbatch of train.sbatch on both nodes, its log streamed while the job
    runs, the result read from it once the job is COMPLETED; a job that fails raises the kit's one line."""
    from dskit import api

    values = render.LaunchValues(cpu_ranks_per_node=1, job_name="dskit-api")
    render.write_scripts(render.render_scripts(values), tmp_path)
    lines: list[str] = []
    started = time.monotonic()
    result = api.train(
        flags=["--max_steps", "6", "--checkpoint_freq", "6", "--checkpoint_dir", str(tmp_path / "ck")],
        slurm=True,
        sbatch_script=tmp_path / "train.sbatch",
        sbatch_args=[f"--output={tmp_path}/%x_%j.out"],
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        on_line=lines.append,
    )
    timing("dskit.api.train through sbatch, 2 nodes, 6 steps", time.monotonic() - started)
    text = "\n".join(lines)
    assert "Node node1 (SLURM_NODEID=0)" in text and "Node node2 (SLURM_NODEID=1)" in text, text
    assert (result.final_step, result.max_steps) == (6, 6) and result.train_loss is not None
    assert result.checkpoint == str(tmp_path / "ck" / "tiny_qwen3-6steps")
    assert (tmp_path / "ck" / "latest").read_text().strip() == "tiny_qwen3-6steps"
    with pytest.raises(api.TrainingFailed, match=r"^unknown flag --no_such_flag"):
        api.train(
            flags=["--no_such_flag"],
            slurm=True,
            sbatch_script=tmp_path / "train.sbatch",
            sbatch_args=[f"--output={tmp_path}/%x_%j.out"],
            on_line=None,
        )


def test_singlenode_runs_on_the_named_node(cluster, tmp_path: Path, timing) -> None:
    job_name = f"dskit-test-singlenode-{os.getpid()}"
    start = time.monotonic()
    proc = subprocess.run(
        ["./train-singlenode.sh", "node2", "--max_steps", "10", "--checkpoint_dir", str(tmp_path / "ck")],
        cwd=REPO, env={**JOB_ENV, "JOB_NAME": job_name}, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    timing("train-singlenode.sh node2, 10 steps", time.monotonic() - start)
    logs = list((REPO / "logs").glob(f"{job_name}_*.out"))
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert len(logs) == 1, logs
        log = logs[0].read_text()
        assert "Host node2: training here" in log, log
        assert "Done: step 10/10" in log, log
        assert re.search(r"^END .* exit status 0$", log, re.MULTILINE), log
        assert latest_tag(tmp_path / "ck") == "tiny_qwen3-10steps"
        metrics = logs[0].with_suffix(".metrics.jsonl")  # written on node2, next to the log on the shared FS
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [10]
    finally:
        for path in (REPO / "logs").glob(f"{job_name}_*"):
            path.unlink()


def test_singlenode_unknown_node_is_a_clear_error(cluster) -> None:
    proc = subprocess.run(
        ["./train-singlenode.sh", "no-such-node", "--max_steps", "10"],
        cwd=REPO, env=JOB_ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "error: node 'no-such-node' is not known to SLURM" in proc.stderr


# The offline test below runs when a wheelhouse of this uv.lock is at DSKIT_TEST_WHEELHOUSE, default the checkout's
# wheelhouse/ (`make offline-check` builds it, 3 GiB from PyPI, then runs the test). A fresh clone has none, so
# `make test` skips it with that reason: the install and DeepSpeed's ops built for the new venv take ~3.5 minutes.
TEST_WHEELHOUSE = Path(os.environ.get("DSKIT_TEST_WHEELHOUSE", REPO / "wheelhouse"))


def wheelhouse_of_this_lock() -> Path:
    from dskit.env import wheelhouse

    manifest = TEST_WHEELHOUSE / wheelhouse.MANIFEST
    arm = "`make offline-check` builds one (3 GiB from PyPI) and runs this test"
    if not manifest.is_file():
        pytest.skip(f"no wheelhouse at {TEST_WHEELHOUSE}: {arm}")
    if json.loads(manifest.read_text())["lock_sha256"] != wheelhouse.lock_digest(REPO):
        pytest.skip(f"the wheelhouse at {TEST_WHEELHOUSE} is of another uv.lock: {arm}")
    return TEST_WHEELHOUSE


def no_network_shell(script: str) -> list[str]:
    """bash in a new network namespace: loopback only, no route out; the nameservers unreachable, so that name
    lookups that miss /etc/hosts fail at once instead of waiting for the resolver's timeout."""
    block = [
        f"ip route replace unreachable {addr}/32"
        for key, addr, *_ in (
            line.split() for line in Path("/etc/resolv.conf").read_text().splitlines() if line.strip()
        )
        if key == "nameserver" and addr.count(".") == 3 and not addr.startswith("127.")
    ]
    return [
        "unshare",
        "--net",
        "bash",
        "-euo",
        "pipefail",
        "-c",
        "; ".join(["ip link set lo up", *block, script]),
    ]


def test_offline_install_from_a_wheelhouse_trains_through_both_launchers(
    cluster, tmp_path: Path, timing
) -> None:
    """What an air-gapped cluster does: a copy of the checkout and a wheelhouse, no network, no uv. The launcher
    makes .venv with `python -m venv` and pip (the kit's own wheel too) and trains the embedded default; then
    train.sbatch on both nodes runs the kit with that venv as an existing interpreter (DSKIT_PYTHON)."""
    wh = wheelhouse_of_this_lock()
    copy = tmp_path / "repo"
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    # a `uv` that fails loudly: the wheelhouse path must never reach for it
    no_uv = tmp_path / "no-uv"
    no_uv.mkdir()
    (no_uv / "uv").write_text("#!/bin/sh\necho 'uv was called' >&2\nexit 97\n")
    (no_uv / "uv").chmod(0o755)
    env = {
        **JOB_ENV,
        "PATH": f"{no_uv}:{os.environ['PATH']}",
        "JOB_NAME": "offline",
        # DeepSpeed's ops, built for this venv on first use (torch's include paths are part of an op's build key,
        # so the checkout's ops would be rebuilt, for this venv, under the other environment's feet)
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"),
    }
    start = time.monotonic()
    proc = subprocess.run(
        no_network_shell(
            "! python3 -c 'import socket; socket.create_connection((\"151.101.0.223\", 443), timeout=5)' 2>/dev/null"
            f" || {{ echo 'the namespace reaches the internet'; exit 98; }}; WHEELHOUSE={shlex.quote(str(wh))}"
            f" ./train-singlenode.sh --max_steps 2 --checkpoint_dir {shlex.quote(str(tmp_path / 'ck1'))}"
        ),
        cwd=copy, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    timing("offline: WHEELHOUSE install + train-singlenode.sh, 2 steps", time.monotonic() - start)
    (log,) = (copy / "logs").glob("offline_*.out")
    text = log.read_text()
    assert proc.returncode == 0, text + proc.stderr
    installed = re.search(r"^Python: \S+ installed from the wheelhouse in (\d+) s$", text, re.MULTILINE)
    assert installed, text
    timing("offline: pip install of the wheelhouse into .venv", float(installed.group(1)))
    assert "Done: step 2/2" in text and "uv was called" not in text + proc.stderr
    venv = copy / ".venv"
    assert "uv =" not in (venv / "pyvenv.cfg").read_text()  # made by `python -m venv`, not by uv
    versions = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('dskit'), m.version('torch'))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert versions[0] == "0.1.0"  # the kit's own wheel, installed by pip
    # make gpu-check's pytest, offline too (the launcher's venv is up to date: only the test tools go in)
    tools = subprocess.run(
        no_network_shell(
            f"PYTHONPATH=src python3 -m dskit.env.wheelhouse install {shlex.quote(str(wh))} --venv .venv --test_tools"
            " && .venv/bin/python -m pytest --version"
        ),
        cwd=copy, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert tools.returncode == 0 and "(up to date)" in tools.stdout, tools.stdout + tools.stderr
    assert "pytest 9" in tools.stdout + tools.stderr
    # Both launchers: train.sbatch across the 2 nodes (namespaces with no route out), the same venv as DSKIT_PYTHON.
    start = time.monotonic()
    (tmp_path / "sbatch").mkdir()
    job_env = {
        "DSKIT_PYTHON": str(venv / "bin" / "python"),
        "TORCH_EXTENSIONS_DIR": env["TORCH_EXTENSIONS_DIR"],
    }
    job = Job(tmp_path / "sbatch", "--max_steps", "2", env=job_env)
    assert job.wait_done(timeout=600) == "COMPLETED", job.text()
    timing("offline: train.sbatch with DSKIT_PYTHON, 2 nodes, 2 steps", time.monotonic() - start)
    text = job.text()
    assert f"Python: {venv / 'bin' / 'python'} (DSKIT_PYTHON: used as it is, no uv sync)" in text
    assert f"torch {versions[1]}" in text and "Done: step 2/2" in text, text
