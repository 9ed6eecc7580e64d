"""LoRA supervised fine-tuning end to end, offline on CPU, with the shipped example conversations: the shipped
run file through `./train-singlenode.sh` (DeepSpeed ZeRO-3, as the file embeds it) and the same data under FSDP
(the rank pool's in-process ranks), each exported merged and reloaded. What they must show: conversations packed
whole, the loss on the assistant tokens only (trained tokens far fewer than all), a loss that falls, an export
that loads and carries the chat template the run trained with (--chat_template) in its tokenizer, a merge onto
the fp32 base the run started from (peft's merge of the adapter onto it, exactly; the checkpoint's bf16 copy of
the base only where that base is gone or changed, and said), and a resume with another template refused."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dskit import cli
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export(ckpt, tmp_path / "exported")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # merged: every key present, no adapter left over
    assert not any("lora" in name for name, _ in model.named_parameters())
    # Prompted as it was trained: the template of --chat_template, in the exported tokenizer.
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == TEMPLATE.read_text()
    turn = [{"role": "user", "content": "Hi"}]
    assert (
        tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        == "User: Hi\nAssistant: "
    )


def merged_onto_the_fp32_base(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fp32 merged export is peft's merge of the run's adapter onto the fp32 base it started from, bit for bit
    (not onto the checkpoint's bf16 copy of that base); where the base is gone or not the one the run trained
    on, the copy is used, and the line says so."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "tiny-base"
    for args in (["fp32"], ["adapter", "--adapter_only"]):
        assert cli.main(["export", str(ckpt), str(tmp_path / args[0]), "--dtype", "fp32", *args[1:]]) == 0
    said = capsys.readouterr().out
    assert f"LoRA: merging the adapter onto the base the run started from, {base} (float32)\n" in said, said
    fp32_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    reference = PeftModel.from_pretrained(fp32_base, tmp_path / "adapter").merge_and_unload().state_dict()
    merged = load_file(tmp_path / "fp32" / "model.safetensors")
    assert merged and all(torch.equal(weight, reference[name]) for name, weight in merged.items())

    def merged_onto_the_copy(why: str) -> dict[str, torch.Tensor]:
        out = tmp_path / f"copy-{len(list(tmp_path.glob('copy-*')))}"
        assert cli.main(["export", str(ckpt), str(out), "--dtype", "fp32"]) == 0
        said = capsys.readouterr().out
        assert f"LoRA: merging the adapter onto the checkpoint's bf16 copy of the base ({why}" in said, said
        return load_file(out / "model.safetensors")

    base.rename(tmp_path / "moved")
    onto_copy = merged_onto_the_copy(f"{base} is not there)")
    (tmp_path / "moved").rename(base)
    # The copy is the base rounded to bf16: the merge is off by that rounding, no more.
    name = next(n for n in onto_copy if n.endswith("q_proj.weight"))
    off = (onto_copy[name] - merged[name]).abs()
    assert 0 < off.max() <= merged[name].abs().max() * 2**-8, off.max()
    save_tiny_qwen3(base, seed=1)  # another model in its place: not what the run trained on
    merged_onto_the_copy(f"the base at {base} is not the one the run trained on: its ")


@pytest.mark.e2e
@pytest.mark.launcher
def test_the_shipped_sft_run_file_trains_the_example_conversations_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's `./train-singlenode.sh --config configs/qwen3-0.6b-sft-lora.yaml --model out/tiny-base --dataset
    ... --chat_template src/model_utils/assets/tiny_chat_template.jinja`, its export, and a resume of it with
    another template."""
    cmd = [str(REPO / "train-singlenode.sh"), "--config", str(SFT_FILE), *data_flags(tmp_path)]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    launch = json.loads((tmp_path / "ck" / f"tiny_base-{STEPS}steps" / "launch.json").read_text())
    assert launch["deepspeed_config"]["zero_optimization"]["stage"] == 3  # the run file's embedded config
    assert launch["config"]["lora"]["lora_r"] == 16 and launch["config"]["data"]["data_format"] == "messages"
    assistant_only_loss_trained(out, tmp_path / "m.jsonl")
    reloads(tmp_path, tmp_path / "ck")
    other = tmp_path / "other.jinja"
    other.write_text(TEMPLATE.read_text().replace("'Assistant: '", "'Bot: '"))
    more = {str(TEMPLATE): str(other), str(STEPS): str(STEPS + 4)}
    done = subprocess.run([more.get(a, a) for a in cmd], env=ENV, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-4000:]
    assert (
        f"error: checkpoint {tmp_path / 'ck' / f'tiny_base-{STEPS}steps'} was trained with another chat template "
        f"(--chat_template {TEMPLATE}), which its hf_config/ holds, not this run's: resume with"
    ) in out, out[-4000:]
    merged_onto_the_fp32_base(tmp_path, tmp_path / "ck", capsys)


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
