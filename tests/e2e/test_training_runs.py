"""Real 2-rank DeepSpeed runs on CPU (gloo, ZeRO-2, CPU Adam, bf16).

The runs are the rank pool's (support/rank_pool.py) except where the launcher is what is tested:
./train-singlenode.sh.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dskit import cli, cost
from support import step_control
from support.hub_server import HubStandIn
from support.metrics_file import step_records
from support.rank_pool import run_ranks, train
from support.reference_runs import Reference
from support.torchrun import ENV, REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


def client_state(tag_dir: Path) -> dict:
    return torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["dskit"]["train_state"]


def common(cache: Path, ckpt: Path, metrics_file: Path) -> list[str]:
    return [
        "--max_steps", "8", "--logging_freq", "1", "--checkpoint_freq", "4", "--validation_freq", "100",
        "--micro_batch_size", "2", "--gradient_accumulation_steps", "2", "--seq_length", "64",
        "--data_cache_dir", str(cache), "--checkpoint_dir", str(ckpt), "--metrics_file", str(metrics_file),
    ]  # fmt: skip


def test_resume_continues_exactly_like_an_uninterrupted_run(deepspeed_reference: Reference) -> None:
    """The DeepSpeed reference run (support/reference_runs.py): 8 steps straight, and its twin: "stopped" after
    step 4 (a fresh checkpoint dir holding only the step-4 checkpoint), then trained again to 8."""
    ref = deepspeed_reference
    straight, out = ref.straight, ref.straight_log
    full = ref.straight_records()
    assert sorted(full) == list(range(1, 9))  # counts optimizer steps (2 micro-batches each), stops at 8
    assert "Step 8/8 | Validation Loss" in out
    assert (straight / "latest").read_text().strip() == "tiny_qwen3-8steps"
    tokens_per_step = 2 * 2 * 2 * 64  # ranks x micro batch x accumulation x seq
    assert client_state(straight / "tiny_qwen3-8steps")["tokens_seen"] == 8 * tokens_per_step
    assert client_state(straight / "tiny_qwen3-4steps")["position"] == {"epoch": 0, "consumed": 4 * 8}

    resumed, out = ref.twin, ref.twin_log
    assert "Resumed from" in out and "tiny_qwen3-4steps at step 4 (epoch 0, block 32" in out
    again = ref.twin_records()
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:
        assert abs(again[step]["loss"] - full[step]["loss"]) < 1e-4, (step, again[step], full[step])
        assert again[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-6)
        assert (again[step]["epoch"], again[step]["consumed"]) == (
            full[step]["epoch"],
            full[step]["consumed"],
        )
        assert again[step]["tokens_seen"] == full[step]["tokens_seen"]
    assert client_state(resumed / "tiny_qwen3-8steps") == client_state(straight / "tiny_qwen3-8steps")


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_a_signal_to_one_rank_stops_all_ranks_at_one_step_with_a_checkpoint(
    backend: str, tmp_path: Path, data_cache: Path
) -> None:
    """Preemption is the trainer's, whichever engine trains: SIGUSR1 to one rank (rank 1) stops both."""
    ckpt = tmp_path / "ck"
    args = [
        "--max_steps", "12", "--logging_freq", "1", "--checkpoint_freq", "100", "--validation_freq", "100",
        "--seq_length", "64", "--data_cache_dir", str(data_cache), "--checkpoint_dir", str(ckpt),
        "--metrics_file", str(tmp_path / "m.jsonl"), "--backend", backend,
    ]  # fmt: skip
    holds = tmp_path / "holds"  # rank 1 holds as it starts step 3 until its signal (support/step_control.py)

    def signal_rank_1_in_step_3(pids: list[int], stdout: Path) -> None:
        step_control.wait_held(holds, "data@3/1")
        os.kill(pids[1], signal.SIGUSR1)

    run = run_ranks(
        [*args, *step_control.FLAGS],
        cwd=tmp_path,
        env={**ENV, **step_control.env("data@3/1", holds)},
        while_running=signal_rank_1_in_step_3,
    )
    out = run.stdout + run.stderr
    assert run.exitcodes == [0, 0], (run.exitcodes, out[-3000:])
    assert "Preempted: stop requested by another rank; saved at step 3" in out, out[-3000:]
    stopped = 3  # rank 0 ran on into step 3, where its collective with rank 1 carried the stop
    assert (ckpt / "latest").read_text().strip() == f"tiny_qwen3-{stopped}steps"
    assert max(step_records(tmp_path / "m.jsonl")) == stopped  # no rank ran past the agreed step

    out = train(args, tmp_path)
    assert f"at step {stopped} " in out and "Step 12/12" in out
    assert sorted(step_records(tmp_path / "m.jsonl")) == list(
        range(1, 13)
    )  # continued, none repeated or skipped


