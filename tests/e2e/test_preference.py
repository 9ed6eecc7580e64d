"""Preference tuning end to end, offline on CPU, on the shipped example pairs: the shipped DPO run file through
the rank pool's in-process ranks (LoRA, ZeRO-3, 2 ranks: the reference is the base with its adapters off), DPO with
full fine-tuning, DPO with LoRA under FSDP2, and SimPO. What they must show: the first step's loss ln 2 (the
policy is its reference), a reward accuracy that rises above one half, validation on held-out pairs with the same
metrics, a resume equal to the uninterrupted run that reads the reference log-probabilities back, a resume onto
other starting weights refused, and an export that reloads with its chat template. The losses' agreement with
TRL: tests/unit/engines/test_preference.py; 1 rank against 2 and ZeRO-3/FSDP2: tests/e2e/test_step_loss.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from dskit.export import export
from support.metrics_file import step_records
from support.pretrained import save_tiny_qwen3
from support.rank_pool import run_ranks, train
from support.torchrun import REPO

pytestmark = pytest.mark.e2e

PAIRS = REPO / "src" / "model_utils" / "assets" / "tiny_preferences.jsonl"
TEMPLATE = REPO / "src" / "model_utils" / "assets" / "tiny_chat_template.jinja"
DPO_FILE = REPO / "configs" / "qwen3-0.6b-dpo-lora.yaml"
STEPS = 12


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def base(tmp_path: Path, seed: int = 0) -> Path:
    model = tmp_path / f"tiny-base-{seed}"
    if not model.exists():
        save_tiny_qwen3(model, seed)
    return model


def flags(tmp_path: Path, name: str, *more: str) -> list[str]:
    return [
        "--dataset", str(PAIRS), "--chat_template", str(TEMPLATE), "--seq_length", "128",
        "--logging_freq", "1", "--metrics_file", str(tmp_path / f"{name}.jsonl"),
        "--data_cache_dir", str(tmp_path / "cache"), *more,
    ]  # fmt: skip


def test_the_shipped_dpo_run_file_tunes_the_example_pairs_offline(tmp_path: Path) -> None:
    """README's `./train-singlenode.sh --config configs/qwen3-0.6b-dpo-lora.yaml --model out/tiny-sft --dataset
    src/model_utils/assets/tiny_preferences.jsonl --seq_length 128 --max_steps 12 --lr 1e-3` (on a saved tiny base
    with the example template: what README's SFT export gives) on the rank pool's 2 ranks (the launcher and a run file
    through it: tests/e2e/test_sft.py), its accuracy curve and its export."""
    more = [
        "--model",
        str(base(tmp_path)),
        "--max_steps",
        str(STEPS),
        "--checkpoint_dir",
        str(tmp_path / "ck"),
    ]
    more += ["--validation_freq", "6", "--lr", "1e-3"]
    out = train(["--config", str(DPO_FILE), *flags(tmp_path, "m", *more)], tmp_path, timeout=900)
    assert "Objective: DPO (sigmoid loss): beta 0.1; reference: the starting weights" in out
    assert "Reference: the DPO reference log-probabilities of" in out and "computed in" in out, out[-3000:]
    launch = json.loads((tmp_path / "ck" / f"tiny_base_0-{STEPS}steps" / "launch.json").read_text())
    assert launch["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert launch["config"]["lora"]["lora_r"] == 16 and launch["config"]["objective"]["objective"] == "dpo"
    steps = step_records(tmp_path / "m.jsonl")
    # The policy starts as its reference (LoRA's adapters start at zero): every reward 0, the loss ln 2.
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=2e-3), steps[1]
    assert steps[1]["reward_margin"] == pytest.approx(0.0, abs=0.05)
    curve = [steps[s]["reward_accuracy"] for s in sorted(steps)]
    print("DPO reward accuracy by step:", " ".join(f"{a:.2f}" for a in curve))
    assert sum(curve[-4:]) / 4 > 0.5 and steps[STEPS]["loss"] < math.log(2), curve
    validations = [r for r in records(tmp_path / "m.jsonl") if "val_reward_accuracy" in r]
    assert [v["step"] for v in validations] == [6, 12] and "val_ppl" not in validations[0], validations
    assert validations[-1]["val_reward_margin"] > 0, validations
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = export(tmp_path / "ck", tmp_path / "exported")
    _, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not any(info.values()), info
    assert AutoTokenizer.from_pretrained(exported).chat_template == TEMPLATE.read_text()


def test_dpo_resumes_as_the_uninterrupted_run_and_refuses_another_reference(tmp_path: Path) -> None:
    """Full fine-tuning, DeepSpeed on 2 ranks: 8 steps straight; its step-4 checkpoint resumed to step 8 reads the
    reference log-probabilities back and trains steps 5-8 as the straight run did; --validation_only on its last
    checkpoint measures what its last validation did; a resume from other starting weights, or without the reference
    file, is refused in one line."""
    common = [
        "--model",
        str(base(tmp_path)),
        "--objective",
        "dpo",
        "--max_steps",
        "8",
        "--checkpoint_freq",
        "4",
    ]
    common += ["--gradient_accumulation_steps", "2", "--lr", "1e-3", "--validation_freq", "4"]
    straight = train(
        [*flags(tmp_path, "straight"), *common, "--checkpoint_dir", str(tmp_path / "a")], tmp_path
    )
    assert "computed in" in straight
    half = tmp_path / "b"
    half.mkdir()
    shutil.copytree(tmp_path / "a" / "tiny_base_0-4steps", half / "tiny_base_0-4steps")
    (half / "latest").write_text("tiny_base_0-4steps")
    resumed = train([*flags(tmp_path, "resumed"), *common, "--checkpoint_dir", str(half)], tmp_path)
    assert "Reference: the DPO reference log-probabilities of" in resumed and ", from " in resumed, resumed[
        -3000:
    ]
    full, again = step_records(tmp_path / "straight.jsonl"), step_records(tmp_path / "resumed.jsonl")
    assert sorted(again) == [5, 6, 7, 8]
    for step, record in again.items():
        for key in ("loss", "reward_margin", "reward_accuracy", "logp_chosen"):
            assert record[key] == pytest.approx(full[step][key], abs=1e-4), (step, key)
        assert (record["epoch"], record["consumed"]) == (full[step]["epoch"], full[step]["consumed"])

    # --validation_only on the straight run's last checkpoint: its step-8 validation again, the same pairs' metrics.
    train(
        [
            *flags(tmp_path, "validated"),
            *common,
            "--checkpoint_dir",
            str(tmp_path / "a"),
            "--validation_only",
            "true",
        ],
        tmp_path,
    )
    (measured,) = [r for r in records(tmp_path / "validated.jsonl") if "val_loss" in r]
    (at_8,) = [r for r in records(tmp_path / "straight.jsonl") if "val_loss" in r and r["step"] == 8]
    for key in ("val_loss", "val_reward_margin", "val_reward_accuracy", "val_pairs"):
        assert measured[key] == pytest.approx(at_8[key], abs=1e-5), key

    other = [a if a != str(base(tmp_path)) else str(base(tmp_path, seed=1)) for a in common]
    refused = run_ranks(
        [*flags(tmp_path, "other"), *other, "--max_steps", "12", "--checkpoint_dir", str(half)], cwd=tmp_path
    )
    assert refused.exitcodes != [0, 0]
    assert "error: the run's DPO reference was the weights it started from (fingerprint" in refused.stdout + (
        refused.stderr
    ), refused.stderr[-3000:]
    shutil.rmtree(tmp_path / "cache" / "reference")
    gone = run_ranks(
        [*flags(tmp_path, "gone"), *common, "--max_steps", "12", "--checkpoint_dir", str(half)], cwd=tmp_path
    )
    said = gone.stdout + gone.stderr
    started_from = (
        "error: the DPO reference log-probabilities of these pairs under the weights the run started from"
    )
    assert started_from in said and "are gone or were never computed" in said, said[-3000:]


def test_dpo_with_lora_under_fsdp_and_simpo_train(tmp_path: Path) -> None:
    """FSDP2 with LoRA: the reference pass runs through the sharded model with its adapters off, so the first step's
    loss is ln 2; SimPO (DeepSpeed) trains with no reference at all."""
    more = ["--model", str(base(tmp_path)), "--objective", "dpo", "--backend", "fsdp", "--lora_r", "8"]
    more += ["--max_steps", "4", "--lr", "3e-3", "--checkpoint_dir", str(tmp_path / "fsdp")]
    out = train([*flags(tmp_path, "fsdp"), *more], tmp_path)
    assert "computed in" in out and "with FSDP2 for 4 steps" in out, out[-3000:]
    steps = step_records(tmp_path / "fsdp.jsonl")
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=2e-3) and steps[1]["reward_margin"] == 0
    assert steps[4]["reward_margin"] > 0, steps

    more = ["--model", str(base(tmp_path)), "--objective", "simpo", "--beta", "2"]
    more += ["--max_steps", "6", "--lr", "3e-3", "--checkpoint_dir", str(tmp_path / "simpo")]
    out = train([*flags(tmp_path, "simpo"), *more], tmp_path)
    assert "Objective: SimPO (reference-free): beta 2, gamma 0.5" in out and "Reference:" not in out
    steps = step_records(tmp_path / "simpo.jsonl")
    assert sorted(steps) == list(range(1, 7)) and steps[6]["loss"] < steps[1]["loss"], steps
