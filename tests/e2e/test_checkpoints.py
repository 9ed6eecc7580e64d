"""Checkpoints that never lie, against real saves: the crash tests (marked e2e) SIGKILL a rank at each point of a
save, then check what the next start resumes from: 2 ranks saving through the protocol with a fake engine for
every point, a real 2-rank DeepSpeed run for one (the others start from the DeepSpeed reference run's tags,
tests/support/reference_runs.py; all ranks are the rank pool's, tests/support/rank_pool.py); a world-size change, a
full disk and the S3 tier. The tests on tag directories built by hand are beside the code: tests/unit/checkpoint/
(test_protocol.py, test_launch_record.py) and tests/unit/storage/test_file_manifest.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from model_utils import engines
from model_utils.checkpoint import protocol
from model_utils.config.arguments import parse_args
from model_utils.engines.deepspeed_engine import MODEL_STATES
from model_utils.loop import trainer as training
from model_utils.observe.ledger_file import LEDGER
from model_utils.resolve import resolver
from model_utils.storage import file_manifest
from support.metrics_file import step_records
from support.rank_pool import ENV, killed_in_first_save, run_ranks
from support.reference_runs import HALF, Reference, copy_tags

REPO = Path(__file__).resolve().parents[2]


# --- real crashes ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_checkpoints(deepspeed_reference: Reference, tmp_path_factory) -> tuple[Path, list[str]]:
    """Verified checkpoints at steps 2 and 4 (the DeepSpeed reference run's), and the flags that continue them
    to step 8 (saving every 2 steps)."""
    root = tmp_path_factory.mktemp("ckpt")
    base = deepspeed_reference.copy(root / "base", "tiny_qwen3-2steps", HALF, latest=True)
    args = deepspeed_reference.run_flags(base, Path("none"))
    for flag in ("--checkpoint_dir", "--max_steps"):  # each test names its own dir; max_steps comes last
        at = args.index(flag)
        del args[at : at + 2]
    return base, [*args, "--keep_checkpoints", "3", "--max_steps", "8"]


FAULTS = {
    # point -> the tag the next start must resume from (the killed save was of step 6)
    "before_manifest": "tiny_qwen3-4steps",
    "mid_file": "tiny_qwen3-4steps",
    "before_rename": "tiny_qwen3-4steps",
    "before_latest": "tiny_qwen3-6steps",  # complete and verified: `latest` lagging behind does not matter
    "rank1_before_barrier": "tiny_qwen3-4steps",
}
FAKE_ENGINE = REPO / "tests" / "support" / "fake_engine_save.py"
FAIL_RANK_ENV = "FAKE_ENGINE_SAVE_FAILS_ON_RANK"  # fake_engine_save.FAIL_RANK_ENV (a script, not imported)


@pytest.fixture(scope="module", params=["deepspeed", "fsdp"])
def fake_base(request: pytest.FixtureRequest, tmp_path_factory) -> tuple[str, Path]:
    """Tags of steps 2 and 4 saved by 2 ranks through the real protocol with a fake engine, in the file layout
    of the DeepSpeed or the FSDP engine."""
    layout = request.param
    base = tmp_path_factory.mktemp(f"fake-{layout}") / "base"
    proc = run_ranks([layout, str(base), "2", "4"], script=FAKE_ENGINE)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return layout, base


@pytest.mark.e2e
@pytest.mark.parametrize("point", list(FAULTS))
def test_kill_during_save_resumes_from_the_last_verified_checkpoint(
    point: str, fake_base: tuple[str, Path], tmp_path: Path
) -> None:
    """The protocol's kill -9 matrix, whatever the engine: 2 ranks resume the fake engine's tag 4 and save 6 (then
    8); the named point of that first save SIGKILLs a rank. One real kill per engine is below and in test_fsdp.py."""
    layout, base = fake_base
    ckpt = tmp_path / "ck"
    shutil.copytree(base, ckpt)
    saves = [layout, str(ckpt), "6", "8"]
    crashed = run_ranks(saves, script=FAKE_ENGINE, env={**ENV, protocol.FAULT_ENV: point})
    killed_in_first_save(crashed, rank=1 if point.startswith("rank1_") else 0)
    target = protocol.select_resume(str(ckpt), None)
    assert target is not None and target.tag == FAULTS[point]
    for tag in ("tiny_qwen3-2steps", "tiny_qwen3-4steps"):
        assert file_manifest.verify(ckpt / tag) is None  # older checkpoints untouched
    if point == "mid_file":  # a shard cut short in the staging dir; the finishing run saves to the end
        staged = [
            p for p in (ckpt / ".staging-tiny_qwen3-6steps").rglob("*") if p.suffix in (".pt", ".distcp")
        ]
        assert min(p.stat().st_size for p in staged) < max(p.stat().st_size for p in staged) // 4
        done = run_ranks(saves, script=FAKE_ENGINE)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "tiny_qwen3-4steps at step 4" in done.stdout
        assert (ckpt / "latest").read_text() == "tiny_qwen3-8steps"


@pytest.mark.e2e
def test_each_rank_checksums_its_own_shard_and_a_bit_flip_in_rank_1s_is_caught_at_resume(
    fake_base: tuple[str, Path], tmp_path: Path
) -> None:
    """The manifest 2 ranks saved holds rank 1's checksum of its own shard; at the next start the ranks verify in
    parallel (rank 1 reads its shard), so one flipped bit in it sends the resume back to the older tag, with rank
    0's warning naming the file."""
    layout, base = fake_base
    ckpt = tmp_path / "ck"
    shutil.copytree(base, ckpt)
    newest = ckpt / "tiny_qwen3-4steps"
    engine_type = engines.engine_class(layout)
    (shard,) = [p for p in newest.rglob("*") if protocol.writer_rank(engine_type, str(p.relative_to(newest))) == 1
                and p.suffix in (".pt", ".distcp") and not p.name.startswith("rng_state")]  # fmt: skip
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # same size: only a checksum sees it
    shard.write_bytes(bytes(data))
    proc = run_ranks([layout, str(ckpt), "6"], script=FAKE_ENGINE)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rel = shard.relative_to(newest)
    assert f"skipping checkpoint {newest}: {rel} does not match its checksum" in proc.stdout, proc.stdout[
        -3000:
    ]
    assert "Resumed from" in proc.stdout and "tiny_qwen3-2steps at step 2" in proc.stdout


@pytest.mark.e2e
def test_a_write_failing_on_another_rank_stops_every_rank_with_its_reason(
    fake_base: tuple[str, Path], tmp_path: Path
) -> None:
    """Rank 1's write fails (a full disk) while rank 0's goes through: rank 0 reports rank 1's reason in the one
    error line (printed once every rank has given its outcome: none is left waiting in a collective), every
    rank stops, and nothing is left behind."""
    layout, base = fake_base
    ckpt = tmp_path / "ck"
    shutil.copytree(base, ckpt)
    proc = run_ranks([layout, str(ckpt), "6"], script=FAKE_ENGINE, env={**ENV, FAIL_RANK_ENV: "1"})
    # Every rank stops with status 3, unless the launcher ended it after another's exit (as torchrun does).
    assert 3 in proc.exitcodes and set(proc.exitcodes) <= {3, -signal.SIGTERM}, proc.exitcodes
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    staged = ckpt / ".staging-tiny_qwen3-6steps"
    assert errors[0].startswith(
        f"error: saving checkpoint tiny_qwen3-6steps in {ckpt} failed (rank 1: [Errno 28] No space left on "
        f"device: '{staged}/"
    ), errors[0]
    assert errors[0].endswith(
        "older checkpoints are intact: free space or pass --checkpoint_dir on a larger filesystem"
    ), errors[0]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in base.iterdir())
    assert protocol.select_resume(str(ckpt), None).tag == "tiny_qwen3-4steps"


