"""DeepSpeed's start-up without the work dskit never uses: no MLflow import, one CPU probe per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_fresh(code: str, *args: str) -> list[str]:
    """`code` in a new Python process, as a rank or a dskit command starts; its stdout lines."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_parsing_training_flags_imports_deepspeed_without_mlflow() -> None:
    """Parsing flags imports no DeepSpeed; the first deepspeed import of a rank (resolving the DeepSpeed
    settings) skips MLflow, and MLflow still imports afterwards for dskit's own tracker."""
    lines = run_fresh(
        "import sys\n"
        "from model_utils.arguments import parse_args\n"
        "cfg = parse_args([])\n"
        "print('deepspeed' in sys.modules)\n"
        "from model_utils import deepspeed_config\n"
        "deepspeed_config.resolve(cfg)\n"
        "from deepspeed.autotuning import autotuner\n"
        "print('deepspeed' in sys.modules, 'mlflow' in sys.modules, autotuner.has_mlflow)\n"
        "import mlflow\n"
        "print(mlflow.__name__, sys.modules['mlflow'] is mlflow)\n"
    )
    assert lines[-3:] == ["False", "True False False", "mlflow True"], lines


def test_an_earlier_mlflow_import_is_left_alone() -> None:
    lines = run_fresh(
        "import sys, mlflow\n"
        "from model_utils import startup\n"
        "startup.import_deepspeed()\n"
        "from deepspeed.autotuning import autotuner\n"
        "print(sys.modules['mlflow'] is mlflow, autotuner.has_mlflow)\n"
    )
    assert lines[-1] == "True True", lines


COUNT_CPU_PROBES = """
import contextlib, sys
import cpuinfo, torch
from model_utils import startup
startup.import_deepspeed()
from deepspeed.ops.adam import DeepSpeedCPUAdam
real, calls = cpuinfo.get_cpu_info, []
def counting():
    calls.append(1)
    return real()
cpuinfo.get_cpu_info = counting
context = startup.cpu_info_computed_once() if sys.argv[1] == "once" else contextlib.nullcontext()
with context:
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])  # loads the prebuilt op: its builder probes too
print(len(calls), cpuinfo.get_cpu_info is counting)
"""


@pytest.mark.parametrize(("mode", "expected"), [("plain", None), ("once", "1 True")])
def test_deepspeed_cpu_adam_probes_the_cpu_once_inside_the_context(mode: str, expected: str | None) -> None:
    """DeepSpeed's real CPU Adam (the offload optimizer), first built in a process as on a rank, asks py-cpuinfo
    several times (each a subprocess); inside cpu_info_computed_once the probe runs once, and the patch is
    undone afterwards."""
    calls, restored = run_fresh(COUNT_CPU_PROBES, mode)[-1].split()
    if expected is None:
        assert int(calls) >= 2, "DeepSpeed no longer probes the CPU repeatedly: the cache can go"
    else:
        assert f"{calls} {restored}" == expected
