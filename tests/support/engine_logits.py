"""The trained engine's logits on a fixed batch: the reference an exported model must reproduce.

    torchrun --standalone --nproc_per_node=2 tests/support/engine_logits.py CHECKPOINT_DIR TAG DS_CONFIG OUT.pt

DS_CONFIG: a DeepSpeed JSON file, or a run file (.yaml) with the DeepSpeed config embedded. Further training flags
(e.g. --lora_r 4) are passed on to the config, so a LoRA run's engine is rebuilt with its adapters; with
--backend fsdp the FSDP engine is rebuilt (fp32 masters sharded on the ranks, bf16 compute) and its DCP tag loaded.

Builds the engine exactly as training does (same model source, same resolved DeepSpeed config, same world size:
ZeRO shards only load into the world size that wrote them), loads the tag with engine.load_checkpoint and, on
rank 0, saves {"input_ids", "logits"} (logits as fp32 copies of the bf16 forward) to OUT.pt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from model_utils.config.arguments import parse_args
from model_utils.launch import distributed
from model_utils.model import lora
from model_utils.model.models import build_model, load_tokenizer
from model_utils.optim import param_groups
from model_utils.resolve import resolver

TEXTS = (
    "Once upon a time, Lily found a red ball under the tree. She was very happy and ran to show her mom.",
    "One day, a friendly dog named Max went to the park. The sky was blue and the grass was green.",
)


def fixed_batch(tokenizer: object) -> torch.Tensor:
    """Two real sentences, cut to a common length so no padding (and no attention mask) is involved."""
    rows = [tokenizer(text)["input_ids"] for text in TEXTS]  # type: ignore[operator]
    n = min(map(len, rows))
    return torch.tensor([row[:n] for row in rows], dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir")
    parser.add_argument("tag")
    parser.add_argument("deepspeed_config")
    parser.add_argument("out")
    parser.add_argument("--model", default="tiny-qwen3")
    args, training_flags = parser.parse_known_args()

    config_flag = "--config" if args.deepspeed_config.endswith(".yaml") else "--deepspeed_config"
    cfg = parse_args(["--model", args.model, config_flag, args.deepspeed_config, *training_flags])
    dist = distributed.init_distributed()
    settings = resolver.resolve_settings(cfg)
    ts = settings.train
    model = build_model(settings.source, settings.model_config, cfg.loop.seed, ts.model_dtype())
    model = lora.apply(model, cfg.lora, cfg.loop.seed)
    if ts.backend == "fsdp":
        from model_utils.engines import fsdp_engine

        model = fsdp_engine.shard(model, dist.device, ts.precision == "bf16", cpu_offload=False)
        groups = param_groups.split_for_weight_decay(model, cfg.optim.no_decay_embeddings)
        engine = fsdp_engine.FsdpEngine(
            model, ts.optim, ts.schedule, cfg.loop.max_steps, groups.optimizer_groups(), dist.device
        )
    else:
        from model_utils.engines.deepspeed_engine import DeepSpeedEngine

        engine = DeepSpeedEngine(model, ts.deepspeed_json(micro_batch_size=1, total_steps=cfg.loop.max_steps))
    # Weights only: the logits need no optimizer state (whose parameter groups this engine does not share).
    state = engine.load(Path(args.checkpoint_dir) / args.tag, weights_only=True)
    assert state is not None, f"no checkpoint loaded from {args.checkpoint_dir}/{args.tag}"
    batch = fixed_batch(load_tokenizer(settings.source, None))
    engine.eval()
    with torch.no_grad():
        # Every rank: ZeRO-3 and FSDP gather the sharded parameters collectively in the module's hooks.
        logits = engine.module(input_ids=batch.to(dist.device)).logits
    if dist.is_main:
        torch.save({"input_ids": batch, "logits": logits.float().cpu()}, args.out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
