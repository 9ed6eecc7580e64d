"""The spike guard in real DeepSpeed runs, with real faults injected (support/faults.py).

What a skipped step must equal is a run that never saw its data: the fault `drop@N` consumes the N-th step's
data without training, so a guarded run with a spike at N and an unguarded run dropping N must train the same
steps with the same losses, before the fault (the guard changes nothing on a clean run) and after it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_utils.errors import RunDiverged
from support import faults
from support.deepspeed_files import config_with
from support.metrics_file import step_records, tensorboard_scalars
from support.rank_pool import ENV, REPO, run_ranks, train
from support.small_trainer import make_trainer

pytestmark = pytest.mark.e2e


# Every kind of DeepSpeed set-up the guard runs on (preflight refuses it where DeepSpeed cannot discard).
CONFIGS = {
    "bf16 ZeRO-2 CPU offload, accumulation 2": lambda t: ["--gradient_accumulation_steps", "2"],
    "bf16 ZeRO-3 parameter and optimizer offload": lambda t: [
        "--config",
        str(REPO / "configs" / "zero3-offload.yaml"),
        "--gradient_accumulation_steps",
        "2",
    ],
    "bf16 without ZeRO": lambda t: ["--deepspeed_config", config_with(t, zero_optimization={"stage": 0})],
    "fp16 ZeRO-2": lambda t: [
        "--deepspeed_config",
        config_with(
            t, bf16=None, fp16={"enabled": True, "initial_scale_power": 8}, zero_optimization={"stage": 2}
        ),
    ],
    "fp32 ZeRO-3": lambda t: [
        "--deepspeed_config",
        config_with(t, bf16=None, zero_optimization={"stage": 3}),
    ],
    # FSDP steps its optimizer itself: a discarded step drops its gradients (no optimizer or scheduler step).
    "FSDP bf16, accumulation 2": lambda t: ["--backend", "fsdp", "--gradient_accumulation_steps", "2"],
}


def run_steps(tmp_path: Path, dist, monkeypatch, fault: str, *flags: str) -> list[tuple[bool, float]]:
    """(step stands, loss) for each turn of the loop until step 6, in this process."""
    monkeypatch.setenv(faults.FAULTS, fault)
    # A short window judging from its filling, for a short run; a wide margin, so the early descent's ups and
    # downs are no spikes.
    window = (
        [] if "off" in flags else ["--spike_window", "3", "--spike_warmup_steps", "0", "--spike_sigma", "50"]
    )
    trainer = make_trainer(tmp_path, dist, "--max_steps", "6", *window, *faults.FLAGS, *flags)
    try:
        trainer.engine.train()
        turns = []
        while trainer.state.step < 6:
            report = trainer.step()
            turns.append((report.trained, report.loss))
        return turns
    finally:
        trainer.close()


def allow_fp16_on_this_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (CPUs without AVX512-FP16 or
    AMX-FP16: AMD EPYC, older Xeons); torch's own CPU kernels compute in fp16 on any CPU. What is tested is the
    loss scaler's skip, the same on every device: the refusal is lifted there (the one stand-in in this file)."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


def trained(turns: list[tuple[bool, float]]) -> list[float]:
    return [loss for stands, loss in turns if stands]


@pytest.mark.parametrize("setup", list(CONFIGS))
def test_a_skipped_step_leaves_the_engine_exactly_as_if_it_never_saw_the_batch(
    setup: str, tmp_path: Path, single_rank, monkeypatch
) -> None:
    """DeepSpeed cannot drop accumulated ZeRO gradients nor step without a backward; the engine discards a step
    through DeepSpeed's own overflow check. Exact: the same losses, step for step, as dropping the data."""
    flags = CONFIGS[setup](tmp_path)
    if setup.startswith("fp16"):
        allow_fp16_on_this_cpu(monkeypatch)
    skipped = run_steps(tmp_path / "skip", single_rank, monkeypatch, "loss@4", *flags)
    dropped = run_steps(tmp_path / "drop", single_rank, monkeypatch, "drop@4", "--spike_guard", "off", *flags)
    assert [stands for stands, _ in skipped] == [True, True, True, False, True, True, True]
    assert trained(skipped) == trained(dropped)  # bit for bit
    if setup.startswith("bf16 ZeRO-2"):  # the fault is real: unguarded, it changes every later step
        hit = run_steps(tmp_path / "hit", single_rank, monkeypatch, "loss@4", "--spike_guard", "off", *flags)
        assert trained(hit)[:3] == trained(dropped)[:3]
        assert all(a != b for a, b in zip(trained(hit)[4:], trained(dropped)[3:], strict=False))


def test_loss_spikes_in_a_row_stop_a_skip_mode_run(tmp_path: Path, single_rank, monkeypatch) -> None:
    with pytest.raises(RunDiverged, match=r"3 steps in a row skipped as loss spikes.*--spike_guard rollback"):
        run_steps(tmp_path, single_rank, monkeypatch, "loss@4+")