@pytest.mark.e2e
def test_a_real_kill_during_a_deepspeed_save_resumes_from_the_last_verified_checkpoint(
    base_checkpoints, tmp_path: Path
) -> None:
    """The matrix's mid_file point on real DeepSpeed ranks: a shard cut short, then kill -9; the finishing run
    resumes from the last verified tag and reaches max_steps."""
    base, args = base_checkpoints
    ckpt = tmp_path / "ck"
    shutil.copytree(base, ckpt)
    crashed = run_ranks([*args, "--checkpoint_dir", str(ckpt)], env={**ENV, protocol.FAULT_ENV: "mid_file"})
    killed_in_first_save(crashed)
    target = protocol.select_resume(str(ckpt), None)
    assert target is not None and target.tag == FAULTS["mid_file"]
    for tag in ("tiny_qwen3-2steps", "tiny_qwen3-4steps"):
        assert file_manifest.verify(ckpt / tag) is None  # older checkpoints untouched
    done = run_ranks([*args, "--checkpoint_dir", str(ckpt)])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "tiny_qwen3-4steps at step 4" in done.stdout and "Step 8/8 | Loss" in done.stdout
    assert (ckpt / "latest").read_text() == "tiny_qwen3-8steps"


UNIVERSAL = "world size changed from 2 to 1: resuming optimizer and lr schedule state through DeepSpeed's universal checkpoint"


