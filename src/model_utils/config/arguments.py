"""The typed training config: every flag, its default and its validation, in one place.

Flags are generated from the dataclass fields below, so a flag cannot exist without a field (and a test
checks that every field is read by the training code). Parsing is strict: an unknown or misspelled flag is an
error naming the closest valid one (a Hugging Face Trainer name: the kit's setting for it, HF_NAMES), and
abbreviations are refused.

The config is the user's, as given, and frozen: what is derived from it (the sequence length, the optimizer and
schedule settings, the micro batch, max_steps from --epochs, the default lr) is resolved once by
resolve/resolver.py. Parsing reads the run file and the flags only, and checks what needs nothing but them: the
launch environment (an accelerate config) joins the config in resolution (config/accelerate_env.py), and so do
the checks that depend on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import re
import sys
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from model_utils import launch_env
from model_utils.config import run_file, sources
from model_utils.config.presets import PRESETS, PRETRAINED_LR
from model_utils.errors import ConfigError

AUTO = "auto"
ALL = "all"  # --validation_batches all: a full pass over the validation blocks
CONFIG = "config"  # --config RUN.yaml: the run file (run_file.py), not a field: it sets the fields
LIGER_CHOICES = (AUTO, "on", "off")
# --backend: the training engines, the first the default (engines/__init__.py registers each by this name)
BACKENDS = ("deepspeed", "fsdp")
# The global batch on CUDA when no batch flag is given (with micro batch auto): 2^18 tokens, the top of the
# range the H100 anchors for a 0.6B model use (16 x 8 x 2048, where CPU offload reached 94% of GPU-only); README.
CUDA_GLOBAL_BATCH_TOKENS = 262_144
# --lr_schedule and --decay_type (optim/schedules.py runs them).
SCHEDULES = ("cosine", "wsd", "linear", "constant")
# --packing: how plain-text documents fill the blocks (token_shards.TokenBlocks).
PACKING_STREAM, PACKING_DOCUMENTS = "stream", "documents"
PACKINGS = (PACKING_STREAM, PACKING_DOCUMENTS)
DECAY_TYPES = ("linear", "cosine", "sqrt")
# --activation_checkpointing (model/activation_checkpointing.py applies it).
CHECKPOINTING_NONE, CHECKPOINTING_FULL = "none", "full"
CHECKPOINTING_FORMS = (
    "none, full, or every_N with N a whole number of layers (e.g. every_2: every second decoder layer)"
)
_EVERY = re.compile(r"every_([1-9][0-9]*)")
# --run_name names files (logs/<run name>_<time>.out, <run name>.metrics.jsonl, a TensorBoard run dir).
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# One of --observers: a module path and a name in it.
_OBSERVER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def _flag(help: str, **extra: Any) -> dict[str, Any]:
    return {"help": help, **extra}


def every_n_layers(value: str) -> int | None:
    """--activation_checkpointing 'none' -> None, 'full' -> 1, 'every_N' -> N; anything else is a ConfigError
    naming the accepted forms."""
    if value == CHECKPOINTING_NONE:
        return None
    if value == CHECKPOINTING_FULL:
        return 1
    match = _EVERY.fullmatch(value)
    if match is None:
        raise ConfigError(f"--activation_checkpointing {value!r} is not one of {CHECKPOINTING_FORMS}")
    return int(match.group(1))


def _check_choice(flag: str, value: str, choices: tuple[str, ...], noun: str) -> None:
    """A value outside `choices`: one line naming the closest choice, else all of them."""
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f"did you mean {close[0]}?" if close else f"use one of {', '.join(choices)}"
        raise ConfigError(f"--{flag} {value!r} is not {noun}: {hint}")


@dataclass(frozen=True)
class ModelArgs:
    model: str = field(
        default="tiny-qwen3",
        metadata=_flag(
            "a preset (" + ", ".join(PRESETS) + "), a Hugging Face hub id, or a local HF model dir"
        ),
    )
    model_revision: str | None = field(
        default=None,
        metadata=_flag(
            "branch, tag or commit of a hub --model (default: the hub's default branch); the preflight pins "
            "the commit for the run, so a requeue loads the same weights"
        ),
    )
    tokenizer: str | None = field(
        default=None, metadata=_flag("hub id or local dir of the tokenizer (default: the model's own)")
    )
    liger: str = field(
        default=AUTO,
        metadata=_flag(
            "Liger Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy): 'auto' = on with a CUDA "
            "GPU and a model type Liger supports, 'on', or 'off'"
        ),
    )
    compile: bool = field(
        default=False, metadata=_flag("torch.compile the model (compiles on the first step of each rank)")
    )
    activation_checkpointing: str = field(
        default="none",
        metadata=_flag(
            "recompute decoder layers' activations in backward instead of keeping them: 'none', 'full' (every "
            "layer) or 'every_N' (every N-th layer, e.g. every_2)"
        ),
    )

    tiled_mlp: bool = field(
        default=False,
        metadata=_flag(
            "compute each decoder layer's MLP over slices of the sequence (DeepSpeed's TiledMLP), recomputing it in "
            "backward: its intermediate activations exist for one slice at a time; for long sequences "
            "(docs/long-context.md)"
        ),
    )

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ConfigError("--model is empty: give a preset name, a hub id or a local directory")
        if self.liger not in LIGER_CHOICES:
            raise ConfigError(f"--liger {self.liger!r} is not one of {', '.join(LIGER_CHOICES)}")
        every_n_layers(self.activation_checkpointing)  # a ConfigError if malformed


DATA_FORMATS = ("auto", "text", "prompt_completion", "messages", "preference")
# --truncation_mode: which end of a preference sequence longer than --seq_length is kept (data/pairs.py).
TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass(frozen=True)
class DataArgs:
    dataset: str = field(
        default="embedded",
        metadata=_flag(
            "a dir made by `dskit prepare-data`, 'embedded' (the shipped corpus), a local save_to_disk dir, a "
            "local .txt/.json/.jsonl/.parquet/.csv file or dir of them, an s3:// prefix, or a Hugging Face hub "
            "dataset name"
        ),
    )
    dataset_config_name: str | None = field(
        default=None, metadata=_flag("configuration name of a hub dataset, e.g. 'en' for allenai/c4")
    )
    local_dataset: bool | None = field(
        default=None,
        metadata=_flag(
            "true: --dataset is a local path; false: a hub name; default: decided by whether the path exists"
        ),
    )
    text_field: str = field(default="text", metadata=_flag("column holding the document text"))
    data_format: str = field(
        default="auto",
        metadata=_flag(
            "text (documents), prompt_completion ('prompt' and 'completion' columns: loss on the completion), "
            "messages (conversations in a 'messages' column, or --text_field: loss on the assistant turns), "
            "preference ('chosen' and 'rejected' answers, with or without a 'prompt': pairs for DPO), or auto: "
            "decided by the columns present (docs/data.md)"
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_flag(
            "a Jinja chat template file for prompt_completion and messages data; default: the tokenizer's"
        ),
    )
    train_on_prompt: bool = field(
        default=False,
        metadata=_flag("train on every token of a conversation or prompt, not only on the answers"),
    )
    enable_thinking: bool | None = field(
        default=None,
        metadata=_flag(
            "passed to a chat template that reads it (Qwen3): false renders non-thinking mode, the empty "
            "<think></think> in the prompt; default: the template's own"
        ),
    )
    train_split: str = field(default="train", metadata=_flag("split to train on"))
    validation_split: str | None = field(
        default=None, metadata=_flag("split holding validation data; default: hold out --validation_fraction")
    )
    validation_dataset: str | None = field(
        default=None,
        metadata=_flag(
            "a separate dataset of validation documents (a path, s3:// prefix or hub name, read like --dataset); "
            "default: hold out --validation_fraction"
        ),
    )
    validation_fraction: float = field(
        default=0.02,
        metadata=_flag(
            "fraction of training documents held out for validation when there is no validation split"
        ),
    )
    seq_length: int | None = field(
        default=None,
        metadata=_flag("tokens per training block; default: the model's maximum positions, at most 2048"),
    )
    packing: str = field(
        default=PACKING_STREAM,
        metadata=_flag(
            "how plain-text documents fill the blocks: 'stream' (one token stream cut into blocks, attention across "
            "documents) or 'documents' (position ids restart after each EOS, attention never crosses a document, "
            "and a document's first token is not predicted from the one before)"
        ),
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata=_flag(
            "preference pairs longer than --seq_length: 'keep_start' keeps the start of each sequence (TRL's "
            "default; a pair whose prompt fills it is dropped), 'keep_end' keeps the end"
        ),
    )
    data_cache_dir: str = field(
        default=".cache/data",
        metadata=_flag(
            "where tokenized and packed data is cached between runs (and the model's parameter counts the "
            "preflight makes)"
        ),
    )
    unprepared_limit_mb: int = field(
        default=256,
        metadata=_flag(
            "largest dataset (MB of source) tokenized by the launch itself; a larger one must be prepared "
            "first with `dskit prepare-data`, in parallel, instead of on the batch host while the GPUs wait"
        ),
    )

    sources: str | None = field(
        default=None,
        metadata=_flag(
            "several datasets mixed by target token shares, instead of --dataset: NAME=DATASET@SHARE[xMAX_REPEAT],"
            "... (e.g. web=data/web@0.7,code=data/code.jsonl@0.3x2) or a JSON list (the run file: a data.sources "
            "list); default: --dataset alone (docs/data.md#weighted-mixtures)",
            read=lambda value: sources.run_file_value(value, PER_SOURCE_KEYS),
        ),
    )

    @property
    def source_specs(self) -> tuple[sources.SourceSpec, ...]:
        """The mixture's sources (config/sources.py), each option typed as its data key; () without --sources."""
        if self.sources is None:
            return ()
        specs = sources.parse(self.sources, PER_SOURCE_KEYS)
        hints = typing.get_type_hints(DataArgs)
        return tuple(
            dataclasses.replace(
                spec,
                options=tuple(
                    (key, run_file.typed(hints[key], value, f"--sources: source {spec.name!r}: {key}"))
                    for key, value in spec.options
                ),
            )
            for spec in specs
        )

    def for_source(self, spec: sources.SourceSpec) -> DataArgs:
        """The data settings of one source: this section's, with the source's dataset and its own keys."""
        return dataclasses.replace(self, dataset=spec.dataset, sources=None, **dict(spec.options))

    def __post_init__(self) -> None:
        if self.sources is not None:
            for spec in self.source_specs:
                try:
                    self.for_source(spec)  # each source's values checked as a single dataset's
                except ConfigError as e:
                    raise ConfigError(f"--sources: source {spec.name!r}: {e}") from None
        if self.unprepared_limit_mb < 0:
            raise ConfigError(
                f"--unprepared_limit_mb {self.unprepared_limit_mb} is negative: use a size in MB"
            )
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(
                f"--validation_fraction {self.validation_fraction} is outside [0, 1): use e.g. 0.02 for 2%"
            )
        if self.data_format not in DATA_FORMATS:
            raise ConfigError(
                f"--data_format {self.data_format!r} is not one of {', '.join(DATA_FORMATS)}: pick one (auto decides "
                "by the columns present)"
            )
        if self.seq_length is not None and self.seq_length < 2:
            raise ConfigError(f"--seq_length {self.seq_length} is too small: use at least 2 (e.g. 2048)")
        _check_choice("packing", self.packing, PACKINGS, "a packing")
        _check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES, "a truncation mode")


