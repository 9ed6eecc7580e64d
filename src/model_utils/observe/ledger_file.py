"""The run's goodput ledger file: its name, its one way of appending a record, and what an attempt can learn of
itself without torch (the launch time, the host's instance type, SLURM's submit time). The records and when they
are written: loop/observers/ledger.py; their reader: `dskit cost` (dskit/cost)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from model_utils import launch_env

LEDGER = "dskit-ledger.jsonl"
_EC2_PRODUCT_NAME = Path("/sys/devices/virtual/dmi/id/product_name")  # the instance type on EC2 Nitro hosts
_SAGEMAKER_RESOURCES = Path("/opt/ml/input/config/resourceconfig.json")


def process_started_at() -> float:
    """This process's start, in Unix seconds: now less its age (/proc's start in clock ticks since boot against
    the uptime; the boot time /proc/stat gives is whole seconds)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def instance_type() -> str | None:
    """What the host is, for the price table: DSKIT_INSTANCE_TYPE, SageMaker's resource config, or EC2's DMI
    product name (an instance type such as p5.48xlarge on Nitro hosts); None elsewhere."""
    if os.environ.get(launch_env.INSTANCE_TYPE):
        return os.environ[launch_env.INSTANCE_TYPE]
    try:
        return json.loads(_SAGEMAKER_RESOURCES.read_text())["current_instance_type"]
    except (OSError, ValueError, KeyError):
        pass
    try:
        name = _EC2_PRODUCT_NAME.read_text().strip()
    except OSError:
        return None
    # A Nitro host names its instance type ("g5.xlarge"); others a vendor's product name.
    return name if "." in name and " " not in name else None


def slurm_submitted_at(job_id: str) -> float | None:
    """The job's SubmitTime from scontrol (one call at the start), as Unix seconds; None where it does not answer."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        out = subprocess.run(
            [scontrol, "show", "job", "--oneliner", job_id], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for field in out.split():
        if field.startswith("SubmitTime="):
            try:
                return datetime.fromisoformat(field.split("=", 1)[1]).timestamp()  # the host's local time
            except ValueError:
                return None
    return None


def job_record() -> dict[str, Any]:
    """The scheduler's job this attempt runs in, and when it was submitted where the scheduler says."""
    if "SLURM_JOB_ID" in os.environ:
        job_id = os.environ["SLURM_JOB_ID"]
        return {
            "scheduler": "slurm",
            "id": job_id,
            "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "submitted_at": slurm_submitted_at(job_id),
        }
    if "TRAINING_JOB_NAME" in os.environ:
        return {"scheduler": "sagemaker", "id": os.environ["TRAINING_JOB_NAME"], "submitted_at": None}
    return {"scheduler": None, "id": None, "submitted_at": None}


def append(path: Path, event: str, **fields: Any) -> None:
    """One record, stamped now; one write per record, so a crash leaves whole lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
