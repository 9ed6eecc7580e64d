"""What the config and the model decide, before any data work (resolver.resolve_settings makes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_utils.config.arguments import TrainConfig
from model_utils.model import activation_checkpointing, hub, models
from model_utils.resolve.train_settings import TrainSettings


@dataclass(frozen=True)
class RunSettings:
    """What the config and the model decide, before any data work."""

    config: TrainConfig  # the user's, as parsed, with the launch environment's settings joined
    source: models.ModelSource
    model_config: Any
    seq_length: int
    train: TrainSettings
    spike_guard: str  # the mode that runs: --spike_guard, or off where DeepSpeed cannot discard a step
    # a hub tokenizer's pinned snapshot (a hub model's own: its snapshot); resolved by prepare, with the tokenizer
    tokenizer: hub.Snapshot | None = None

    def to_dict(self) -> dict[str, Any]:
        ts = self.train
        pins = {  # recorded in every checkpoint's launch.json: the weights and tokenizer the run started from
            f"{role}_commit": snap.commit
            for role, snap in (("model", self.source.snapshot), ("tokenizer", self.tokenizer))
            if snap is not None
        }
        return {
            "model": self.source.name,
            **pins,
            "seq_length": self.seq_length,
            "micro_batch_size": ts.micro_batch_size,
            "gradient_accumulation_steps": ts.gradient_accumulation_steps,
            "lr": ts.optim.lr,
            "warmup_steps": ts.schedule.warmup_steps,
            "backend": ts.backend,
            "precision": ts.precision,
            "zero_stage": ts.zero_stage,
            "spike_guard": self.spike_guard,
            "activation_checkpointing": activation_checkpointing.describe(
                self.config.model.activation_checkpointing, int(self.model_config.num_hidden_layers)
            ),
        }