# The data keys that are the run's, not a source's: the others a mixture's source may set for itself.
_RUN_WIDE_DATA_KEYS = (
    "dataset",
    "sources",
    "seq_length",
    "data_cache_dir",
    "unprepared_limit_mb",
    "truncation_mode",
)
PER_SOURCE_KEYS = tuple(f.name for f in dataclasses.fields(DataArgs) if f.name not in _RUN_WIDE_DATA_KEYS)


@dataclass(frozen=True)
class OptimArgs:
    backend: str = field(
        default=BACKENDS[0],
        metadata=_flag(
            "the training engine: 'deepspeed' (ZeRO, from the DeepSpeed config) or 'fsdp' (PyTorch FSDP2, "
            "sharded checkpoints in Distributed Checkpoint format; docs/fsdp.md)"
        ),
    )
    fsdp_cpu_offload: bool = field(
        default=False,
        metadata=_flag(
            "--backend fsdp: keep the sharded parameters, gradients and optimizer state in CPU memory "
            "(FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU)",
            # Read by this engine alone (engine_only_flags); the hint for a run on another one.
            engine="fsdp",
            elsewhere="under DeepSpeed, offload is the DeepSpeed config's zero_optimization.offload_optimizer "
            "(e.g. deepspeed/ds_config.json)",
        ),
    )
    sequence_parallel: int = field(
        default=1,
        metadata=_flag(
            "ranks that share each sequence (Ulysses sequence parallelism, docs/long-context.md): groups of N "
            "consecutive ranks split every sequence N ways and attend over all of it; the groups are data "
            "parallel. For sequences whose activations do not fit one GPU"
        ),
    )
    deepspeed_config: str = field(
        default="deepspeed/ds_config.json",
        metadata=_flag(
            "DeepSpeed JSON config (relative: to the current dir, else the kit's root); 'auto' keys are filled from flags"
        ),
    )
    micro_batch_size: int | str = field(
        default=1,
        metadata=_flag(
            "sequences per rank per micro-batch, or 'auto': the largest power of two that fits the GPU, probed "
            "once and cached in --data_cache_dir (1 on CPU); default on CUDA without a batch flag: auto"
        ),
    )
    gradient_accumulation_steps: int = field(default=1, metadata=_flag("micro-batches per optimizer step"))
    global_batch_tokens: int | None = field(
        default=None,
        metadata=_flag(
            "tokens per optimizer step over all ranks: the accumulation becomes round(N / (micro batch x ranks "
            "x seq)), at least 1, with micro batch 'auto' unless --micro_batch_size is given; default on CUDA "
            f"without a batch flag: {CUDA_GLOBAL_BATCH_TOKENS}, else none (--gradient_accumulation_steps)"
        ),
    )
    lr: float | None = field(
        default=None,
        metadata=_flag(
            f"peak learning rate; default: the preset's (tiny-qwen3 3e-3), else {PRETRAINED_LR:g}"
        ),
    )
    lr_schedule: str = field(
        default="cosine",
        metadata=_flag(
            "cosine (DeepSpeed's WarmupCosineLR), wsd (warmup-stable-decay), linear (decay to --min_lr_ratio) or "
            "constant (DeepSpeed's WarmupLR); each warms up first"
        ),
    )
    warmup_steps: int = field(default=10, metadata=_flag("linear warm-up optimizer steps"))
    warmup_ratio: float | None = field(
        default=None,
        metadata=_flag(
            "warm up over this share of the run instead of --warmup_steps, e.g. 0.01; rounded up as Hugging "
            "Face does (any ratio above 0 is at least 1 step)"
        ),
    )
    min_lr_ratio: float = field(
        default=0.1, metadata=_flag("the lr the decay ends at, as a share of the peak (cosine, wsd, linear)")
    )
    decay_fraction: float = field(
        default=0.2, metadata=_flag("wsd: the share of the run spent decaying, at its end")
    )
    decay_type: str = field(
        default="linear", metadata=_flag("wsd: the decay's shape: linear, cosine or sqrt")
    )
    decay_from_step: int | None = field(
        default=None,
        metadata=_flag("wsd: start the decay at this step (cool down from here) instead of --decay_fraction"),
    )
    no_decay_embeddings: bool = field(
        default=False,
        metadata=_flag("exempt the embeddings from weight decay too (norm gains and biases never get it)"),
    )

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, BACKENDS, "a training engine")
        for name in ("micro_batch_size", "gradient_accumulation_steps", "sequence_parallel"):
            value = getattr(self, name)
            if not (name == "micro_batch_size" and value == AUTO) and value < 1:
                raise ConfigError(f"--{name} {value} must be at least 1")
        if self.global_batch_tokens is not None and self.global_batch_tokens < 1:
            raise ConfigError(
                f"--global_batch_tokens {self.global_batch_tokens} must be at least 1, e.g. 262144"
            )
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr {self.lr} must be positive, e.g. 5e-5")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup_steps {self.warmup_steps} must be zero or positive")
        _check_choice("lr_schedule", self.lr_schedule, SCHEDULES, "a schedule")
        if self.decay_type not in DECAY_TYPES:
            raise ConfigError(f"--decay_type {self.decay_type!r} is not one of {', '.join(DECAY_TYPES)}")
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"--warmup_ratio {self.warmup_ratio} is outside [0, 1): use e.g. 0.01 for 1%")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min_lr_ratio {self.min_lr_ratio} is outside [0, 1]: use e.g. 0.1")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(
                f"--decay_fraction {self.decay_fraction} is outside (0, 1]: use e.g. 0.2 for 20%"
            )
        if self.decay_from_step is not None and self.decay_from_step < 0:
            raise ConfigError(f"--decay_from_step {self.decay_from_step} must be zero or positive")


