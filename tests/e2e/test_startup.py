"""DeepSpeed's and transformers' start-up in a fresh process, as a rank or a dskit command starts: no MLflow
import, one CPU probe per host, DeepSpeed's Muon module without compiling, nothing a rank does not use. Each
test starts its own Python (seconds each), hence here; what a whole rank imports: test_lean_rank.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.torchrun import REPO

pytestmark = pytest.mark.e2e


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
        "from model_utils.config.arguments import parse_args\n"
        "cfg = parse_args([])\n"
        "print('deepspeed' in sys.modules)\n"
        "from model_utils.resolve import train_settings\n"
        "train_settings.resolve(cfg)\n"
        "from deepspeed.autotuning import autotuner\n"
        "print('deepspeed' in sys.modules, 'mlflow' in sys.modules, autotuner.has_mlflow)\n"
        "import mlflow\n"
        "print(mlflow.__name__, sys.modules['mlflow'] is mlflow)\n"
    )
    assert lines[-3:] == ["False", "True False False", "mlflow True"], lines


def test_an_earlier_mlflow_import_is_left_alone() -> None:
    lines = run_fresh(
        "import sys, mlflow\n"
        "from model_utils.launch import startup\n"
        "startup.import_deepspeed()\n"
        "from deepspeed.autotuning import autotuner\n"
        "print(sys.modules['mlflow'] is mlflow, autotuner.has_mlflow)\n"
    )
    assert lines[-1] == "True True", lines


COUNT_CPU_PROBES = """
import contextlib, pathlib, sys
import cpuinfo, torch
from model_utils.launch import startup
startup.import_deepspeed()
from deepspeed.ops.adam import DeepSpeedCPUAdam
real, calls = cpuinfo.get_cpu_info, []
def counting():
    calls.append(1)
    return real()
cpuinfo.get_cpu_info = counting
host_cache = None if len(sys.argv) < 3 else pathlib.Path(sys.argv[2])
context = contextlib.nullcontext() if sys.argv[1] == "plain" else startup.cpu_info_computed_once(host_cache)
with context:
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])  # loads the prebuilt op: its builder probes too
print(len(calls), cpuinfo.get_cpu_info is counting)
"""


def test_deepspeed_cpu_adam_probes_the_cpu_repeatedly_on_its_own() -> None:
    """DeepSpeed's real CPU Adam (the offload optimizer), first built in a process as on a rank, asks py-cpuinfo
    several times (each a subprocess): why the kit caches the answer."""
    calls, _ = run_fresh(COUNT_CPU_PROBES, "plain")[-1].split()
    assert int(calls) >= 2, "DeepSpeed no longer probes the CPU repeatedly: the cache can go"


def test_deepspeed_cpu_adam_probes_the_cpu_once_per_host_inside_the_context(tmp_path) -> None:
    """Inside cpu_info_computed_once the first process of the host probes once and keeps the answer in the cache
    dir (the engine's: the DeepSpeed ops dir); the next process, as the next rank or launch, does not probe at
    all. The patch is undone afterwards."""
    assert run_fresh(COUNT_CPU_PROBES, "host", str(tmp_path))[-1] == "1 True"
    assert [p.name.startswith("dskit-cpuinfo-") for p in tmp_path.iterdir()] == [True]
    assert run_fresh(COUNT_CPU_PROBES, "host", str(tmp_path))[-1] == "0 True"


def test_deepspeed_muon_module_is_imported_without_compiling() -> None:
    """DeepSpeed's Muon module (imported by every ZeRO-1/2 engine) is in place after import_deepspeed, without
    torch's inductor, and its compiled functions are still torch.compile'd, on their first call."""
    lines = run_fresh(
        "import sys\n"
        "from model_utils.launch import startup\n"
        "startup.import_deepspeed()\n"
        "print(startup.MUON_MODULE in sys.modules, 'torch._inductor.compile_fx' in sys.modules)\n"
        "from deepspeed.runtime import compiler\n"
        "from deepspeed.runtime.zero.muon import original_muon\n"
        "print(compiler.compile() is __import__('torch').compile)\n"  # restored for everyone else
        "print(original_muon.zeropower_via_newtonschulz5.__name__)\n"
    )
    assert lines[-3:] == ["True False", "True", "zeropower_via_newtonschulz5"], lines


def test_transformers_import_holds_back_what_ranks_do_not_use() -> None:
    """jinja2 (chat templates), boto3 (accelerate's SageMaker command) and scipy (object detection losses) stay out
    of a rank, the model's modeling code imported too; they import normally afterwards (dskit's S3 tier imports
    boto3 when it is used)."""
    lines = run_fresh(
        "import sys\n"
        "from model_utils.launch import startup\n"
        "startup.import_transformers()\n"
        "from transformers import Qwen3Config, Qwen3ForCausalLM\n"
        "Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=1, hidden_size=8, intermediate_size=8, num_attention_heads=2,"
        " num_key_value_heads=1, head_dim=4, vocab_size=16))\n"
        "print(*(name in sys.modules for name in ('jinja2', 'boto3', 'scipy', 'transformers')))\n"
        "import boto3, jinja2, scipy.optimize\n"
        "print(boto3.__name__, jinja2.__name__, scipy.optimize.__name__)\n"
    )
    assert lines[-2:] == ["False False False True", "boto3 jinja2 scipy.optimize"], lines
