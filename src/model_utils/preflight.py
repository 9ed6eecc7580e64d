"""Everything a run needs before the first step, checked in order so bad input fails early and clearly.

Used by the training ranks and by `dskit prepare` (one process, no GPUs), which the launchers run first: it
reports mistakes as one line and leaves the packed data in the cache, so the ranks start straight from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model_utils import checkpoint, concat_dataset, launch_record, models
from model_utils.arguments import AUTO, TrainConfig
from model_utils.errors import ConfigError
from model_utils.log import print0


@dataclass
class PreparedRun:
    source: models.ModelSource
    model_config: Any
    tokenizer: Any
    train_blocks: np.ndarray
    val_blocks: np.ndarray | None
    resume: checkpoint.ResumeTarget | None


def _blocks_or_error(
    docs: Any, tokenizer: Any, cfg: TrainConfig, role: str, run_first: Callable[[Callable[[], Any]], Any]
) -> np.ndarray:
    data = cfg.data
    cache = Path(data.data_cache_dir)
    blocks = run_first(
        lambda: concat_dataset.packed_blocks(docs, tokenizer, data.text_field, data.seq_length, cache, role)
    )
    if len(blocks) == 0:
        hint = (
            "raise --validation_fraction, or set it to 0 to skip validation"
            if role == "validation"
            else ("use more data or a smaller --seq_length")
        )
        raise ConfigError(
            f"{role} data of {data.dataset} has fewer tokens than one block of {data.seq_length}: {hint}"
        )
    return blocks


def _select_resume(cfg: TrainConfig) -> checkpoint.ResumeTarget | None:
    """The newest verified local checkpoint; with an S3 tier and none local, the newest complete one in S3."""
    ckpt = cfg.checkpoint
    target = checkpoint.select_resume(ckpt.checkpoint_dir, ckpt.resume_from_checkpoint)
    if ckpt.s3_checkpoint_uri is None:
        return target
    from model_utils import s3_tier

    tier = s3_tier.S3Tier(ckpt.s3_checkpoint_uri)
    tier.check_access()
    if target is not None or ckpt.resume_from_checkpoint is not None:
        return target
    tag = tier.newest_complete_tag()
    if tag is None:
        return None
    print0(f"No verified local checkpoint: downloading {tag} from {ckpt.s3_checkpoint_uri}")
    tier.download(tag, Path(ckpt.checkpoint_dir))
    return checkpoint.select_resume(ckpt.checkpoint_dir, None)


def _here(fn: Callable[[], Any]) -> Any:
    return fn()


def prepare(
    cfg: TrainConfig,
    run_first: Callable[[Callable[[], Any]], Any] = _here,
    decide_once: Callable[[Callable[[], Any]], Any] = _here,
) -> PreparedRun:
    """Resolve model, tokenizer, sequence length, checkpoint target and packed data.

    `run_first` runs a cache-building function on one rank before the others (they then read the cache);
    `decide_once` runs a decision (which checkpoint verifies) on one rank and shares it.
    Mutates cfg.data.seq_length to the resolved value.
    """
    source = models.resolve_model_source(cfg.model.model)
    checkpoint.check_writable(cfg.checkpoint.checkpoint_dir)
    if cfg.report.tracking_uri is not None:
        from model_utils import trackers

        # Fails in seconds when a tracking server is down, not after MLflow's minutes of retries.
        decide_once(lambda: trackers.check_reachable(cfg.report.tracking_uri))
    resume = decide_once(lambda: _select_resume(cfg))
    model_config = models.load_model_config(source)
    cfg.data.seq_length = models.resolve_seq_length(cfg.data.seq_length, model_config)
    if resume is not None:  # refuse another architecture or block length before any data work
        launch_record.check_resume(resume.path, model_config, cfg.data.seq_length, world_size=None)
    tokenizer = models.load_tokenizer(source, cfg.model.tokenizer)
    models.check_vocab(tokenizer, model_config)
    data = cfg.data
    if data.dataset.startswith("s3://"):
        from model_utils import s3_tier

        local = run_first(lambda: s3_tier.fetch_dataset(data.dataset, Path(data.data_cache_dir)))
        data = dataclasses.replace(data, dataset=str(local), local_dataset=True)
    train_docs, val_docs = concat_dataset.load_documents(data, cfg.loop.seed)
    train_blocks = _blocks_or_error(train_docs, tokenizer, cfg, "train", run_first)
    val_blocks = (
        None if val_docs is None else _blocks_or_error(val_docs, tokenizer, cfg, "validation", run_first)
    )
    _resolve_auto_micro_batch(cfg, model_config, train_blocks, val_blocks, decide_once)
    return PreparedRun(source, model_config, tokenizer, train_blocks, val_blocks, resume)


def _resolve_auto_micro_batch(
    cfg: TrainConfig,
    model_config: Any,
    train_blocks: np.ndarray,
    val_blocks: np.ndarray | None,
    decide_once: Callable[[Callable[[], Any]], Any],
) -> None:
    """--micro_batch_size auto becomes a number on the training ranks (rank 0 probes its GPU) before the
    DeepSpeed config is resolved; `dskit prepare`, which starts no process group and uses no GPU, leaves it."""
    if cfg.optim.micro_batch_size != AUTO:
        return
    import torch.distributed

    if not torch.distributed.is_initialized():
        print0("--micro_batch_size auto: probed on the GPU by the training ranks when they start")
        return
    from model_utils import autobatch

    n_val = None if val_blocks is None else len(val_blocks)
    world_size = torch.distributed.get_world_size()
    cfg.optim.micro_batch_size = decide_once(
        lambda: autobatch.resolve(cfg, model_config, len(train_blocks), n_val, world_size)
    )