@pytest.mark.e2e
def test_world_size_change_resumes_through_a_universal_copy_and_time_interval_saves(
    base_checkpoints, tmp_path: Path
) -> None:
    base, args = base_checkpoints
    ckpt = tmp_path / "ck"
    shutil.copytree(base, ckpt)
    # Also the time-based interval: a tiny one makes every step due, odd steps included (freq is 2).
    proc = run_ranks([*args, "--checkpoint_dir", str(ckpt), "--checkpoint_interval_minutes", "1e-6"], nproc=1)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    copy = ckpt / "tiny_qwen3-4steps-universal"
    assert f"{UNIVERSAL} (converted in" in proc.stdout and f"to {copy})" in proc.stdout
    assert "loaded the weights only" not in proc.stdout
    assert engines.engine_of_tag(ckpt / "tiny_qwen3-4steps") == "deepspeed"  # DeepSpeed's real files
    saved = torch.load(ckpt / "tiny_qwen3-4steps" / MODEL_STATES, weights_only=False)
    consumed = saved["dskit"]["train_state"]["position"]["consumed"]  # global blocks: any world size reads it
    assert f"Resumed from {copy} at step 4 (epoch 0, block {consumed}," in proc.stdout
    assert "Step 8/8 | Loss" in proc.stdout
    assert file_manifest.verify(copy) is None  # converted with the save's protocol: verifies like any tag
    assert (
        file_manifest.read(copy)["step"] == 4
        and (copy / "zero" / "model.norm.weight" / "exp_avg.pt").is_file()
    )
    assert not (ckpt / "latest_universal").exists() and not list(ckpt.glob(".staging-*"))
    assert f"Saved checkpoint {ckpt}/tiny_qwen3-5steps" in proc.stdout
    assert f"Saved checkpoint {ckpt}/tiny_qwen3-7steps" in proc.stdout
    # Rotation kept the newest 3 and the one resumed from (with its universal copy).
    kept = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("tiny_qwen3-"))
    assert kept == [
        "tiny_qwen3-4steps", "tiny_qwen3-4steps-universal", "tiny_qwen3-6steps", "tiny_qwen3-7steps",
        "tiny_qwen3-8steps",
    ]  # fmt: skip