@dataclass(frozen=True)
class LoopArgs:
    max_steps: int = field(default=100, metadata=_flag("optimizer steps to train for (not micro-batches)"))
    epochs: int | None = field(
        default=None, metadata=_flag("train for this many passes over the data instead of --max_steps")
    )
    logging_freq: int = field(default=10, metadata=_flag("optimizer steps between log lines"))
    validation_freq: int = field(
        default=50, metadata=_flag("optimizer steps between validations (and at the end)")
    )
    validation_batches: int | Literal["all"] = field(
        default=8,
        metadata=_flag(
            "micro-batches per rank in each validation, or 'all': every validation block once, shared out over "
            "the ranks"
        ),
    )
    validation_only: bool = field(
        default=False,
        metadata=_flag(
            "true: validate the model this run starts from (the checkpoint a resume would load, else --model) "
            "once and end: no step trained, nothing saved (docs/evaluation.md)"
        ),
    )
    validation_at_start: bool = field(
        default=False,
        metadata=_flag(
            "true: validate before the first step too, recorded at step 0 (not again on a resume)"
        ),
    )
    seed: int = field(default=42, metadata=_flag("seed for initialisation, data order and dropout"))
    hang_timeout: float = field(
        default=300.0,
        metadata=_flag(
            "seconds without progress before the watchdog names the stuck rank, prints the stacks and ends the "
            "job with exit status 75 (scaled up to 10 step times; 4x for checkpoints, validation and samples); "
            "0 = off (docs/hangs.md)"
        ),
    )
    straggler_every: int = field(
        default=20,
        metadata=_flag(
            "turns between the ranks' step time comparisons (carried in the per-step collective); 0 = off"
        ),
    )
    straggler_threshold: float = field(
        default=0.1,
        metadata=_flag(
            "a rank busier than the median by more than this fraction in 3 comparisons in a row is named a "
            "straggler"
        ),
    )

    observers: str | None = field(
        default=None,
        metadata=_flag(
            "more observers of the loop: comma-separated MODULE:NAME, each a class or function importable on every "
            "rank (PYTHONPATH) that is called with the loop's context and returns an observer "
            "(docs/architecture.md#the-loop-and-the-reporter); default: none"
        ),
    )

    health_gate: str = field(
        default="on",
        metadata=_flag(
            "'on': before the first step every node checks its GPUs (nvidia-smi, DCGM, Xid errors), its EFA devices "
            "and an all-reduce's bandwidth, and a failing node ends the job with exit status 75 (train.sbatch "
            "requeues it without that node); 'off': no gate (docs/hangs.md)"
        ),
    )
    health_min_busbw: float | None = field(
        default=None,
        metadata=_flag(
            "the health gate's all-reduce bus bandwidth floor in GB/s, instead of the instance type's in the "
            "kit's table (`dskit doctor` shows it); 0 = measure and report only"
        ),
    )

    @property
    def observer_names(self) -> tuple[tuple[str, str], ...]:
        """--observers as (module, name) pairs; () without it."""
        return tuple(tuple(name.split(":")) for name in names_list(self.observers))  # type: ignore[misc]

    def __post_init__(self) -> None:
        _check_choice("health_gate", self.health_gate, ("on", "off"), "a health gate setting")
        if self.observers is not None and not names_list(self.observers):
            raise ConfigError("--observers is empty: name MODULE:NAME observers, or drop the flag")
        for name in names_list(self.observers):
            if not _OBSERVER.fullmatch(name):
                raise ConfigError(
                    f"--observers: {name!r} is not MODULE:NAME: give a module path and the name of a class or "
                    "function in it, e.g. my_observers:Heartbeat"
                )
        if self.health_min_busbw is not None and self.health_min_busbw < 0:
            raise ConfigError(
                f"--health_min_busbw {self.health_min_busbw} must be 0 (report only) or more GB/s, e.g. 100"
            )
        for name in ("max_steps", "logging_freq", "validation_freq", "validation_batches"):
            if getattr(self, name) != ALL and getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be at least 1")
        if self.hang_timeout < 0 or 0 < self.hang_timeout < 1:
            raise ConfigError(
                f"--hang_timeout {self.hang_timeout} must be 0 (off) or at least 1 second, e.g. 300"
            )
        if self.straggler_every < 0:
            raise ConfigError(f"--straggler_every {self.straggler_every} must be 0 (off) or more, e.g. 20")
        if not self.straggler_threshold > 0:
            raise ConfigError(
                f"--straggler_threshold {self.straggler_threshold} must be positive, e.g. 0.1 for 10%"
            )
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"--epochs {self.epochs} must be at least 1")


