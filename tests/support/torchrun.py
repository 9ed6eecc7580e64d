"""Real torchrun launches (torch.distributed.run as a subprocess on CPU), for tests where the launch itself is
under test; other multi-rank runs go through support/rank_pool.py, which keeps this module's contract."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO / "src" / "train_deepspeed.py"
# Offline and on CPU, whatever the developer's shell says; tests/ on the path of what they start, for the observers
# tests add to a run (support/step_control.py).
_PATH = [str(REPO / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
ENV = {
    **os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join(_PATH),
}  # fmt: skip


def torchrun_cmd(
    args: list[str], script: Path | str = TRAIN_SCRIPT, nproc: int = 2, log_dir: Path | str | None = None
) -> list[str]:
    """`log_dir`: torchrun's (its default is a torchelastic_* dir in /tmp that it never removes)."""
    logs = [] if log_dir is None else [f"--log-dir={log_dir}"]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *logs,
        str(script), *args,
    ]  # fmt: skip


def run_torchrun(
    args: list[str],
    *,
    script: Path | str = TRAIN_SCRIPT,
    nproc: int = 2,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    """The finished run, whatever its exit status (crash tests expect failures)."""
    with tempfile.TemporaryDirectory(prefix="dskit-test-torchrun-") as logs:
        return subprocess.run(
            torchrun_cmd(args, script, nproc, log_dir=logs),
            cwd=cwd,
            env=env or ENV,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def train(args: list[str], cwd: Path = REPO, **kwargs) -> str:
    """A run that must succeed; its stdout and stderr together."""
    return succeeded(run_torchrun(args, cwd=cwd, **kwargs))


def succeeded(proc: subprocess.CompletedProcess) -> str:
    """A run's stdout and stderr together, asserting it exited 0 (its tail in the failure message)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out