@pytest.mark.e2e
def test_a_crash_during_the_universal_conversion_converts_again_on_the_next_start(
    base_checkpoints, tmp_path: Path
) -> None:
    base, args = base_checkpoints
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    shutil.copytree(base / "tiny_qwen3-4steps", ckpt / "tiny_qwen3-4steps")
    one_step = [*args[:-1], "5", "--checkpoint_dir", str(ckpt)]  # --max_steps 5
    crashed = run_ranks(one_step, nproc=1, env={**ENV, protocol.FAULT_ENV: "universal_before_rename"})
    assert crashed.returncode != 0
    assert not (ckpt / "tiny_qwen3-4steps-universal").exists()  # only the staging dir's debris
    assert protocol.select_resume(str(ckpt), None).tag == "tiny_qwen3-4steps"
    done = run_ranks(one_step, nproc=1)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"{UNIVERSAL} (converted in" in done.stdout and "Step 5/5 | Loss" in done.stdout
    assert not list(ckpt.glob(".staging-*"))
    # Converted once: the next start from the same tag reuses the verified copy.
    shutil.rmtree(ckpt / "tiny_qwen3-5steps")
    again = run_ranks(one_step, nproc=1)
    assert f"{UNIVERSAL} (reusing {ckpt}/tiny_qwen3-4steps-universal)" in again.stdout


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_disk_full_during_save_is_a_clear_error_and_keeps_older_checkpoints(
    base_checkpoints, tmp_path: Path
) -> None:
    """Real DeepSpeed ranks fill the disk saving step 6: they stop with exit status 3 and one error line, and
    the ranks agree on the failure before the staging dir goes (a rank still writing cannot leave debris)."""
    base, args = base_checkpoints
    mount = tmp_path / "small"
    mount.mkdir()
    used = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={used + 200_000}", "tmpfs", str(mount)], check=True)
    ckpt = mount / "ck"
    try:
        shutil.copytree(base, ckpt)
        proc = run_ranks([*args, "--checkpoint_dir", str(ckpt)])
        tail = (proc.stdout + proc.stderr)[-3000:]
        assert 3 in proc.exitcodes and set(proc.exitcodes) <= {3, -signal.SIGTERM}, (proc.exitcodes, tail)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, tail
        line = errors[0]
        # Which save, where, why (the device is full, not just "failed"), and that nothing older was lost.
        assert line.startswith(f"error: saving checkpoint tiny_qwen3-6steps in {ckpt} failed ("), line
        assert "No space left on device" in line, line
        assert "older checkpoints are intact" in line, line
        for tag in ("tiny_qwen3-2steps", "tiny_qwen3-4steps"):
            assert file_manifest.verify(ckpt / tag) is None
        assert protocol.select_resume(str(ckpt), None) == protocol.ResumeTarget(ckpt, "tiny_qwen3-4steps")
        assert (ckpt / "latest").read_text() == "tiny_qwen3-4steps"
        # The failed save leaves nothing behind: no .staging-tiny_qwen3-6steps, no tag of step 6.
        # (and the run's ledger, which the failed attempt's start and exit were appended to)
        entries = sorted(p.name for p in ckpt.iterdir() if p.name != LEDGER)
        assert entries == sorted(p.name for p in base.iterdir() if p.name != LEDGER), entries
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.e2e
def test_s3_tier_uploads_and_a_fresh_node_resumes_from_it(base_checkpoints, s3, tmp_path: Path) -> None:
    """Against a real S3 endpoint on loopback: every verified checkpoint goes up; with the local dir gone, the
    next start downloads the newest complete one and resumes from it."""
    _, args = base_checkpoints
    ckpt = tmp_path / "ck"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}  # AWS_* point at the loopback server
    flags = [*args, "--checkpoint_dir", str(ckpt), "--s3_checkpoint_uri", s3.uri("runs/one")]
    first = run_ranks([*flags, "--max_steps", "4"], env=env)  # the last --max_steps wins
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    keys = s3.keys("runs/one/")
    assert "runs/one/tiny_qwen3-4steps/dskit_manifest.json" in keys
    assert "runs/one/tiny_qwen3-2steps/mp_rank_00_model_states.pt" in keys
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in first.stdout + first.stderr
    shutil.rmtree(ckpt)  # a new node, or a lost disk
    second = run_ranks(flags, env=env)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "downloading tiny_qwen3-4steps from s3://" in second.stdout
    assert "tiny_qwen3-4steps at step 4" in second.stdout and "Step 8/8 | Loss" in second.stdout
    assert "runs/one/tiny_qwen3-8steps/dskit_manifest.json" in s3.keys("runs/one/")


