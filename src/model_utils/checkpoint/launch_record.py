"""How a run was launched, saved beside every checkpoint, and what a resume may and may not change.

`check_resume` compares every launch setting a checkpoint fixes, before any rank starts (the preflight) and again
on the ranks; each difference is refused in one line or handled and said in one line:

- refused: another --backend, model architecture or sequence length (the weights or the data position would not
  mean the same thing), other LoRA flags (model/lora.py's check_resume), another chat template (the one the run
  trains with is the one every checkpoint's tokenizer carries into its exports), and other data (the prepared
  data's content fingerprint, not its path) unless --new_data true, which starts the data position over;
- weights only (optimizer state starts fresh): another ZeRO stage, or other optimizer parameter groups. Another
  world size resumes whole: the trainer converts a DeepSpeed checkpoint to DeepSpeed's universal layout once
  (protocol.convert_universal; an FSDP checkpoint reshards on load), or loads the weights alone when the
  conversion fails, with a warning;
- another --lr_schedule: the new schedule continues from the loaded step, the optimizer state is kept and the
  old scheduler's state is not loaded (ScheduleSpec.resume_line says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_utils import engines
from model_utils.config import deepspeed_file
from model_utils.errors import ConfigError
from model_utils.model import models
from model_utils.observe import redact
from model_utils.optim.schedules import CLIENT_SCHEDULES, NONE, RanSchedule
from model_utils.repo import REPO_ROOT

# Keys of a transformers config that define the architecture; others (dtype, name, ...) may change freely.
ARCHITECTURE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
# launch.json's keys beside the launch: the chat template the run trains with (its tokenizer's, as every tag's
# hf_config/ holds it; checkpoint/protocol.py records it at each save), and the absolute path of a local --model
# (the base weights a LoRA export merges onto: dskit/export.py).
CHAT_TEMPLATE = "chat_template"
MODEL_DIR = "model_dir"
# check_resume's chat_template when the caller does not know the run's template yet: not compared.
NOT_KNOWN: Any = object()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _lock_hash() -> str | None:
    lock = REPO_ROOT / "uv.lock"
    return hashlib.sha256(lock.read_bytes()).hexdigest() if lock.is_file() else None


def collect(
    config: dict[str, Any], resolved: dict[str, Any], deepspeed_config: dict[str, Any], world_size: int
) -> dict[str, Any]:
    """`config`: the user's, as parsed; `resolved`: what preflight derived from it (sequence length, micro
    batch, max_steps, ...)."""
    import torch

    # launch.json sits beside the weights and is copied with them: no credentials in it (observe/redact.py).
    run = redact.tree({"config": config, "resolved": resolved, "deepspeed_config": deepspeed_config})
    return {
        **run,
        # Two launches trained the same run (flags, run file, DeepSpeed dict, resolved values) iff these match.
        "run_sha256": hashlib.sha256(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest(),
        "git_commit": _git_commit(),
        "uv_lock_sha256": _lock_hash(),
        "nodes": os.environ.get("SLURM_JOB_NODELIST") or socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "world_size": world_size,
        MODEL_DIR: _model_dir(config),
        "cuda_version": os.environ.get("CUDA_VERSION"),
        "torch_cuda": torch.version.cuda,
        "env": redact.tree({k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "FI_"))}),
    }


def _model_dir(config: dict[str, Any]) -> str | None:
    """A local --model's absolute path (a relative one names a dir of the run's working directory only)."""
    name = (config.get("model") or {}).get("model")
    local = None if name is None else models.resolve_model_source(str(name)).local_dir
    return None if local is None else str(local.resolve())


def read(tag_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((tag_dir / "launch.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


@dataclass(frozen=True)
class ResumePlan:
    """What a resume that may go ahead does differently from a plain one (each None: nothing)."""

    weights_only: str | None = None  # why only the weights load (the optimizer state starts fresh)
    data_reset: str | None = None  # the line saying the data changed and its position starts over


def check_resume(
    tag_dir: Path,
    model_config: Any,
    seq_length: int,
    world_size: int | None,
    optimizer_groups: list[list[int]] | None = None,
    backend: str | None = None,
    zero_stage: int | None = None,
    data_fingerprint: str | None = None,
    new_data: bool = False,
    dataset: str | None = None,
    precision: str | None = None,
    sources: str | None = None,
    chat_template: Any = NOT_KNOWN,
) -> ResumePlan:
    """Raise on an incompatible resume; else the plan (what is loaded, what starts over). world_size,
    optimizer_groups and data_fingerprint None: not known yet (the preflight before the data, `dskit prepare`);
    dataset, sources: --dataset and --sources (a mixture's, which then names the data), for the messages.
    backend: --backend, checked against the engine that wrote the tag; zero_stage: the run's ZeRO stage (the
    backend's, where it shards by stage); precision: the run's (bf16, fp16, fp32); chat_template: the one the run
    trains with (its tokenizer's: a string, a dict of named ones, or None). The lr schedule is compared by the
    resolver (ScheduleSpec.resume_line)."""
    # The other engines are asked (imported) only when the run's own does not recognise the tag.
    if backend is not None and not engines.checkpoint_format(backend).owns_tag(tag_dir):
        saved_backend = engines.engine_of_tag(tag_dir)
        if saved_backend is not None:
            raise ConfigError(
                f"checkpoint {tag_dir} was saved by --backend {saved_backend}, not {backend}: resume with --backend "
                f"{saved_backend}, or start a new --checkpoint_dir from its weights (dskit export, then --model)"
            )
    saved_config_path = tag_dir / "hf_config" / "config.json"
    if saved_config_path.is_file():
        saved = json.loads(saved_config_path.read_text())
        current = model_config.to_dict()
        for key in ARCHITECTURE_KEYS:
            if key in saved and saved.get(key) != current.get(key):
                raise ConfigError(
                    f"checkpoint {tag_dir} has {key}={saved[key]} but the model now has {key}={current.get(key)}: "
                    "resume with the same --model, or use a new --checkpoint_dir"
                )
    launch = read(tag_dir)
    if launch is None:
        return ResumePlan()
    resolved = launch.get("resolved", {})
    # Kits before the resolved run wrote the resolved sequence length into the config itself.
    saved_seq = resolved.get("seq_length", launch["config"]["data"]["seq_length"])
    if saved_seq != seq_length:
        raise ConfigError(
            f"checkpoint {tag_dir} was trained with --seq_length {saved_seq}, not {seq_length}: "
            f"resume with --seq_length {saved_seq}, or use a new --checkpoint_dir"
        )
    _check_precision(tag_dir, launch, precision)
    _check_chat_template(tag_dir, launch, chat_template)
    data_reset = _data_change(tag_dir, launch, data_fingerprint, new_data, dataset, sources)
    why = _weights_only(launch, world_size, optimizer_groups, backend, zero_stage)
    return ResumePlan(weights_only=why, data_reset=data_reset)


def _weights_only(
    launch: dict[str, Any],
    world_size: int | None,
    optimizer_groups: list[list[int]] | None,
    backend: str | None,
    zero_stage: int | None,
) -> str | None:
    """Why the checkpoint's optimizer state cannot be loaded into this run (None: it can)."""
    resolved = launch.get("resolved", {})
    saved_stage = _saved_zero_stage(launch)
    sharded_by_stage = backend is not None and engines.memory_model(backend).zero_stages
    # Each ZeRO stage lays the optimizer state out in its own files (ZeRO-3 the weights too): DeepSpeed loads
    # none of another stage's, so the weights come from the consolidated masters (DeepSpeedEngine.load).
    if sharded_by_stage and zero_stage is not None and saved_stage is not None and saved_stage != zero_stage:
        return f"ZeRO stage changed from {saved_stage} to {zero_stage}"
    if world_size is not None and launch["world_size"] != world_size:
        return f"world size changed from {launch['world_size']} to {world_size}"
    saved_groups = resolved.get("optimizer_groups")
    if optimizer_groups is not None and saved_groups != optimizer_groups:
        before = "one group (a kit before weight-decay groups)" if saved_groups is None else str(saved_groups)
        return f"the optimizer's parameter groups changed from {before} to {optimizer_groups}"
    return None


def _check_precision(tag_dir: Path, launch: dict[str, Any], precision: str | None) -> None:
    """Another precision is refused: the optimizer state carries its precision's loss scaling (DeepSpeed's ZeRO
    state holds the loss scaler and a resume loads it: fp16 would train on at bf16's fixed scale of 1)."""
    saved = launch.get("resolved", {}).get("precision")
    if saved is None and isinstance(
        launch.get("deepspeed_config"), dict
    ):  # kits before the resolved precision
        saved = deepspeed_file.precision_of(launch["deepspeed_config"])
    if precision is not None and saved is not None and saved != precision:
        raise ConfigError(
            f"checkpoint {tag_dir} was trained in {saved}, not {precision}: resume with its precision (the "
            f"DeepSpeed config's {saved} section), or start a new --checkpoint_dir from its weights (dskit export, "
            "then --model)"
        )


def _check_chat_template(tag_dir: Path, launch: dict[str, Any], chat_template: Any) -> None:
    """Another chat template is refused: the checkpoint's tokenizer (and so every export of it) carries one
    template, and a model trained on two formats would be prompted in one of them."""
    if chat_template is NOT_KNOWN or CHAT_TEMPLATE not in launch:
        return  # not known yet, or a checkpoint of a kit before the record: nothing to compare
    saved = launch[CHAT_TEMPLATE]
    if saved == chat_template:
        return
    given = ((launch.get("config") or {}).get("data") or {}).get("chat_template")
    what = (
        "no chat template"
        if saved is None
        else f"another chat template{f' (--chat_template {given})' if given else ''}, which its hf_config/ holds"
    )
    now = " (none)" if chat_template is None else ""
    raise ConfigError(
        f"checkpoint {tag_dir} was trained with {what}, not this run's{now}: resume with the template it trained "
        "with, or start a new --checkpoint_dir from its weights (dskit export, then --model)"
    )


def _saved_zero_stage(launch: dict[str, Any]) -> int | None:
    stage = launch.get("resolved", {}).get("zero_stage")
    if isinstance(stage, int):
        return stage
    zero = launch.get("deepspeed_config", {}).get("zero_optimization")  # kits before the resolved stage
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else None


def _data_change(
    tag_dir: Path,
    launch: dict[str, Any],
    data_fingerprint: str | None,
    new_data: bool,
    dataset: str | None,
    sources: str | None = None,
) -> str | None:
    """The line of a resume onto other data with --new_data true (its position starts over); a refusal without
    it. Same content elsewhere (a moved or copied dataset) has the same fingerprint: no change."""
    saved = launch.get("resolved", {}).get("data_fingerprint")
    if data_fingerprint is None or saved is None or saved == data_fingerprint:
        return None  # not known yet, or a checkpoint of a kit before the fingerprint: nothing to compare
    saved_data = launch.get("config", {}).get("data", {})
    saved_dataset = saved_data.get("sources") or saved_data.get(
        "dataset"
    )  # a mixture's sources name its data
    if not new_data:
        given = f"--sources {sources}" if sources is not None else f"--dataset {dataset}"
        raise ConfigError(
            f"checkpoint {tag_dir} was trained on other data ({saved_dataset}, content {saved}) than {given} "
            f"(content {data_fingerprint}): resume with its data, pass --new_data true to train on this "
            "data from its start (weights, optimizer and lr schedule continue), or use a new --checkpoint_dir"
        )
    return (
        f"--new_data: the data changed from {saved_dataset} (content {saved}) to {sources or dataset} (content "
        f"{data_fingerprint}): its position starts over at epoch 0, block 0 (weights, optimizer and lr schedule "
        "continue)"
    )


def saved_world_size(tag_dir: Path) -> int | None:
    launch = read(tag_dir)
    return None if launch is None else launch.get("world_size")


def ran_schedule(tag_dir: Path) -> RanSchedule | None:
    """The lr schedule the run that saved tag_dir trained (its kind, warm-up and total steps, as resolved);
    None: a checkpoint without a launch record of them."""
    launch = read(tag_dir)
    resolved = {} if launch is None else launch.get("resolved", {})
    total = resolved.get("max_steps")
    if launch is None or not isinstance(total, int) or "warmup_steps" not in resolved:
        return None
    return RanSchedule(
        resolved["warmup_steps"], total, resolved.get("lr_schedule_kind") or _schedule_kind(launch)
    )


# The kinds of DeepSpeed's scheduler classes the kit's --lr_schedule runs (optim/schedules.py).
_DEEPSPEED_KINDS = {"WarmupCosineLR": "cosine", "WarmupLR": "constant"}


def _schedule_kind(launch: dict[str, Any]) -> str | None:
    """The schedule kind a launch record of a kit before `lr_schedule_kind` implies: DeepSpeed's scheduler
    section, else the kit's own (--lr_schedule wsd, linear), else none."""
    section = launch.get("deepspeed_config", {}).get("scheduler")
    if isinstance(section, dict):
        return _DEEPSPEED_KINDS.get(str(section.get("type")), section.get("type"))
    flag = launch.get("config", {}).get("optim", {}).get("lr_schedule")
    return flag if flag in CLIENT_SCHEDULES else NONE if "deepspeed_config" in launch else None
