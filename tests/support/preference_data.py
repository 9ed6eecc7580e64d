"""TRL as the oracle of preference data, offline: its DPOTrainer's tokenized pairs (on a tiny Qwen3 model built
here) and its DataCollatorForPreference's batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")


def dpo_tokenized(tokenizer: Any, datasets: list[list[dict]], tmp_path: Path) -> list[list[tuple]]:
    """TRL's DPOTrainer's tokenized pairs (prompt_ids, chosen_ids, rejected_ids) of each list of rows, untruncated:
    the first as its train dataset, the others through the same trainer's _prepare_dataset (TRL decides a
    dataset's format by its first row, so each list holds one format)."""
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl import DPOConfig, DPOTrainer

    def model() -> Any:
        shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "head_dim": 8}
        config = Qwen3Config(vocab_size=len(tokenizer), num_attention_heads=2, num_key_value_heads=1, **shape)
        return Qwen3ForCausalLM(config)

    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True)
    trainer = DPOTrainer(
        model=model(),
        ref_model=model(),
        args=args,
        train_dataset=Dataset.from_list(datasets[0]),
        processing_class=tokenizer,
    )
    tokenized = [trainer.train_dataset] + [
        trainer._prepare_dataset(Dataset.from_list(rows), tokenizer, args, "more") for rows in datasets[1:]
    ]
    return [[tuple(r[key] for key in KEYS) for r in t] for t in tokenized]


def collated(examples: list[tuple], pad_id: int, max_length: int | None, truncation_mode: str) -> dict:
    """TRL's DataCollatorForPreference's batch of (prompt_ids, chosen_ids, rejected_ids) examples."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collator = DataCollatorForPreference(
        pad_token_id=pad_id, max_length=max_length, truncation_mode=truncation_mode
    )
    return collator([dict(zip(KEYS, example, strict=True)) for example in examples])