# A hub repo id as --push_to_hub (and `dskit export --push_to_hub`) take it.
HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def check_hub_repo(repo: str | None) -> None:
    """--push_to_hub's value (the run's and `dskit export`'s): a hub repo id, else one line saying so."""
    if repo is not None and not HUB_REPO.fullmatch(repo):
        raise ConfigError(f"--push_to_hub {repo!r} is not a hub repo: give user/name (or org/name)")


@dataclass(frozen=True)
class CheckpointArgs:
    checkpoint_dir: str = field(
        default="checkpoints",
        metadata=_flag("where checkpoints are saved and auto-resumed from (the newest verified one)"),
    )
    checkpoint_freq: int = field(
        default=50, metadata=_flag("optimizer steps between checkpoints (and at the end)")
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata=_flag(
            "resume from this checkpoint dir (its newest verified tag) or tag dir instead of --checkpoint_dir"
        ),
    )
    new_data: bool = field(
        default=False,
        metadata=_flag(
            "true: resume on data other than the checkpoint's (its content, not its path, compared): the data "
            "position starts over at epoch 0, block 0, while weights, optimizer and lr schedule continue; "
            "without it such a resume is refused"
        ),
    )

    keep_checkpoints: int = field(
        default=3,
        metadata=_flag(
            "verified checkpoints to keep; older ones are deleted (never the newest or the resumed one)"
        ),
    )
    keep_every_steps: int | None = field(
        default=None,
        metadata=_flag(
            "also keep, permanently, every verified checkpoint whose step is a multiple of this (beside the "
            "rolling --keep_checkpoints)"
        ),
    )
    checkpoint_interval_minutes: float | None = field(
        default=None, metadata=_flag("also checkpoint when this many minutes have passed since the last save")
    )
    s3_checkpoint_uri: str | None = field(
        default=None,
        metadata=_flag(
            "s3://bucket/prefix: upload each verified checkpoint there; resume from it when none is local"
        ),
    )
    push_to_hub: str | None = field(
        default=None,
        metadata=_flag(
            "user/name: when the run finishes, export its final checkpoint and push it to this hub repo with a "
            "model card, beside the run's end (HF_TOKEN); a failed push is one warning line, never the run's failure"
        ),
    )
    hub_visibility: str = field(
        default="public", metadata=_flag("--push_to_hub: public or private, for a repo the push creates")
    )
    hub_revision: str | None = field(
        default=None, metadata=_flag("--push_to_hub: the branch to push to, made if missing (default: main)")
    )

    def __post_init__(self) -> None:
        check_hub_repo(self.push_to_hub)
        _check_choice("hub_visibility", self.hub_visibility, ("public", "private"), "a repo visibility")
        if (self.hub_visibility != "public" or self.hub_revision is not None) and self.push_to_hub is None:
            raise ConfigError(
                "the hub flags (--hub_revision, --hub_visibility) need --push_to_hub REPO: add it or drop them"
            )
        for name in ("checkpoint_freq", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be at least 1")
        if self.keep_every_steps is not None and self.keep_every_steps < 1:
            raise ConfigError(f"--keep_every_steps {self.keep_every_steps} must be at least 1, e.g. 1000")
        if self.checkpoint_interval_minutes is not None and not self.checkpoint_interval_minutes > 0:
            raise ConfigError(
                f"--checkpoint_interval_minutes {self.checkpoint_interval_minutes} must be positive, e.g. 30"
            )
        if self.s3_checkpoint_uri is not None:
            bucket = self.s3_checkpoint_uri.removeprefix("s3://").split("/", 1)[0]
            if not self.s3_checkpoint_uri.startswith("s3://") or not bucket:
                raise ConfigError(
                    f"--s3_checkpoint_uri {self.s3_checkpoint_uri!r} is not an S3 URI: use s3://bucket/prefix"
                )


SPIKE_GUARD_MODES = ("off", "skip", "rollback")


@dataclass(frozen=True)
class GuardArgs:
    spike_guard: str = field(
        default="skip",
        metadata=_flag(
            "watch the loss and the gradient norm for spikes: 'skip' = a step whose loss spikes makes no "
            "update (its data is consumed); 'rollback' = also roll back to the last verified checkpoint on a "
            "grad-norm spike or too many skips in a row, skipping the data that caused it; 'off'"
        ),
    )
    spike_window: int = field(
        default=100,
        metadata=_flag(
            "steps of loss and grad-norm history the guard judges against; it acts once it is full and the "
            "warm-up is over"
        ),
    )
    spike_sigma: float = field(
        default=6.0,
        metadata=_flag(
            "a loss or grad norm above the window's mean + this many standard deviations (and above its ratio "
            "to the window's median) is a spike"
        ),
    )
    spike_warmup_steps: int = field(
        default=200,
        metadata=_flag(
            "no verdicts on the first this many optimizer steps (the steep early descent), besides a loss or "
            "grad norm that is not finite; the window fills meanwhile"
        ),
    )
    spike_loss_ratio: float = field(
        default=1.25,
        metadata=_flag("a loss spike is also above this many times the window's median loss"),
    )
    spike_grad_norm_ratio: float = field(
        default=20.0,
        metadata=_flag("a grad-norm spike is also above this many times the window's median grad norm"),
    )
    max_consecutive_skips: int = field(
        default=3,
        metadata=_flag(
            "this many skipped steps in a row: 'rollback' rolls back, 'skip' stops the run (the model, not one "
            "batch, is the problem)"
        ),
    )
    max_rollbacks: int = field(
        default=3, metadata=_flag("'rollback': the run stops with an error after this many rollbacks")
    )
    rollback_skip_steps: int = field(
        default=10,
        metadata=_flag(
            "after a rollback, the data of this many steps before the spike is skipped too (besides the spike's "
            "own), never reaching back past the checkpoint"
        ),
    )

    def __post_init__(self) -> None:
        _check_choice("spike_guard", self.spike_guard, SPIKE_GUARD_MODES, "a mode")
        if self.spike_window < 2:
            raise ConfigError(f"--spike_window {self.spike_window} must be at least 2 steps, e.g. 100")
        if not self.spike_sigma > 0:
            raise ConfigError(f"--spike_sigma {self.spike_sigma} must be positive, e.g. 6")
        if self.spike_warmup_steps < 0:
            raise ConfigError(
                f"--spike_warmup_steps {self.spike_warmup_steps} must be zero or positive, e.g. 200"
            )
        for name, example in (("spike_loss_ratio", "1.25"), ("spike_grad_norm_ratio", "20")):
            if not getattr(self, name) >= 1:  # below 1 the floor is no floor; NaN is refused too
                raise ConfigError(f"--{name} {getattr(self, name)} must be at least 1, e.g. {example}")
        for name in ("max_consecutive_skips", "max_rollbacks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be at least 1, e.g. 3")
        if self.rollback_skip_steps < 0:
            raise ConfigError(f"--rollback_skip_steps {self.rollback_skip_steps} must be zero or positive")

    @staticmethod
    def unused_in(mode: str) -> set[str]:
        """The guard flags a mode does not read: given, they are an error; a run file leaves them null."""
        every = {f.name for f in dataclasses.fields(GuardArgs)} - {"spike_guard"}
        return {"off": every, "skip": {"max_rollbacks", "rollback_skip_steps"}}.get(mode, set())


LORA_TARGETS_DEFAULT = "q_proj,k_proj,v_proj,o_proj"


def names_list(text: str | None) -> tuple[str, ...]:
    """A comma-separated flag value as names: 'q_proj, v_proj' -> ('q_proj', 'v_proj'); None -> ()."""
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


@dataclass(frozen=True)
class LoraArgs:
    lora_r: int | None = field(
        default=None,
        metadata=_flag(
            "LoRA rank: train low-rank adapters (peft) on a frozen pretrained model instead of every weight; "
            "default: off (full fine-tuning)"
        ),
    )
    lora_alpha: float = field(
        default=32.0, metadata=_flag("LoRA scaling numerator: the adapter's update is scaled by alpha / r")
    )
    lora_dropout: float = field(default=0.0, metadata=_flag("dropout on the LoRA adapters' input, in [0, 1)"))
    lora_target_modules: str = field(
        default=LORA_TARGETS_DEFAULT,
        metadata=_flag("comma-separated names of the linear layers that get adapters (e.g. q_proj,v_proj)"),
    )
    lora_modules_to_save: str | None = field(
        default=None,
        metadata=_flag(
            "comma-separated names of modules trained in full beside the adapters (e.g. lm_head); default: none"
        ),
    )

    @property
    def enabled(self) -> bool:
        return self.lora_r is not None

    def __post_init__(self) -> None:
        if self.lora_r is not None and self.lora_r < 1:
            raise ConfigError(f"--lora_r {self.lora_r} must be at least 1, e.g. 16")
        if not self.lora_alpha > 0:
            raise ConfigError(f"--lora_alpha {self.lora_alpha} must be positive, e.g. 32 (twice --lora_r)")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora_dropout {self.lora_dropout} is outside [0, 1): use e.g. 0.05")
        if not names_list(self.lora_target_modules):
            raise ConfigError(
                f"--lora_target_modules is empty: name linear layers, e.g. {LORA_TARGETS_DEFAULT}"
            )
        if self.lora_modules_to_save is not None and not names_list(self.lora_modules_to_save):
            raise ConfigError("--lora_modules_to_save is empty: name modules (e.g. lm_head) or drop the flag")


# --objective: what the loss is (engines/preference.py computes the preference ones).
LM, DPO, SIMPO = "lm", "dpo", "simpo"
OBJECTIVES = (LM, DPO, SIMPO)
# --loss_type of --objective dpo, as TRL's DPOTrainer names them; robust reads --label_smoothing.
DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge")
PREFERENCE_ONLY = ("beta", "loss_type", "label_smoothing", "simpo_gamma")


@dataclass(frozen=True)
class ObjectiveArgs:
    objective: str = field(
        default=LM,
        metadata=_flag(
            "what is trained: 'lm' (the next-token loss over the trained tokens: pretraining and SFT), 'dpo' "
            "(preference pairs against a reference model: the weights the run starts from) or 'simpo' (preference "
            "pairs, reference-free, length-normalized); preference data: docs/preference.md"
        ),
    )
    beta: float = field(
        default=0.1,
        metadata=_flag(
            "preference objectives: the reward scale (DPO's KL strength, SimPO's beta), TRL's default"
        ),
    )
    loss_type: str = field(
        default="sigmoid",
        metadata=_flag(
            "--objective dpo: 'sigmoid', 'robust' (with --label_smoothing), 'ipo' or 'hinge', as TRL's"
        ),
    )
    label_smoothing: float = field(
        default=0.0,
        metadata=_flag(
            "the share of pairs assumed flipped, in [0, 0.5): --loss_type robust and --objective simpo"
        ),
    )
    simpo_gamma: float = field(
        default=0.5, metadata=_flag("--objective simpo: the target reward margin, TRL's default")
    )

    @property
    def preference(self) -> bool:
        return self.objective != LM

    def __post_init__(self) -> None:
        _check_choice("objective", self.objective, OBJECTIVES, "an objective")
        _check_choice("loss_type", self.loss_type, DPO_LOSS_TYPES, "a DPO loss type")
        if not self.beta > 0:
            raise ConfigError(f"--beta {self.beta} must be positive, e.g. 0.1")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing {self.label_smoothing} is outside [0, 0.5): use e.g. 0.1")

    def unused(self) -> set[str]:
        """The flags this objective does not read: given, they are an error (not silently ignored); a run file
        leaves them null."""
        if self.objective == LM:
            return set(PREFERENCE_ONLY)
        if self.objective == SIMPO:
            return {"loss_type"}
        return {"simpo_gamma"} | ({"label_smoothing"} if self.loss_type != "robust" else set())


REPORT_TO = ("none", "tensorboard", "mlflow", "wandb")
# Read only with --sample_prompts: given without it, an error; a run file leaves them null.
SAMPLE_ONLY = ("sample_every", "sample_max_new_tokens")


@dataclass(frozen=True)
class ReportArgs:
    run_name: str | None = field(
        default=None,
        metadata=_flag(
            "the run's id: its metrics records, TensorBoard run and MLflow run name, and its logs "
            "(logs/<run name>_<time>.out); kept by resumes; default: <model>-<backend>[-lora] for the logs and "
            "that plus the start time for the id"
        ),
    )
    report_dir: str = field(
        default="logs",
        metadata=_flag("where TensorBoard runs, the MLflow store and default metrics files go"),
    )
    metrics_file: str = field(
        default="auto",
        metadata=_flag(
            "JSON lines of metrics per logged step (rank 0): 'auto' = next to the launcher's log "
            "(logs/<log name>.metrics.jsonl), else <report_dir>/<run id>.metrics.jsonl; 'none' = off; or a path"
        ),
    )
    report_to: str = field(
        default="none",
        metadata=_flag(
            "also send metrics to one or more of " + ", ".join(REPORT_TO[1:]) + ", comma-separated (e.g. "
            "tensorboard,wandb; rank 0), or none"
        ),
    )
    wandb_project: str | None = field(
        default=None,
        metadata=_flag("W&B project (--report_to wandb); default: $WANDB_PROJECT, else dskit"),
    )
    tracking_uri: str | None = field(
        default=None,
        metadata=_flag("MLflow tracking URI; default: a local store, sqlite:///<report_dir>/mlflow.db"),
    )
    peak_tflops: float | None = field(
        default=None,
        metadata=_flag("the device's dense bf16 peak TFLOP/s for MFU; default: from a table of known GPUs"),
    )
    mlflow_parent_run_id: str | None = field(
        default=None,
        metadata=_flag(
            "MLflow: log to one child run of this run (in its experiment), continued across resumes and "
            "requeues; default: a top-level run in experiment dskit"
        ),
    )
    profile_steps: str | None = field(
        default=None,
        metadata=_flag(
            "A:B: a torch profiler trace (Chrome trace, rank 0) of optimizer steps A to B, next to the metrics "
            "file; an MLflow artifact with --report_to mlflow"
        ),
    )

    sample_prompts: str | None = field(
        default=None,
        metadata=_flag(
            "generate from these prompts every --sample_every steps (greedy, every rank taking part) and log the "
            'texts: a file (.jsonl/.json: rows of text, {"prompt": text} or {"messages": [...]}, a '
            "conversation rendered with the chat template; else one prompt per non-blank line) or a JSON list "
            "(the run file: a report.sample_prompts list); default: no samples "
            "(docs/metrics-and-trackers.md#samples)",
            read=lambda value: value if isinstance(value, str) else json.dumps(value),
        ),
    )
    sample_every: int = field(
        default=500, metadata=_flag("optimizer steps between samples of --sample_prompts (and at the end)")
    )
    sample_max_new_tokens: int = field(
        default=32,
        metadata=_flag(
            "tokens generated per prompt: always this many, so that every rank runs as many forwards (the log "
            "shows them up to the first end-of-text)"
        ),
    )

    @property
    def trackers(self) -> tuple[str, ...]:
        """--report_to as the trackers it names, in its order; () for none."""
        names = tuple(name.strip() for name in self.report_to.split(","))
        for name in names:
            if name not in REPORT_TO:
                raise ConfigError(
                    f"--report_to {self.report_to!r}: {name!r} is not a tracker: use one or more of "
                    f"{', '.join(REPORT_TO[1:])}, comma-separated, or none"
                )
        if len(set(names)) != len(names) or ("none" in names and len(names) > 1):
            raise ConfigError(
                f"--report_to {self.report_to!r}: name each tracker once, and none alone (e.g. tensorboard,wandb)"
            )
        return () if names == ("none",) else names

    def profile_window(self) -> tuple[int, int] | None:
        """--profile_steps as (first, last) optimizer step, both included; None when not profiling."""
        if self.profile_steps is None:
            return None
        first, sep, last = self.profile_steps.partition(":")
        if not (sep and first.strip().isdigit() and last.strip().isdigit()):
            raise ConfigError(
                f"--profile_steps {self.profile_steps!r} is not A:B: give the first and last optimizer step, e.g. 10:12"
            )
        window = int(first), int(last)
        if not 1 <= window[0] <= window[1]:
            raise ConfigError(
                f"--profile_steps {self.profile_steps} must be A:B with 1 <= A <= B (steps count from 1), e.g. 10:12"
            )
        return window

    def __post_init__(self) -> None:
        if self.run_name is not None and not RUN_NAME.fullmatch(self.run_name):
            raise ConfigError(
                f"--run_name {self.run_name!r} names files: use 1 to 100 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit, e.g. --run_name lr3e-4_warmup100"
            )
        _ = self.trackers  # a ConfigError if malformed
        if self.wandb_project is not None and "wandb" not in self.trackers:
            raise ConfigError("--wandb_project is for W&B: add wandb to --report_to or drop --wandb_project")
        if self.wandb_project is not None and not self.wandb_project.strip():
            raise ConfigError("--wandb_project is empty: name a W&B project or drop the flag")
        if self.tracking_uri is not None and "mlflow" not in self.trackers:
            raise ConfigError("--tracking_uri is for MLflow: add --report_to mlflow or drop --tracking_uri")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"--peak_tflops {self.peak_tflops} must be positive, e.g. 989 for an H100 SXM")
        if not self.metrics_file.strip():
            raise ConfigError("--metrics_file is empty: give a path, 'auto' or 'none'")
        self.profile_window()  # a ConfigError if malformed
        if self.mlflow_parent_run_id is not None and "mlflow" not in self.trackers:
            raise ConfigError(
                "--mlflow_parent_run_id is for MLflow: add --report_to mlflow or drop --mlflow_parent_run_id"
            )
        for name in SAMPLE_ONLY:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be at least 1: fix: e.g. 500 and 32")
        if self.sample_prompts is not None and not self.sample_prompts.strip():
            raise ConfigError(
                "--sample_prompts is empty: fix: name a prompts file (or give the run file a list), or drop it"
            )
        if self.mlflow_parent_run_id is not None and not self.mlflow_parent_run_id.strip():
            raise ConfigError("--mlflow_parent_run_id is empty: give the parent run's id (32 hex characters)")


SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "data": DataArgs,
    "optim": OptimArgs,
    "loop": LoopArgs,
    "checkpoint": CheckpointArgs,
    "report": ReportArgs,
    "lora": LoraArgs,
    "guard": GuardArgs,
    "objective": ObjectiveArgs,
}


# Pairs of which one decides: a flag given for one drops the other from the run file, rather than clash with it.
ONE_OF = (
    ("epochs", "max_steps"),
    ("warmup_steps", "warmup_ratio"),
    ("validation_split", "validation_fraction"),
    ("validation_dataset", "validation_fraction"),
    ("validation_dataset", "validation_split"),
    ("global_batch_tokens", "gradient_accumulation_steps"),  # the tokens decide the accumulation
    ("sources", "dataset"),  # a mixture names each source's dataset
)


def reject_both_given(
    given: frozenset[str] | set[str], setting: Callable[[str], str] = "--{}".format
) -> None:
    """Both members of a pair of ONE_OF given (flags or run file): one line naming them (`setting`: a name as
    a message says it, with where its value came from: TrainConfig.setting)."""
    for first, second in ONE_OF:
        if {first, second} <= given:
            raise ConfigError(f"{setting(first)} and {setting(second)} both given: keep one of them")


FLAG = "flag"  # the origin of a value given on the command line
DEFAULT = "default"  # ... of a value nobody gave


