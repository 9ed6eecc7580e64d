"""A run's name and id: one rule for the launcher's log, the metrics records and the trackers.

The name says what runs: `--run_name`, else `<model>-<backend>[-lora]` (e.g. qwen3_0_6b-fsdp-lora). The id
names one run across its resumes and requeues (TrainState.run_id, kept in every checkpoint): `--run_name` as
given, else the name, the start time and the SLURM job. `train-singlenode.sh` names its log after the name
before any rank starts (`python -m model_utils.observe.run_name FLAGS`), so this module imports no torch.
"""

from __future__ import annotations

import os
import re
import sys
import time

from model_utils.config.arguments import TrainConfig, parse_args
from model_utils.errors import ConfigError


def short_name(model: str) -> str:
    """A --model as used in checkpoint tags and run names: 'Qwen/Qwen3-0.6B' -> 'qwen3_0_6b'."""
    base = model.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^a-z0-9]+", "_", base.lower()).strip("_") or "model"


def run_name(cfg: TrainConfig) -> str:
    if cfg.report.run_name is not None:
        return cfg.report.run_name
    lora = "-lora" if cfg.lora.enabled else ""
    return f"{short_name(cfg.model.model)}-{cfg.optim.backend}{lora}"


def new_run_id(cfg: TrainConfig) -> str:
    """The id of a run that starts now (a resume keeps its checkpoint's)."""
    if cfg.report.run_name is not None:
        return cfg.report.run_name  # the user's: found again by that name (`dskit plot NAME`)
    job = os.environ.get("SLURM_JOB_ID")
    return f"{run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}" + (f"-job{job}" if job else "")


def resume_mismatch(cfg: TrainConfig, resumed_id: str) -> str | None:
    """What to warn when --run_name differs from the id of the run a checkpoint continues (that id is kept: one
    run, one id across its files); None when they agree."""
    given = cfg.report.run_name
    if given is None or given == resumed_id:
        return None
    return (
        f"--run_name {given}: the checkpoint resumed continues run {resumed_id}, which keeps its id (metrics, "
        f"trackers, dskit plot {resumed_id}); a new --checkpoint_dir starts run {given}"
    )


def main(argv: list[str]) -> int:
    """Print the run name of these training flags; nothing and exit 2 when they do not parse (the launcher keeps
    its log's first name, and the preflight then says what is wrong)."""
    try:
        cfg = parse_args(argv)
    except (ConfigError, SystemExit):
        return 2
    print(run_name(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
