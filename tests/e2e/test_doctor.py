"""The real doctor stopping a real launcher: train-singlenode.sh as rendered runs preflight (the doctor, then
prepare) for real, and a FAIL stops the launch before prepare and torchrun. The doctor's checks and the launchers'
handling of its exit statuses: tests/unit/dskit/doctor/test_doctor.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dskit import render
from support.fake_commands import NOOP, executable
from support.torchrun import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]
QWEN3_0_6B_PARAMS = 596_049_920  # tests/unit/config/test_presets.py checks it is the real one


def test_the_real_doctor_stops_a_real_launcher(tmp_path: Path) -> None:
    """train-singlenode.sh as rendered, with the repo's own python for preflight: a real FAIL stops it."""
    repo, calls, bin_dir = tmp_path / "repo", tmp_path / "calls", tmp_path / "bin"
    for d in (repo / "src", calls):
        d.mkdir(parents=True)
    (repo / "src" / "train_deepspeed.py").write_text("")
    for package in (
        "dskit",
        "model_utils",
    ):  # the launchers' own steps (src/dskit/launcher/) are the kit's code
        (repo / "src" / package).symlink_to(REPO / "src" / package)
    render.write_scripts(render.render_scripts(render.LaunchValues()), repo)
    # preflight (the doctor, then prepare) runs for real; the version probe is answered, other calls recorded
    executable(
        repo / ".venv" / "bin" / "python",
        "#!/usr/bin/env bash\n"
        'if [[ "$3" == preflight ]]; then exec ' + sys.executable + ' "$@"; fi\n'
        'if [[ "$1 $2" == "-m dskit.env.python_env" ]]; then echo "0 3.11.7 2.6.0 none 0.19.8"; exit 0; fi\n'
        'if [[ "$1 $2" == "-m dskit.env.lock_stamp" ]]; then exit 0; fi\n'
        'printf "%s\\0" "$@" >"$CALLS/$(date +%s%N)"\n',
    )
    executable(bin_dir / "uv", NOOP)
    (bin_dir / "python3").symlink_to(sys.executable)  # the launchers' own steps, under this interpreter
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "EFA", "GPUS_PER", "CPU_RANKS"))
        },
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "DS_ACCELERATOR": "cpu",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"),
        "JOB_NAME": "doctor-test",
    }
    per_checkpoint = QWEN3_0_6B_PARAMS * 14
    keep = shutil.disk_usage(repo).free // per_checkpoint + 1
    proc = subprocess.run(
        [str(repo / "train-singlenode.sh"), "--model", "qwen3-0.6b", "--keep_checkpoints", str(keep)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "dskit doctor on " in output and "(1 node):" in output
    assert "checkpoint disk FAIL" in " ".join(output.split())
    assert "error: dskit doctor stopped the launch on" in output
    assert "ok: " not in output, "prepare ran after the doctor failed"
    assert list(calls.iterdir()) == [], "torchrun ran after the doctor failed"
    (log,) = (repo / "logs").glob("doctor-test_*.out")
    assert "doctor: " in log.read_text()