@dataclass(frozen=True)
class TrainConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    loop: LoopArgs = field(default_factory=LoopArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    report: ReportArgs = field(default_factory=ReportArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    guard: GuardArgs = field(default_factory=GuardArgs)
    objective: ObjectiveArgs = field(default_factory=ObjectiveArgs)
    # Flags the user gave explicitly (on the command line or in the run file): they must agree with explicit
    # DeepSpeed keys.
    explicit: frozenset[str] = frozenset()
    # The run file's embedded `deepspeed:` mapping, as JSON text (frozen), used instead of --deepspeed_config.
    deepspeed_inline: str | None = None
    # What the accelerate config asks, when `accelerate launch` started this process: joined in resolution
    # (accelerate_env.join), never by parse_args. Its flags are then among the values above; the rest is checked
    # against the resolved run.
    accelerate: Any = None
    # Where each explicit value not typed as a flag came from, recorded when parsed: (flag name, where, key),
    # e.g. ("lr", "run file configs/x.yaml", "optim.lr"), ("backend", "the accelerate config's distributed_type
    # FSDP", "--backend"). `origin_of` and `setting` read it.
    origins: tuple[tuple[str, str, str], ...] = ()
    run_file: str | None = None  # --config RUN.yaml, as given

    def __post_init__(self) -> None:
        # --fsdp_cpu_offload against --backend is checked in resolution (resolve/train_settings.py): an accelerate
        # config may set the backend.
        reject_both_given(self.explicit, self.setting)
        wsd_only = sorted(
            self.setting(f) for f in ("decay_fraction", "decay_type", "decay_from_step") if f in self.explicit
        )
        if wsd_only and self.optim.lr_schedule != "wsd":
            raise ConfigError(
                f"{' and '.join(wsd_only)} apply to --lr_schedule wsd only, not {self.setting('lr_schedule')} "
                f"{self.optim.lr_schedule}: set it to wsd or drop them"
            )
        if self.optim.sequence_parallel > 1 and self.report.sample_prompts is not None:
            raise ConfigError(
                f"{self.setting('sample_prompts')} and {self.setting('sequence_parallel')} "
                f"{self.optim.sequence_parallel}: samples are not generated under sequence parallelism: drop "
                "one of them (sample the exported model instead)"
            )
        sampling = sorted(self.setting(f) for f in SAMPLE_ONLY if f in self.explicit)
        if sampling and self.report.sample_prompts is None:
            raise ConfigError(
                f"{' and '.join(sampling)} apply to samples, and no --sample_prompts is given: fix: give "
                "--sample_prompts FILE or drop them"
            )
        unread = sorted(self.setting(f) for f in self.objective.unused() & self.explicit)
        if unread:
            raise ConfigError(
                f"{' and '.join(unread)} {'do' if len(unread) > 1 else 'does'} not apply to "
                f"{self.setting('objective')} {self.objective.objective}"
                + (
                    " (TRL's sigmoid DPO loss has no label smoothing: --loss_type robust has)"
                    if "label_smoothing" in " ".join(unread) and self.objective.objective == DPO
                    else ""
                )
                + ": drop "
                + ("them" if len(unread) > 1 else "it")
            )
        given = sorted(self.setting(f) for f in GuardArgs.unused_in(self.guard.spike_guard) & self.explicit)
        if given:
            raise ConfigError(
                f"{' and '.join(given)} do not apply to {self.setting('spike_guard')} {self.guard.spike_guard}: "
                "drop them" + ("" if self.guard.spike_guard == "off" else " or use --spike_guard rollback")
            )

    def origin_of(self, name: str) -> str:
        """Where the value of flag `name` came from: FLAG (the command line), "run file PATH", "the accelerate
        config's KEY", or DEFAULT."""
        recorded = next((where for flag, where, _ in self.origins if flag == name), None)
        if recorded is not None:
            return recorded
        return FLAG if name in self.explicit else DEFAULT

    def setting(self, name: str) -> str:
        """A setting as a message names it, with where its value came from when that is not a flag: `--lr`,
        `optim.lr (run file configs/x.yaml)`, `--backend (the accelerate config's distributed_type FSDP)`; a
        message never blames a flag nobody typed."""
        for flag, where, key in self.origins:
            if flag == name:
                return f"{key} ({where})"
        return f"--{name}"

    @contextlib.contextmanager
    def origins_named(self) -> Iterator[None]:
        """Inside, a ConfigError whose subject is a flag (`--seq_length 1024 is above ...`, raised where the
        config is not at hand) names that setting where its value came from, as `setting` does."""
        try:
            yield
        except ConfigError as e:
            e.args = (_subject_with_origin(str(e), self.origins), *e.args[1:])
            raise

    def key(self, name: str) -> str:
        """The setting alone, as a fix names it: `--lr`, or `optim.lr` for a value from the run file."""
        return next((key for flag, _, key in self.origins if flag == name), f"--{name}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["explicit"] = sorted(self.explicit)
        for how_typed in ("origins", "run_file"):  # not what trains: the same run from a file or from flags
            del d[how_typed]
        return d


def flag_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every flag name -> (section name, dataclass field)."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in out, f"flag --{f.name} defined twice"
            out[f.name] = (section, f)
    return out


def engine_only_flags(backend: str) -> dict[str, dataclasses.Field]:
    """The flags that another engine than `backend` reads alone (their field's metadata names it, `engine`):
    given, they are an error; a run file leaves them null."""
    return {name: f for name, (_, f) in flag_fields().items() if f.metadata.get("engine", backend) != backend}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _converter(hint: Any) -> Any:
    args, words = run_file.value_kinds(hint)
    if words:
        return lambda text: _parse_int_or_word(text, words)
    base = args[0]
    return _parse_bool if base is bool else base


def _parse_int_or_word(text: str, words: tuple[str, ...]) -> int | str:
    """A count, or one of the field's words ('auto' of --micro_batch_size, 'all' of --validation_batches)."""
    if text.strip().lower() in words:
        return text.strip().lower()
    try:
        return int(text)
    except ValueError:
        expected = " or ".join(repr(w) for w in words)
        raise argparse.ArgumentTypeError(f"expected an integer or {expected}, got {text!r}") from None


class _StrictParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def _with_default(help_text: str, default: Any) -> str:
    """The help, and the default where the help does not already say it: an unset (None) default is what the
    help's own "default: ..." describes, or nothing to show."""
    if default is None or "default:" in help_text:
        return help_text
    return f"{help_text} (default: {default})"


def build_parser(prog: str = "train_deepspeed.py") -> argparse.ArgumentParser:
    parser = _StrictParser(
        prog=prog,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
        description="Train a causal LM with DeepSpeed ZeRO. Every default lives in model_utils/config/arguments.py.",
    )
    parser.add_argument(
        f"--{CONFIG}",
        metavar="RUN.yaml",
        help="a run file: the flags as YAML sections, and an embedded `deepspeed:` config; flags override it",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default
            group.add_argument(
                f"--{f.name}",
                type=_converter(hints[f.name]),
                metavar=f.name.upper(),
                help=_with_default(f.metadata["help"], default),
            )
    return parser


def field_help(cls: type, name: str) -> dict[str, Any]:
    """argparse keywords for a config field reused by a `dskit` command: its type and help, unset by default."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    hint = typing.get_type_hints(cls)[name]
    return {"type": _converter(hint), "help": _with_default(f.metadata["help"], f.default)}


_IN_DS = "in the DeepSpeed config (--deepspeed_config, or the run file's deepspeed section)"
# What a Hugging Face Trainer or TRL user types from habit (TrainingArguments, SFTConfig, TRL's ModelConfig
# and script arguments) -> the fix an unknown flag's error names: the kit's flag, or where the kit sets it.
# The names the kit shares (--max_steps, --warmup_steps, --seed, --report_to, --lora_r...) are its flags.
HF_NAMES: dict[str, str] = {
    "learning_rate": "use --lr",
    "output_dir": "use --checkpoint_dir (checkpoints) and --report_dir (logs and trackers)",
    "logging_dir": "use --report_dir",
    "per_device_train_batch_size": "use --micro_batch_size",
    "per_device_eval_batch_size": "use --micro_batch_size (validation's batches are the training ones)",
    "num_train_epochs": "use --epochs (whole passes)",
    "save_steps": "use --checkpoint_freq",
    "save_strategy": "use --checkpoint_freq (steps) or --checkpoint_interval_minutes",
    "save_total_limit": "use --keep_checkpoints",
    "eval_steps": "use --validation_freq",
    "eval_strategy": "use --validation_freq (steps)",
    "evaluation_strategy": "use --validation_freq (steps)",
    "logging_steps": "use --logging_freq",
    "lr_scheduler_type": "use --lr_schedule (cosine, wsd, linear or constant)",
    "gradient_checkpointing": "use --activation_checkpointing full",
    "max_seq_length": "use --seq_length",
    "max_length": "use --seq_length",
    "model_name_or_path": "use --model",
    "dataset_name": "use --dataset",
    "dataset_config": "use --dataset_config_name",
    "dataset_text_field": "use --text_field",
    "dataset_train_split": "use --train_split",
    "dataset_test_split": "use --validation_split",
    "chat_template_path": "use --chat_template",
    "completion_only_loss": "the loss is on completions unless --train_on_prompt true",
    "assistant_only_loss": "the loss is on the assistant turns unless --train_on_prompt true",
    "use_peft": "use --lora_r R",
    "torch_compile": "use --compile true",
    "use_liger_kernel": "use --liger on",
    "deepspeed": "use --deepspeed_config",
    "fsdp": "use --backend fsdp",
    "hub_model_id": "use --push_to_hub REPO",
    "hub_private_repo": "use --hub_visibility private",
    "bf16": "the precision is set " + _IN_DS + ': bf16 {"enabled": true} (the kit\'s configs train in bf16)',
    "fp16": "the precision is set " + _IN_DS + ': fp16 {"enabled": true} instead of bf16',
    "torch_dtype": "the precision is set " + _IN_DS + ": its bf16 or fp16 section",
    "weight_decay": "set optimizer.params.weight_decay " + _IN_DS,
    "adam_beta1": "set optimizer.params.betas " + _IN_DS,
    "adam_beta2": "set optimizer.params.betas " + _IN_DS,
    "adam_epsilon": "set optimizer.params.eps " + _IN_DS,
    "optim": "set optimizer.type " + _IN_DS,
    "max_grad_norm": "set gradient_clipping " + _IN_DS,
}


def _reject_unknown_flags(argv: list[str], known: set[str]) -> None:
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0]
        if name in known or name == "help":
            continue
        hf_fix = HF_NAMES.get(name.replace("-", "_"))  # Hugging Face's parser takes --learning-rate too
        if hf_fix is not None:
            raise ConfigError(f"unknown flag --{name} (a Hugging Face Trainer name): {hf_fix}")
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.5)
        hint = f"did you mean --{close[0]}?" if close else "see --help for the valid flags"
        raise ConfigError(f"unknown flag --{name}: {hint}")


# The flags whose relative paths a launcher's caller means from where they typed them (the launcher changes to the
# kit's root, and says where it was started: launch_env.CALLER_DIR): inputs when they are there (a hub id stays
# one), outputs always. A run file's paths are the kit root's, as its own documents say.
CALLER_INPUTS = ("model", "tokenizer", "dataset", "validation_dataset", "deepspeed_config", "chat_template")
CALLER_INPUTS += ("sample_prompts", "resume_from_checkpoint", CONFIG)
CALLER_OUTPUTS = ("checkpoint_dir", "data_cache_dir", "report_dir", "metrics_file")


def _from_caller_dir(given: dict[str, Any]) -> dict[str, Any]:
    """The flags' relative paths taken from the launcher's caller's dir (CALLER_INPUTS, CALLER_OUTPUTS)."""
    caller = os.environ.get(launch_env.CALLER_DIR)
    if not caller or os.path.realpath(caller) == os.path.realpath(os.getcwd()):
        return given
    out = dict(given)
    for name, value in given.items():
        if not isinstance(value, str) or not value or os.path.isabs(value) or "://" in value:
            continue
        there = os.path.join(caller, os.path.expanduser(value))
        if (name in CALLER_OUTPUTS and value not in (AUTO, "none")) or (
            name in CALLER_INPUTS and os.path.exists(there)
        ):
            out[name] = os.path.normpath(there)
    return out


def parse_args(argv: list[str] | None = None, prog: str = "train_deepspeed.py") -> TrainConfig:
    """Defaults, then the run file (--config), then the flags: each later one overrides. Parsing only: the launch
    environment joins in resolution (resolve/resolver.py). `prog`: the command named in --help's usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _reject_unknown_flags(argv, {*flag_fields(), CONFIG})
    given = _from_caller_dir(vars(build_parser(prog).parse_args(argv)))
    values: dict[str, Any] = {}
    inline = None
    origins: tuple[tuple[str, str, str], ...] = ()
    config_path = given.pop(CONFIG, None)
    if config_path is not None:
        loaded = run_file.load(config_path, SECTIONS)
        values = dict(loaded.values)
        for pair in ONE_OF:
            for flag, other in (pair, pair[::-1]):
                if flag in given and other in values and other not in given:
                    del values[other]
        if loaded.deepspeed is not None and "deepspeed_config" not in given:
            inline = json.dumps(loaded.deepspeed, sort_keys=True)
        fields = flag_fields()
        origins = tuple(
            (name, f"run file {config_path}", run_file.key_of(name, fields[name][0]))
            for name in sorted(values)
            if name not in given
        )
    return assemble(values | given, inline, origins=origins, run_file=config_path)


def assemble(
    values: dict[str, Any],
    deepspeed_inline: str | None = None,
    accelerate: Any = None,
    origins: tuple[tuple[str, str, str], ...] = (),
    run_file: str | None = None,
) -> TrainConfig:
    """The config of these given values (flag name -> value; every other field at its default), checked.
    `origins`: where the values not typed as flags came from (TrainConfig.origins)."""
    fields = flag_fields()
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in values.items():
        per_section[fields[name][0]][name] = value
    try:
        sections = {s: SECTIONS[s](**kwargs) for s, kwargs in per_section.items()}
    except ConfigError as e:
        raise ConfigError(_subject_with_origin(str(e), origins)) from None
    return TrainConfig(
        **sections,
        explicit=frozenset(values),
        deepspeed_inline=deepspeed_inline,
        accelerate=accelerate,
        origins=origins,
        run_file=run_file,
    )


def _subject_with_origin(message: str, origins: tuple[tuple[str, str, str], ...]) -> str:
    """A check that has no config at hand names its value's flag first (`--liger 'maybe' is not one of ...`):
    where the value came from elsewhere, that name becomes the key and where it is (TrainConfig.setting), so the
    message never blames a flag nobody typed."""
    subject = re.search(r"--(\w+)", message)
    where = {flag: f"{key} ({place})" for flag, place, key in origins}
    if subject is None or subject.group(1) not in where:
        return message
    return message[: subject.start()] + where[subject.group(1)] + message[subject.end() :]


def given_values(cfg: TrainConfig) -> dict[str, Any]:
    """The values the user gave (cfg.explicit), by flag name."""
    fields = flag_fields()
    return {name: getattr(getattr(cfg, fields[name][0]), name) for name in sorted(cfg.explicit)}