# --- a resume with another --max_steps ----------------------------------------------------------------------


def _train_in_process(ckpt: Path, metrics: Path, dist, cache: Path, *flags: str) -> str:
    """A one-rank in-process run to its --max_steps, saving every 2 steps; what rank 0 printed."""
    cfg = parse_args(
        [
            "--seq_length", "32", "--validation_fraction", "0", "--logging_freq", "1", "--checkpoint_freq", "2",
            "--keep_checkpoints", "4", "--warmup_ratio", "0.5", "--data_cache_dir", str(cache),
            "--checkpoint_dir", str(ckpt), "--metrics_file", str(metrics), *flags,
        ]
    )  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = training.Trainer(resolver.prepare(cfg, world_size=dist.world_size), dist)
        try:
            trainer.fit()
        finally:
            trainer.close()
    return out.getvalue()


@pytest.mark.e2e
# Each schedule implementation (DeepSpeed's WarmupCosineLR, the kit's LambdaLR) under one engine each: the rule
# itself is ScheduleSpec's, for every kind (tests/unit/optim/test_schedules.py).
@pytest.mark.parametrize(("backend", "schedule"), [("deepspeed", "cosine"), ("fsdp", "wsd")])
def test_a_resume_with_another_max_steps_keeps_the_warmup_and_says_the_lr_it_changes(
    tmp_path: Path, single_rank, backend: str, schedule: str
) -> None:
    """8 steps warming up over half of them (steps 1-4). The step-6 tag resumed with the same flags trains the
    uninterrupted run's lr exactly; the step-2 tag resumed with --max_steps 6 keeps the 4-step warm-up (not 3,
    half of 6), ends the decay at step 6, and says so in one line with the lr of step 3 before and after."""
    flags = ["--backend", backend, "--lr_schedule", schedule]
    cache, straight = tmp_path / "cache", tmp_path / "straight"
    _train_in_process(straight, tmp_path / "straight.jsonl", single_rank, cache, *flags, "--max_steps", "8")
    full = step_records(tmp_path / "straight.jsonl")
    assert full[3]["lr"] < full[4]["lr"] < full[5]["lr"]  # warming up through step 4

    same = copy_tags(straight, tmp_path / "same", "tiny_qwen3-6steps")
    out = _train_in_process(same, tmp_path / "same.jsonl", single_rank, cache, *flags, "--max_steps", "8")
    assert "lr schedule: " not in out, out[-3000:]  # nothing changed: nothing said
    again = step_records(tmp_path / "same.jsonl")
    assert [again[step]["lr"] for step in (7, 8)] == [full[step]["lr"] for step in (7, 8)]

    shorter = copy_tags(straight, tmp_path / "shorter", "tiny_qwen3-2steps")
    out = _train_in_process(
        shorter, tmp_path / "shorter.jsonl", single_rank, cache, *flags, "--max_steps", "6"
    )
    resumed = step_records(tmp_path / "shorter.jsonl")
    assert sorted(resumed) == [3, 4, 5, 6]
    said = [line.split(" | ", 1)[-1] for line in out.splitlines() if "| lr schedule: " in line]
    assert said == [
        "lr schedule: --max_steps 6 (was 8): warm-up kept at 4 steps (the flags now give 3); the decay now ends "
        f"at step 6; lr at step 3 {full[3]['lr']:.3g} -> {resumed[3]['lr']:.3g}"
    ], out[-3000:]
    # The warm-up as it ran, then the decay of a 6-step run (wsd: its last step).
    assert [resumed[step]["lr"] for step in (3, 4)] == [full[step]["lr"] for step in (3, 4)]
    assert resumed[5]["lr"] <= full[5]["lr"] and resumed[6]["lr"] < full[6]["lr"]


