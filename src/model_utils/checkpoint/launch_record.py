"""How a run was launched, saved beside every checkpoint, and what a resume may and may not change.

A resume with another model architecture or sequence length is refused (the weights or the data position would
not mean the same thing). A different world size is allowed: the trainer converts a DeepSpeed checkpoint to DeepSpeed's
universal layout once and resumes it whole (protocol.convert_universal; an FSDP checkpoint reshards on load),
or loads the weights alone when the optimizer's parameter groups changed too or the conversion fails, with a
warning. A checkpoint of the other --backend is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from model_utils import engines
from model_utils.errors import ConfigError
from model_utils.observe import redact
from model_utils.optim.schedules import RanSchedule
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
        "cuda_version": os.environ.get("CUDA_VERSION"),
        "torch_cuda": torch.version.cuda,
        "env": redact.tree({k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "FI_"))}),
    }


def read(tag_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((tag_dir / "launch.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def check_resume(
    tag_dir: Path,
    model_config: Any,
    seq_length: int,
    world_size: int | None,
    optimizer_groups: list[list[int]] | None = None,
    backend: str | None = None,
) -> str | None:
    """Raise on an incompatible resume. Return why only the weights can be loaded (another world size, or
    another layout of the optimizer's parameter groups), else None. world_size and optimizer_groups None: not
    known yet, as in `dskit prepare`. backend: --backend, checked against the engine that wrote the tag."""
    # The other engines are asked (imported) only when the run's own does not recognise the tag.
    if backend is not None and not engines.engine_class(backend).owns_tag(tag_dir):
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
        return None
    resolved = launch.get("resolved", {})
    # Kits before the resolved run wrote the resolved sequence length into the config itself.
    saved_seq = resolved.get("seq_length", launch["config"]["data"]["seq_length"])
    if saved_seq != seq_length:
        raise ConfigError(
            f"checkpoint {tag_dir} was trained with --seq_length {saved_seq}, not {seq_length}: "
            f"resume with --seq_length {saved_seq}, or use a new --checkpoint_dir"
        )
    if world_size is not None and launch["world_size"] != world_size:
        return f"world size changed from {launch['world_size']} to {world_size}"
    saved_groups = resolved.get("optimizer_groups")
    if optimizer_groups is not None and saved_groups != optimizer_groups:
        before = "one group (a kit before weight-decay groups)" if saved_groups is None else str(saved_groups)
        return f"the optimizer's parameter groups changed from {before} to {optimizer_groups}"
    return None


def saved_world_size(tag_dir: Path) -> int | None:
    launch = read(tag_dir)
    return None if launch is None else launch.get("world_size")


def ran_schedule(tag_dir: Path) -> RanSchedule | None:
    """The lr schedule the run that saved tag_dir trained (its warm-up and total steps, as resolved); None: a
    checkpoint without a launch record of them."""
    launch = read(tag_dir)
    resolved = {} if launch is None else launch.get("resolved", {})
    total = resolved.get("max_steps")
    if not isinstance(total, int) or "warmup_steps" not in resolved:
        return None
    return RanSchedule(resolved["warmup_steps"], total)
