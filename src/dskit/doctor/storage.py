"""Checkpoint disk: the checkpoint directory is writable and its filesystem has room for the kept checkpoints plus
the one being written (checkpoints already there count, since rotation deletes them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from model_utils import engines
from model_utils.config.arguments import TrainConfig

from .context import _size
from .report import Result, Status


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def check_disk(cfg: TrainConfig, n_params: int | None, half_precision: bool) -> Result:
    """Free space for `keep_checkpoints` checkpoints plus the one being written (rotation deletes after a save)."""
    name = "checkpoint disk"
    directory = Path(cfg.checkpoint.checkpoint_dir)
    where = _existing_ancestor(directory)
    if not os.access(where, os.W_OK | os.X_OK):
        return Result(
            name,
            Status.FAIL,
            f"{where} is not writable (checkpoint dir {directory})",
            "pass --checkpoint_dir with a writable path on a shared filesystem",
        )
    if n_params is None:
        return Result(name, Status.WARN, "could not count the model's parameters (see 'host RAM')", "")
    # What a tag holds per parameter is the engine's (weights, fp32 masters, Adam's moments).
    per_param = engines.checkpoint_format(cfg.optim.backend).checkpoint_bytes_per_param(half_precision)
    per_checkpoint = n_params * per_param
    copies = cfg.checkpoint.keep_checkpoints + 1
    needed = per_checkpoint * copies
    # Tags already there count toward the total: rotation deletes them as new ones arrive.
    from model_utils.checkpoint.protocol import is_tag_dir

    existing = sum(_tree_bytes(t) for t in directory.glob("*") if is_tag_dir(t))
    usage = shutil.disk_usage(where)
    available = usage.free + existing
    found = (
        f"{_size(needed)} for {copies} checkpoints ({cfg.checkpoint.keep_checkpoints} kept + 1 being written) "
        f"of {_size(per_checkpoint)} ({n_params / 1e6:,.1f}M params x {per_param} B), "
        f"{_size(usage.free)} free at {where}"
        + (f" + {_size(existing)} in existing checkpoints" if existing else "")
    )
    if needed > available:
        fits = int(available // per_checkpoint) - 1
        lower = f", or --keep_checkpoints {fits}" if fits >= 1 else ""
        return Result(
            name,
            Status.FAIL,
            found,
            f"free {_size(needed - available)} more there, move --checkpoint_dir to a larger filesystem{lower}",
        )
    return Result(name, Status.PASS, found)
