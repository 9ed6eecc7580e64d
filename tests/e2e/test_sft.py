"""LoRA supervised fine-tuning end to end, offline on CPU, with the shipped example conversations: the shipped
run file through `./train-singlenode.sh` (DeepSpeed ZeRO-3, as the file embeds it) and the same data under FSDP
(the rank pool's in-process ranks), each exported merged and reloaded. What they must show: conversations packed
whole, the loss on the assistant tokens only (trained tokens far fewer than all), a loss that falls, and an
export that loads and gives the trained model's loss on the same conversations."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from dskit.export import export
from support.metrics_file import step_records
from support.pretrained import save_tiny_qwen3
from support.rank_pool import train
from support.torchrun import ENV, REPO

CONVERSATIONS = REPO / "src" / "model_utils" / "assets" / "tiny_conversations.jsonl"
TEMPLATE = REPO / "src" / "model_utils" / "assets" / "tiny_chat_template.jinja"
SFT_FILE = REPO / "configs" / "qwen3-0.6b-sft-lora.yaml"
STEPS = 24


def data_flags(tmp_path: Path) -> list[str]:
    # LoRA needs pretrained weights: the tiny model saved as a model dir (what README's `dskit export` of the
    # embedded default's run gives).
    model = tmp_path / "tiny-base"
    if not model.exists():
        save_tiny_qwen3(model)
    return [
        "--model", str(model), "--dataset", str(CONVERSATIONS), "--chat_template", str(TEMPLATE),
        "--seq_length", "256", "--max_steps", str(STEPS), "--logging_freq", "4", "--checkpoint_freq", "12",
        "--validation_freq", "12", "--gradient_accumulation_steps", "2", "--lr", "3e-3",
        "--metrics_file", str(tmp_path / "m.jsonl"), "--checkpoint_dir", str(tmp_path / "ck"),
    ]  # fmt: skip


def assistant_only_loss_trained(out: str, metrics: Path) -> None:
    # Conversations packed whole: the packing summary; the loss on the assistant turns: trained tokens a part.
    assert re.search(r"Data: train: packed [\d,]+ documents into [\d,]+ blocks", out), out[-3000:]
    records = step_records(metrics)
    first, last = records[min(records)], records[STEPS]
    assert 0 < last["trained_tokens_per_s"] < 0.8 * last["tokens_per_s"], last
    assert last["loss"] < first["loss"] - 0.3, (first["loss"], last["loss"])


def reloads(tmp_path: Path, ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = export(ckpt, tmp_path / "exported")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # merged: every key present, no adapter left over
    assert not any("lora" in name for name, _ in model.named_parameters())


@pytest.mark.e2e
@pytest.mark.launcher
def test_the_shipped_sft_run_file_trains_the_example_conversations_offline(tmp_path: Path) -> None:
    """README's `./train-singlenode.sh --config configs/qwen3-0.6b-sft-lora.yaml --model out/tiny-base --dataset
    ... --chat_template src/model_utils/assets/tiny_chat_template.jinja`."""
    cmd = [str(REPO / "train-singlenode.sh"), "--config", str(SFT_FILE), *data_flags(tmp_path)]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    launch = json.loads((tmp_path / "ck" / f"tiny_base-{STEPS}steps" / "launch.json").read_text())
    assert launch["deepspeed_config"]["zero_optimization"]["stage"] == 3  # the run file's embedded config
    assert launch["config"]["lora"]["lora_r"] == 16 and launch["config"]["data"]["data_format"] == "messages"
    assistant_only_loss_trained(out, tmp_path / "m.jsonl")
    reloads(tmp_path, tmp_path / "ck")


@pytest.mark.e2e
def test_lora_sft_under_fsdp_trains_and_exports(tmp_path: Path) -> None:
    flags = [
        *data_flags(tmp_path),
        "--backend",
        "fsdp",
        "--lora_r",
        "8",
        "--data_cache_dir",
        str(tmp_path / "c"),
    ]
    out = train(flags, cwd=tmp_path, timeout=900)
    assistant_only_loss_trained(out, tmp_path / "m.jsonl")
    reloads(tmp_path, tmp_path / "ck")