# --- one run per checkpoint dir ---------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_second_launch_into_a_live_runs_checkpoint_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    """Two launches (2 CPU ranks of the tiny default model: the first through torchrun, which Ctrl-C stops, the
    second from the rank pool) into one --checkpoint_dir: the second is refused before its ranks train, naming the first's host and pid, and touches nothing; the first trains on, and
    releases the lease when it stops (Ctrl-C)."""
    import json
    import re
    import threading

    from model_utils.checkpoint import lease
    from support import step_control
    from support.torchrun import ENV as TORCHRUN_ENV
    from support.torchrun import torchrun_cmd

    ckpt = tmp_path / "ckpt"
    flags = [
        "--max_steps", "100000", "--logging_freq", "1", "--checkpoint_freq", "100000",
        "--validation_freq", "100000", "--checkpoint_dir", str(ckpt), "--data_cache_dir", str(tmp_path / "data"),
    ]  # fmt: skip
    first = subprocess.Popen(
        torchrun_cmd([*flags, *step_control.FLAGS], log_dir=tmp_path / "torchrun"), cwd=REPO, env=TORCHRUN_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,  # its own process group: Ctrl-C goes to torchrun and its ranks
    )  # fmt: skip
    watchdog = threading.Timer(600, lambda: os.killpg(first.pid, signal.SIGKILL))
    watchdog.start()
    lines: list[str] = []
    try:
        assert first.stdout is not None
        for line in first.stdout:  # training: the lease is held
            lines.append(line)
            if re.search(r"\| Step \d+/100000 \| Loss ", line):
                break
        held = json.loads((ckpt / lease.LEASE_FILE).read_text())
        before = sorted(p.name for p in ckpt.iterdir())
        # The second launch's ranks from the rank pool (no start-up of their own to pay): it is refused at start.
        second = run_ranks(["--metrics_file", str(tmp_path / "second.jsonl"), *flags])
        after = sorted(p.name for p in ckpt.iterdir())
        still_training = first.poll() is None
        still_held = json.loads((ckpt / lease.LEASE_FILE).read_text())["token"] == held["token"]
        os.killpg(first.pid, signal.SIGINT)
        lines.extend(first.stdout)
        status = first.wait()
    finally:
        watchdog.cancel()
    out = second.stdout + second.stderr
    assert second.returncode != 0, out[-3000:]
    refusals = [line for line in out.splitlines() if "is in use by another run" in line]
    assert len(refusals) == 1, out[-3000:]  # one line, from rank 0, for every rank
    assert (
        f"checkpoint dir {ckpt} is in use by another run (host {held['host']}, pid {held['pid']}"
        in refusals[0]
    )
    # (a bare torchrun adds its own traceback for a rank's non-zero exit; the launchers refuse in their preflight)
    assert 'train_deepspeed.py", line' not in out and "| Step " not in out
    assert after == before and not (tmp_path / "second.jsonl").exists()  # the second touched nothing
    assert still_training and still_held
    first_out = "".join(lines)
    # Ctrl-C: the ranks saved and stopped (a bare torchrun then exits 1 with its own traceback; the launchers 130)
    assert status != 0 and "Preempted: stop requested by Ctrl-C; saved at step" in first_out, first_out[
        -3000:
    ]
    assert "Training finished" in first_out
    assert lease.LEASE_FILE not in {p.name for p in ckpt.iterdir()}, first_out[-3000:]  # released at its exit
