"""The model card of a push: what the checkpoint's launch.json and the run's ledger say (the push itself against a
stand-in hub: tests/e2e/test_export.py)."""

from __future__ import annotations

import json
from pathlib import Path

from dskit import hub_push


def test_the_card_states_base_model_data_steps_tokens_and_final_losses(tmp_path: Path) -> None:
    tag = tmp_path / "qwen3-6steps"
    tag.mkdir()
    launch = {
        "config": {
            "model": {"model": "Qwen/Qwen3-0.6B"},
            "data": {"dataset": "/fsx/c4"},
            "lora": {"lora_r": 8},
        }
    }
    (tag / "launch.json").write_text(json.dumps(launch))
    records = [
        {"event": "start", "t": 0, "launched_at": 0, "tokens_per_step": 1000},
        {"event": "steps", "t": 1, "started_at": 0, "first": 1, "last": 4, "trained": 4, "trained_s": 1, "loss": 3.5},
        {"event": "validation", "t": 2, "step": 4, "seconds": 1, "loss": 3.9},
        {"event": "steps", "t": 3, "started_at": 2, "first": 5, "last": 6, "trained": 2, "trained_s": 1, "loss": 3.25},
        {"event": "steps", "t": 4, "started_at": 3, "first": 7, "last": 8, "trained": 2, "trained_s": 1, "loss": 9.0},
    ]  # fmt: skip
    (tmp_path / "dskit-ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    card = hub_push.card_for_checkpoint(tag, "me/qwen-sft")
    assert card.startswith(
        "---\nlibrary_name: transformers\ntags:\n- dskit\nbase_model: Qwen/Qwen3-0.6B\n---\n"
    )
    assert "# qwen-sft" in card and "| data | /fsx/c4 |" in card and "| optimizer steps | 6 |" in card
    assert "| tokens trained | 6,000 |" in card
    # The exported step's values, not those of steps trained after it.
    assert (
        "| last training loss (rank 0's share of its step) | 3.2500 |" in card
        and "| final validation loss | 3.9000 |" in card
    )
    assert "| LoRA | r=8, merged into the weights |" in card


def test_a_local_base_model_is_not_claimed_as_a_hub_base_model(tmp_path: Path) -> None:
    card = hub_push.model_card({"config": {"model": {"model": "/fsx/models/qwen"}}}, {"step": 3}, "me/x")
    assert "base_model:" not in card and "| base model | /fsx/models/qwen |" in card
    assert "training loss" not in card  # nothing recorded: nothing claimed


def test_the_card_says_the_model_carries_the_chat_template_it_was_trained_with() -> None:
    launch = {
        "config": {"model": {"model": "out/base"}, "data": {"chat_template": "chat.jinja"}},
        "chat_template": "{{ messages }}",
    }
    card = hub_push.model_card(launch, {"step": 3}, "me/x")
    assert (
        "| chat template | `--chat_template chat.jinja`, carried in the tokenizer: `tokenizer.apply_chat_template` "
        "prompts the model as it was trained |"
    ) in card
    launch["config"]["data"] = {}  # the tokenizer's own
    assert "| chat template | carried in the tokenizer: " in hub_push.model_card(launch, {"step": 3}, "me/x")
    # No template (a base model pretrained on text), or a checkpoint of a kit before the record: nothing claimed.
    for without in ({**launch, "chat_template": None}, {"config": launch["config"]}):
        assert "chat template" not in hub_push.model_card(without, {"step": 3}, "me/x")