def test_train_singlenode_trains_the_embedded_default_and_resumes(tmp_path: Path, capsys) -> None:
    """./train-singlenode.sh with only a private checkpoint dir: the embedded default, end to end."""
    logs_before = set((REPO / "logs").glob("*.out"))
    ckpt = tmp_path / "ck"
    cmd = [str(REPO / "train-singlenode.sh"), "--checkpoint_dir", str(ckpt)]
    try:
        launched = time.time()
        first = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)
        measured_s = time.time() - launched
        assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
        # The goodput ledger: one attempt, whose paid time is the launcher's wall time within 1%, split by
        # cause without a second left over or counted twice (dskit cost's sum).
        (attempt,) = cost.account(cost.read(ckpt / cost.LEDGER)).attempts
        print(f"ledger wall {attempt.wall_s:.2f} s, measured {measured_s:.2f} s, {attempt.seconds}")
        assert attempt.wall_s == pytest.approx(measured_s, rel=0.01), (attempt.wall_s, measured_s)
        assert sum(attempt.seconds.values()) == pytest.approx(attempt.wall_s)
        assert attempt.seconds["productive"] > 0 and attempt.seconds["startup"] > 0
        assert attempt.ended == "done" and attempt.start_step == 0
        assert "Step 100/100 | Loss" in first.stdout
        assert (ckpt / "latest").read_text().strip() == "tiny_qwen3-100steps"
        new_logs = [p for p in set((REPO / "logs").glob("*.out")) - logs_before if str(ckpt) in p.read_text()]
        assert len(new_logs) == 1 and "Step 100/100" in new_logs[0].read_text()
        steps = step_records(new_logs[0].with_suffix(".metrics.jsonl"))  # beside the log
        assert max(steps) == 100
        assert steps[100]["loss"] < steps[10]["loss"] - 1.0, steps  # the loss visibly falls
        # Named after what ran once the kit named the run, the output following it to the END line (-N: another
        # launch of the other tier took that name in the same second).
        name = new_logs[0].name
        assert re.fullmatch(r"tiny_qwen3-deepspeed_\d{8}-\d{6}(-\d+)?\.out", name), name
        assert new_logs[0].read_text().rstrip().endswith("exit status 0")
        # The README's next command: `dskit plot` of that log (the metrics file beside it), here in this process.
        assert cli.main(["plot", str(new_logs[0]), "-o", str(tmp_path / "run.png")]) == 0
        assert (tmp_path / "run.png").stat().st_size > 10_000

        # The same command again: the run is complete, said in one line before any rank starts; not an error, and
        # no log of a launch that ran nothing (the newest log is still the run's, for `dskit plot`).
        again = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        said = again.stdout + again.stderr  # the launcher's log is its stdout
        assert (
            f"run complete: {ckpt}/tiny_qwen3-100steps is at step 100, at --max_steps 100: nothing to train "
            "(raise --max_steps to continue it" in said
        ), said[-4000:]
        assert "torchrun with" not in said and "Step " not in said and "error" not in said, said[-4000:]
        assert [
            p for p in set((REPO / "logs").glob("*.out")) - logs_before if str(ckpt) in p.read_text()
        ] == [new_logs[0]]
        # and `dskit config` shows the run a relaunch would resume
        capsys.readouterr()
        assert cli.main(["config", "--checkpoint_dir", str(ckpt)]) == 0
        shown = capsys.readouterr()
        assert json.loads(shown.out)["config"]["loop"]["max_steps"] == 100 and "run complete:" in shown.err

        # Longer, and pushed to a (stand-in) hub when it finishes: --push_to_hub through the launcher.
        with HubStandIn() as hub:
            # Online for the push (the launcher makes the ranks offline, and gives the push the caller's setting).
            hub_env = {k: v for k, v in ENV.items() if k != "HF_HUB_OFFLINE"}
            hub_env.update(HF_ENDPOINT=hub.url, HF_TOKEN="hf_stand_in")
            push = ["--push_to_hub", "me/tiny-run", "--report_dir", str(tmp_path / "logs")]
            longer = subprocess.run(
                [*cmd, "--max_steps", "104", *push], env=hub_env, capture_output=True, text=True, timeout=900
            )
        assert longer.returncode == 0, (longer.stdout + longer.stderr)[-4000:]
        assert "tiny_qwen3-100steps at step 100" in longer.stdout and "Step 104/104 | Loss" in longer.stdout
        assert "Pushing the step-104 model to the hub repo me/tiny-run in the background" in longer.stdout
        assert f"to me/tiny-run: {hub.url}/me/tiny-run/commit/" in longer.stdout, longer.stdout[-3000:]
        (commit,) = [c for c in hub.commits if "config.json" in hub.commits[c]]
        assert "| optimizer steps | 104 |" in hub.commits[commit]["README.md"].decode()
    finally:  # remove only this test's logs and metrics files: other tests may be writing theirs
        for path in set((REPO / "logs").glob("*.out")) - logs_before:
            if str(ckpt) in path.read_text(errors="replace"):
                path.unlink()
                path.with_suffix(".metrics.jsonl").unlink(missing_ok=True)


