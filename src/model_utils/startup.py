"""Importing and initialising DeepSpeed without the start-up work a dskit run never uses.

Every rank pays DeepSpeed's start-up before its first step, and the launchers' preflight pays the import once
more. Two parts of it are work for features dskit does not use, measured on a 2-core CPU machine:
- `import deepspeed` imports MLflow (~2 s) because DeepSpeed's autotuner logs to it when installed. dskit
  never runs that autotuner, and its own tracker (trackers.py) imports MLflow itself when asked to.
- `deepspeed.initialize` with the CPU-offload optimizer calls py-cpuinfo's `get_cpu_info()` three times (the
  Adam op and its builder's arch and SIMD checks); each call starts a Python subprocess (~1.2 s). The answer
  cannot change within a process, so it is computed once.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from types import ModuleType


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, on the CPU accelerator when there is no GPU, without importing MLflow.

    Call it before any other import of deepspeed: the first import decides.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    import torch

    if not torch.cuda.is_available():
        # DeepSpeed would pick the CPU anyway, but print a warning on stdout of every rank first.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    block_mlflow = "mlflow" not in sys.modules
    if block_mlflow:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if block_mlflow:
            del sys.modules["mlflow"]  # importable again, for dskit's own MLflow tracker
    return deepspeed


@contextlib.contextmanager
def cpu_info_computed_once() -> Iterator[None]:
    """py-cpuinfo's `get_cpu_info()` answers from the first call while this is active (see the module doc)."""
    import cpuinfo

    original = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = functools.cache(original)  # DeepSpeed imports the name at each call
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = original