def guarded_flags(cache: Path, out: Path) -> list[str]:
    return [
        "--max_steps", "12", "--logging_freq", "1", "--checkpoint_freq", "4", "--micro_batch_size", "1",
        "--gradient_accumulation_steps", "2", "--seq_length", "32", "--validation_fraction", "0",
        "--warmup_steps", "2", "--data_cache_dir", str(cache),
        "--checkpoint_dir", str(out / "ckpt"), "--metrics_file", str(out / "metrics.jsonl"), *faults.FLAGS,
    ]  # fmt: skip


def events(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "event" in r]


def test_a_skip_and_a_rollback_on_two_ranks_equal_a_run_that_never_saw_their_data(tmp_path: Path) -> None:
    """The 6th step's loss spikes (skipped before the update); the 10th step's gradient spikes (seen after the
    update: rolled back to step 8, its data skipped). Against a run that drops those two steps' data."""
    cache = tmp_path / "cache"
    guarded, plain = tmp_path / "guarded", tmp_path / "plain"
    out = train(
        [
            *guarded_flags(cache, guarded),
            "--spike_guard",
            "rollback",
            "--spike_window",
            "4",
            "--spike_warmup_steps",
            "0",
            "--rollback_skip_steps",
            "0",
            "--report_to",
            "tensorboard",
            "--report_dir",
            str(guarded / "logs"),
        ],
        tmp_path,
        env={**ENV, **faults.env("loss@6,grad@10")},
    )
    train(
        [*guarded_flags(cache, plain), "--spike_guard", "off"],
        tmp_path,
        env={**ENV, **faults.env("drop@6,drop@10")},
    )
    assert "Spike guard: skipped step 6: loss" in out and "no update, its data is consumed" in out
    assert "Spike guard: grad norm" in out and "rolled back from step 9 to step 8 (tiny_qwen3-8steps)" in out
    assert "Spike guard: skipped 1 steps of data" in out and "Step 12/12 | Loss" in out
    kinds = [(e["event"], e["step"]) for e in events(guarded / "metrics.jsonl") if e["event"] != "checkpoint"]
    assert kinds == [("start", 0), ("spike_skip", 6), ("spike_grad_norm", 9), ("rollback", 8), ("end", 12)]
    rollback = events(guarded / "metrics.jsonl")[-3]
    assert rollback["from_step"] == 9 and rollback["skip_from"] == {"epoch": 0, "consumed": 36}
    assert rollback["skip_to"] == {"epoch": 0, "consumed": 40}  # the 10th step's 4 blocks (2 ranks x 2)

    # Every step as the plain run trained it: the same data, the same losses (a rolled-back step's last record).
    mine, theirs = step_records(guarded / "metrics.jsonl"), step_records(plain / "metrics.jsonl")
    assert sorted(mine) == sorted(theirs) == list(range(1, 13))
    for step in mine:
        assert mine[step]["loss"] == pytest.approx(theirs[step]["loss"], abs=1e-6), step
    # The guard's state travels with the checkpoint; the tracker has a point at each skip and rollback.
    saved = torch.load(
        guarded / "ckpt" / "tiny_qwen3-12steps" / "mp_rank_00_model_states.pt", weights_only=False
    )
    state = saved["dskit"]["train_state"]["observers"]["spike_guard"]
    assert (state["skipped_steps"], state["rollbacks"], state["skipped_data"]) == (1, 1, [[[0, 36], [0, 40]]])
    (run_dir,) = (guarded / "logs" / "tensorboard").iterdir()
    scalars = tensorboard_scalars(run_dir)
    assert scalars["spike_guard/skipped_steps"][0] == (6, 1.0) and scalars["spike_guard/rollbacks"][-1] == (
        8,
        1.0,
    )


def test_damage_that_comes_back_after_every_rollback_stops_the_run_with_one_line(tmp_path: Path) -> None:
    proc = run_ranks(
        [
            *guarded_flags(tmp_path / "cache", tmp_path),
            "--spike_guard",
            "rollback",
            "--spike_window",
            "4",
            "--spike_warmup_steps",
            "0",
            "--max_rollbacks",
            "1",
        ],
        nproc=1,
        cwd=tmp_path,
        env={**ENV, **faults.env("grad@6+")},
    )
    # The rank exits with status 4 (not 2: no flag is wrong); the launcher then fails the whole job.
    assert proc.returncode != 0 and proc.exitcodes == [4], (proc.stdout + proc.stderr)[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: the spike guard stopped the run at step 5: grad norm"
    )
    assert errors[0].endswith(
        "at step 5 after 1 rollbacks (--max_rollbacks 1): the run keeps diverging; lower --lr, or inspect the data "
        "around the skipped ranges in the metrics file"
    )
    assert "rolled back from step 6 to step 4" in proc.stdout
    end = events(tmp_path / "metrics.jsonl")[-1]
    assert (end["event"], end["step"], end["reason"]) == ("end", 5, "diverged")