def test_wsd_resume_continues_the_exact_lr_and_a_new_world_size_repositions_it(
    tmp_path: Path, data_cache: Path
) -> None:
    """The kit's own torch scheduler (WSD) is in the checkpoint: a 2-rank resume at step 4 continues the same
    lr and loss as the uninterrupted run; a 1-rank resume (through a universal copy, with twice the
    accumulation: the same global batch) continues them too, within bf16 noise."""
    wsd = ["--lr_schedule", "wsd", "--warmup_steps", "2", "--decay_fraction", "0.5"]
    straight = tmp_path / "straight"
    out = train([*common(data_cache, straight, tmp_path / "straight.jsonl"), *wsd], tmp_path)
    assert "lr schedule wsd: warm-up 2 steps, stable to step 4, linear decay to 0.1 x peak by step 8" in out
    full = step_records(tmp_path / "straight.jsonl")
    peak = full[3]["lr"]
    assert full[4]["lr"] == peak and full[5]["lr"] < peak and full[8]["lr"] == pytest.approx(0.1 * peak)
    for ranks, name in ((2, "resumed"), (1, "one-rank")):
        ckpt = tmp_path / name
        ckpt.mkdir()
        shutil.copytree(straight / "tiny_qwen3-4steps", ckpt / "tiny_qwen3-4steps")
        run = [*common(data_cache, ckpt, tmp_path / f"{name}.jsonl"), *wsd]
        run[run.index("--gradient_accumulation_steps") + 1] = str(4 // ranks)
        run[run.index("--checkpoint_freq") + 1] = str(ranks)  # the one-rank run also saves step 6
        out = train(run, tmp_path, nproc=ranks)
        again = step_records(tmp_path / f"{name}.jsonl")
        assert sorted(again) == [5, 6, 7, 8]
        for step in again:
            assert again[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-6), (name, step)
        # Another world size sums the gradients in another order: bf16 noise of a few 1e-5 per step.
        tolerance = 1e-4 if ranks == 2 else 5e-4
        for step in again:
            assert abs(again[step]["loss"] - full[step]["loss"]) < tolerance, (step, again[step], full[step])
        if ranks == 1:
            assert "world size changed from 2 to 1: resuming optimizer and lr schedule state" in out
            assert "at step 4 (epoch 0, block 32" in out  # the same global position in the data
    # And back, 1 -> 2: the one-rank run's step-6 checkpoint resumed on two ranks, Adam moments and all.
    back = tmp_path / "two-again"
    back.mkdir()
    shutil.copytree(tmp_path / "one-rank" / "tiny_qwen3-6steps", back / "tiny_qwen3-6steps")
    out = train([*common(data_cache, back, tmp_path / "back.jsonl"), *wsd], tmp_path)
    assert "world size changed from 1 to 2: resuming optimizer and lr schedule state" in out
    assert "loaded the weights only" not in out and "at step 6 (epoch 0, block 48" in out
    again = step_records(tmp_path / "back.jsonl")
    assert sorted(again) == [7, 8]
    for step in again:  # two world-size changes away from the straight run: twice the noise
        assert again[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-6)
        assert abs(again[step]["loss"] - full[step]["loss"]) < 1e-3, (step, again[step], full[step])


# The shipped configs `dskit estimate` recommends that no other test trains (deepspeed_engine.shipped_configs).
RECOMMENDABLE = ["ds_config_zero1.json", "ds_config_zero3_gpu.json", "ds_config_zero3_offload_params.json"]


@pytest.mark.parametrize("config", RECOMMENDABLE)
def test_each_shipped_config_estimate_can_recommend_trains_and_resumes(
    tmp_path: Path, data_cache: Path, config: str
) -> None:
    ckpt = tmp_path / "ckpt"
    run = [*common(data_cache, ckpt, tmp_path / "m.jsonl"), "--checkpoint_freq", "2",
           "--deepspeed_config", f"deepspeed/{config}"]  # fmt: skip
    first = train([*run, "--max_steps", "2"])
    assert "Done: step 2/2" in first and (ckpt / "latest").read_text().strip() == "tiny_qwen3-2steps"
    # ZeRO-3 partitions the weights too: each rank saves its own model states.
    partitioned = (ckpt / "tiny_qwen3-2steps" / "zero_pp_rank_1_mp_rank_00_model_states.pt").is_file()
    assert partitioned == ("zero3" in config)
    if "zero3" in config:
        return  # ZeRO-3's resume (the same files): tests/e2e/test_lora_training.py, configs/zero3-offload.yaml
    second = train([*run, "--max_steps", "3"])
    assert "tiny_qwen3-2steps at step 2 (epoch 0" in second and "Done: step 3/3" in second, second[-3000:]
    assert sorted(step_records(tmp_path / "m.jsonl")) == [1, 2, 3]


@pytest.mark.launcher
def test_launches_that_start_together_each_get_their_log_their_data_and_their_own_checkpoint_dir(
    tmp_path: Path,
) -> None:
    """Three `./train-singlenode.sh` at the same moment, one job name, one new dataset and one data cache (a sweep,
    two jobs sharing --data_cache_dir): two into checkpoint dirs of their own both train, one preparing the data
    while the other waits for it (no traceback, no file of another's removed); the third, into the first's
    checkpoint dir, is refused by its preflight in one line (the lease is taken there, at any spacing), whichever
    of the two comes first; each launch writes a log of its own (the names have one-second resolution)."""
    from support.prepared_data import corpus

    data = corpus(tmp_path, 800)
    job = f"together-{os.getpid()}"
    env = {**ENV, "JOB_NAME": job, "GPUS_PER_NODE": "0", "CPU_RANKS": "2"}
    common = ["--max_steps", "2", "--validation_freq", "1000", "--dataset", str(data)]
    common += ["--data_cache_dir", str(tmp_path / "cache"), "--seq_length", "64"]
    dirs = {"a": tmp_path / "ck1", "b": tmp_path / "ck2", "c": tmp_path / "ck1"}
    logs_before = set((REPO / "logs").glob(f"{job}_*"))
    procs = {
        name: subprocess.Popen(
            [str(REPO / "train-singlenode.sh"), *common, "--checkpoint_dir", str(ck)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, ck in dirs.items()
    }
    try:
        out = {name: proc.communicate(timeout=600)[0] for name, proc in procs.items()}
        logs = sorted(set((REPO / "logs").glob(f"{job}_*.out")) - logs_before)
        texts = [log.read_text() for log in logs]
    finally:
        for log in set((REPO / "logs").glob(f"{job}_*")) - logs_before:
            log.unlink()
    status = {name: proc.returncode for name, proc in procs.items()}
    for text in out.values():
        assert "Traceback" not in text and "ChildFailedError" not in text, text[-4000:]
    assert status["b"] == 0 and sorted((status["a"], status["c"])) == [0, 2], (status, out)
    refused = out["a"] if status["a"] == 2 else out["c"]
    (line,) = [line for line in refused.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: checkpoint dir {dirs['a']} is in use by another run (host "), refused[
        -3000:
    ]
    assert "Ranks started" not in refused and "torchelastic" not in refused, refused[-3000:]
    trained = [out["b"], out["a"] if status["a"] == 0 else out["c"]]
    assert all("Done: step 2/2" in text for text in trained), trained
    said = "\n".join(trained)
    assert said.count("Data: tokenized") == 1, said  # one preparation; the other read it
    # A log each, its name said at the start, holding that launch's output alone.
    assert len(logs) == 3, [log.name for log in logs]
    for text in out.values():
        (named,) = re.findall(r"^Logging to (logs/\S+)$", text, re.M)
        mine = texts[logs.index(REPO / named)]
        assert (
            text.replace(f"Logging to {named}\n", "", 1) == mine
        )  # all of it teed to its own log, no other's
