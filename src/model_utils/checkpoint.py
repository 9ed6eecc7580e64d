"""DeepSpeed checkpoints: tag naming, auto-resume from `latest`, and the client state that makes resume exact.

Layout (DeepSpeed's own): <checkpoint_dir>/latest names the newest tag; <checkpoint_dir>/<model>-<N>steps/ holds
mp_rank_00_model_states.pt (weights + our client state), one optimizer shard per rank, and our per-rank RNG
states. The client state carries the training state (step, tokens, data position), the resolved config and
`universal_checkpoint_info`, so a later change of world size can go through DeepSpeed's universal checkpoint.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_utils.errors import ConfigError
from model_utils.log import print0, warn0

CLIENT_KEY = "dskit"
MODEL_STATES = "mp_rank_00_model_states.pt"


def checkpoint_tag(model_short_name: str, step: int) -> str:
    return f"{model_short_name}-{step}steps"


def check_writable(directory: str) -> None:
    """Fail before training if checkpoints could not be written (not after an hour of compute)."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"checkpoint dir {directory} is not writable ({e.strerror or e}): pass --checkpoint_dir with a writable path"
        ) from None


@dataclass(frozen=True)
class ResumeTarget:
    load_dir: Path
    tag: str


def _read_latest(directory: Path) -> str | None:
    latest = directory / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag or None


def find_resume_target(checkpoint_dir: str, resume_from: str | None) -> ResumeTarget | None:
    """The checkpoint to resume from: --resume_from_checkpoint (a dir with `latest`, or a tag dir), else
    <checkpoint_dir>/latest when present, else None (a fresh start)."""
    if resume_from is not None:
        path = Path(resume_from)
        if (path / MODEL_STATES).is_file():
            return ResumeTarget(path.parent, path.name)
        tag = _read_latest(path) if path.is_dir() else None
        if tag is None or not (path / tag / MODEL_STATES).is_file():
            raise ConfigError(
                f"--resume_from_checkpoint {resume_from} holds no checkpoint (no 'latest' naming a saved tag, "
                "and not a tag dir): point it at a checkpoint dir or drop the flag"
            )
        return ResumeTarget(path, tag)
    directory = Path(checkpoint_dir)
    tag = _read_latest(directory)
    if tag is None:
        return None
    if not (directory / tag / MODEL_STATES).is_file():
        raise ConfigError(
            f"{directory}/latest names {tag!r} but {directory / tag} holds no {MODEL_STATES}: "
            f"fix or remove {directory}/latest"
        )
    return ResumeTarget(directory, tag)


def _rng_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rng_state_rank{rank}.pt"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    engine: Any, checkpoint_dir: str, tag: str, train_state: dict[str, Any], config: dict[str, Any], rank: int
) -> None:
    client_state = {
        CLIENT_KEY: {"train_state": train_state, "config": config},
        # Marks the checkpoint as convertible with deepspeed.checkpoint.ds_to_universal (world-size changes).
        "universal_checkpoint_info": {},
    }
    engine.save_checkpoint(checkpoint_dir, tag=tag, client_state=client_state)
    torch.save(_rng_state(), _rng_file(Path(checkpoint_dir) / tag, rank))
    torch.distributed.barrier()  # every rank's RNG file is on disk before anyone moves on
    print0(f"Saved checkpoint {Path(checkpoint_dir) / tag}")


def load(engine: Any, target: ResumeTarget, rank: int) -> dict[str, Any]:
    """Load weights, optimizer, scheduler and our client state; returns the saved training state."""
    path, client_state = engine.load_checkpoint(str(target.load_dir), tag=target.tag)
    if path is None or not client_state or CLIENT_KEY not in client_state:
        raise ConfigError(
            f"checkpoint {target.load_dir / target.tag} could not be loaded: it is not a dskit checkpoint"
        )
    rng_file = _rng_file(target.load_dir / target.tag, rank)
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        warn0(
            f"no RNG state for rank {rank} in {target.tag} (world size changed?): continuing with fresh RNG"
        )
    return client_state[CLIENT_KEY]["train_state"]
