"""The ledger file's format and what an attempt learns of itself: its launch time, the host's instance type,
SLURM's submit time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from model_utils.observe import ledger_file


def test_without_a_launcher_the_attempt_starts_with_the_process() -> None:
    # A fresh process's start from /proc, against the wall clock around its spawn (clock ticks: 10 ms).
    before = time.time()
    code = "from model_utils.observe import ledger_file; print(ledger_file.process_started_at())"
    started = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    assert before - 0.05 <= started <= time.time()


def test_the_instance_type_from_the_env_sagemaker_or_ec2(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DSKIT_INSTANCE_TYPE", "p5.48xlarge")
    assert ledger_file.instance_type() == "p5.48xlarge"
    monkeypatch.delenv("DSKIT_INSTANCE_TYPE")
    resources = tmp_path / "resourceconfig.json"
    resources.write_text(json.dumps({"current_instance_type": "ml.p4d.24xlarge"}))
    monkeypatch.setattr(ledger_file, "_SAGEMAKER_RESOURCES", resources)
    assert ledger_file.instance_type() == "ml.p4d.24xlarge"
    monkeypatch.setattr(ledger_file, "_SAGEMAKER_RESOURCES", tmp_path / "none")
    product = tmp_path / "product_name"
    monkeypatch.setattr(ledger_file, "_EC2_PRODUCT_NAME", product)
    product.write_text("g5.xlarge\n")  # what an EC2 Nitro host's DMI says
    assert ledger_file.instance_type() == "g5.xlarge"
    product.write_text("Standard PC (Q35 + ICH9, 2009)\n")  # a VM elsewhere
    assert ledger_file.instance_type() is None


def test_slurms_submit_time_from_scontrol(tmp_path: Path, monkeypatch) -> None:
    # A stand-in scontrol (the real one answers in tests/slurm/test_slurm.py's requeued run).
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\necho 'JobId=7 JobName=x SubmitTime=2026-11-26T10:00:00 StartTime=2026-11-26T10:05:00'\n"
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert ledger_file.slurm_submitted_at("7") == datetime(2026, 11, 26, 10, 0, 0).timestamp()
    scontrol.write_text("#!/bin/sh\nexit 1\n")
    assert ledger_file.slurm_submitted_at("7") is None


def test_a_record_is_one_whole_line_stamped_now(tmp_path: Path) -> None:
    path = tmp_path / "deep" / ledger_file.LEDGER
    before = time.time()
    ledger_file.append(path, "exit", status=1)
    ledger_file.append(path, "closed")
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first == {"event": "exit", "t": first["t"], "status": 1} and before <= first["t"] <= second["t"]


def test_the_job_record_names_the_scheduler(monkeypatch) -> None:
    for name in ("SLURM_JOB_ID", "TRAINING_JOB_NAME", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert ledger_file.job_record() == {"scheduler": None, "id": None, "submitted_at": None}
    monkeypatch.setenv("TRAINING_JOB_NAME", "sm-job")
    assert ledger_file.job_record()["scheduler"] == "sagemaker"
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the submit time is unknown, not an error
    assert ledger_file.job_record() == {"scheduler": "slurm", "id": "12", "restart": 2, "submitted_at": None}
