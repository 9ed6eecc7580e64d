"""`dskit gpu-check --only launcher`: the default launcher for a few steps with the interpreter that runs the
check (DSKIT_PYTHON, so the launcher does not sync its own environment), its own checkpoint dir and metrics
file; the check's JSON reads the metrics back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dskit.bench import gpu_check
from support.torchrun import ENV, REPO

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]


def test_gpu_check_runs_the_default_launcher_for_a_few_steps(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dskit.cli", "gpu-check", "--only", "launcher", "--out_dir", str(out)]
    env = {k: v for k, v in ENV.items() if k != "DSKIT_PYTHON"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    reports = list(out.glob("gpu-check-*.json"))
    stamp = json.loads(reports[0].read_text())["started"] if reports else None
    try:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        report = json.loads(reports[0].read_text())
        (check,) = report["checks"]
        assert check["name"] == f"launcher: ./train-singlenode.sh --max_steps {gpu_check.LAUNCHER_STEPS}"
        assert check["status"] == "pass", check
        launcher = report["launcher"]
        assert launcher["steps"] == gpu_check.LAUNCHER_STEPS and launcher["tokens_per_s"] > 0
        log = (out / reports[0].name.replace(".json", ".launcher.log")).read_text()
        assert f"Step {gpu_check.LAUNCHER_STEPS}/{gpu_check.LAUNCHER_STEPS} | Loss" in log
    finally:  # the launcher's own log in logs/, this run's only
        for path in (REPO / "logs").glob(f"gpu-check-{stamp}_*"):
            path.unlink()
