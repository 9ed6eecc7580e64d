"""The software environment a run needs: the project's uv environment against uv.lock (`uv sync --check`,
offline, changing nothing), and DeepSpeed's JIT ops (built already, or buildable here: ninja, a C++ compiler,
nvcc for the GPU ops).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dskit.env import lock_stamp, wheelhouse
from dskit.env.uv import uv_command
from model_utils.errors import first_line
from model_utils.launch import startup
from model_utils.repo import REPO_ROOT

from .context import LaunchContext, _run
from .report import Result, Status

# --- 1. the uv environment ------------------------------------------------------------------------------


def check_uv(project: Path = REPO_ROOT, python_prefix: Path = Path(sys.prefix)) -> Result:
    """`uv sync --frozen --check --offline`: compares the environment with uv.lock, changes nothing, no network."""
    name = "uv environment"
    env_dir = Path(os.environ.get("UV_PROJECT_ENVIRONMENT") or ".venv")
    env_dir = env_dir if env_dir.is_absolute() else project / env_dir
    if not (project / "uv.lock").is_file():
        return Result(name, Status.FAIL, f"no uv.lock in {project}", "restore it: git checkout uv.lock")
    if python_prefix.resolve() != env_dir.resolve():
        return Result(
            name,
            Status.SKIP,
            f"this python ({python_prefix}) is not the project env {env_dir} (a container image?): "
            "nothing to compare with uv.lock",
        )
    if (env_dir / wheelhouse.STAMP).is_file():  # made offline from `make wheelhouse`: uv is not used there
        stamp = json.loads((env_dir / wheelhouse.STAMP).read_text())
        if stamp.get("lock_sha256") == wheelhouse.lock_digest(project):
            return Result(name, Status.PASS, f"{env_dir} installed from a wheelhouse of this uv.lock")
        return Result(
            name,
            Status.WARN,
            f"{env_dir} was installed from a wheelhouse of another uv.lock",
            "launch once with WHEELHOUSE=DIR built from this checkout (make wheelhouse)",
        )
    synced = lock_stamp.synced_at(project, env_dir)
    if synced is not None:  # unchanged since a sync of this lock: uv would take a second to find the same
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(synced))
        return Result(name, Status.PASS, f"{env_dir} matches uv.lock (unchanged since its uv sync at {when})")
    uv = uv_command()
    if uv is None:
        return Result(
            name,
            Status.WARN,
            "uv not found (neither `uv` nor `python3 -m uv`): cannot compare .venv with uv.lock",
            "python3 -m pip install uv (the launchers do this on first use)",
        )
    env = {**os.environ, "UV_NO_PROGRESS": "1"}
    base = [*uv, "sync", "--frozen", "--offline", "--project", str(project)]
    try:
        proc = _run([*base, "--check"], env=env, cwd=project)
        if proc.returncode == 2 and "--check" in proc.stderr:  # a uv older than `sync --check`
            proc = _run([*base, "--dry-run"], env=env, cwd=project)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Result(name, Status.WARN, f"uv sync --check did not finish ({first_line(e)})", "")
    output = proc.stdout + proc.stderr
    changes = [line.strip() for line in output.splitlines() if re.match(r"\s*[-+~] \S", line)]
    in_sync = proc.returncode == 0 and not changes
    if in_sync:
        checked = re.search(r"Checked (\d+) packages?", output)
        count = f" ({checked.group(1)} packages)" if checked else ""
        return Result(name, Status.PASS, f"{env_dir} matches uv.lock{count}")
    if changes or "outdated" in output or "Would " in output:
        listed = ", ".join(changes[:4]) + (f" and {len(changes) - 4} more" if len(changes) > 4 else "")
        missing_env = "Would create" in output
        what = (
            "does not exist"
            if missing_env
            else f"differs from uv.lock: {listed or first_line(RuntimeError(output))}"
        )
        return Result(
            name,
            Status.FAIL,
            f"{env_dir} {what}",
            f"cd {project} && uv sync --frozen (the launchers run it on the batch host before training)",
        )
    return Result(name, Status.WARN, f"uv sync --check failed: {first_line(RuntimeError(output))}", "")


# --- 8. DeepSpeed's ops ---------------------------------------------------------------------------------


def _extensions_root(ctx: LaunchContext) -> Path:
    """TORCH_EXTENSIONS_DIR, else torch's default per-python/CUDA directory."""
    if ctx.extensions_dir is not None:
        return ctx.extensions_dir
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accel}"


def check_ops(
    ctx: LaunchContext, ops: tuple[str, ...], create_builder: Callable[[str], Any] | None = None
) -> Result:
    """The ops this run JIT-builds (`ops`: builder class names, engines.jit_ops of the resolved run): built, as
    the ranks' load will take them (launch/ops.py's build_reason: not out of date), or buildable here.

    `create_builder`: builder class name -> op builder (default: the accelerator's, as launch/ops.py's build_ops)."""
    startup.import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    from model_utils.launch import ops as op_builds

    name = "DeepSpeed ops"
    accelerator = get_accelerator()
    if not ops:
        return Result(name, Status.PASS, "this run builds none (torch's optimizer and collectives)")
    op_builds.prepare_jit_env()  # the ranks' ninja and TORCH_CUDA_ARCH_LIST: the build file theirs would write
    root = _extensions_root(ctx)
    built: list[str] = []
    to_build: list[tuple[str, str]] = []  # (op, why the ranks' load compiles it)
    incompatible: list[str] = []
    for class_name in ops:
        builder = (create_builder or accelerator.create_op_builder)(class_name)
        if builder is None or type(builder).__name__ == "NotImplementedBuilder":
            continue
        op = builder.name
        why = op_builds.build_reason(builder, root)
        if why is None:
            built.append(op)
            continue
        try:
            compatible = builder.is_compatible(verbose=False)
            reason = getattr(builder, "error_log", None) or "is_compatible() is False"
        # Builders probe compilers and CUDA in many ways: any exception means "cannot build here".
        except Exception as e:
            compatible, reason = False, first_line(e)
        if compatible:
            to_build.append((op, why))
        else:
            incompatible.append(f"{op} ({reason})")
    stale = any(why != op_builds.FIRST_USE for _, why in to_build)  # built, but the ranks' load recompiles it
    have = (
        f"built in {root}: {', '.join(built)}"
        if built
        else f"none {'ready' if stale else 'built yet'} in {root}"
    )
    if incompatible:
        return Result(
            name,
            Status.FAIL,
            f"{have}; cannot build {', '.join(incompatible)}",
            "install what the op needs (a C++ compiler; for GPU ops the CUDA toolkit), see `ds_report`",
        )
    if not to_build:
        return Result(name, Status.PASS, have)
    listed = ", ".join(op if why == op_builds.FIRST_USE else f"{op} ({why})" for op, why in to_build)
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    missing = [] if is_ninja_available() else ["ninja"]
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler})")
    if any(op.startswith("fused_") for op, _ in to_build) and accelerator.device_name() == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or not os.access(Path(CUDA_HOME) / "bin" / "nvcc", os.X_OK):
            missing.append(f"nvcc (CUDA_HOME={CUDA_HOME})")
    if missing:
        return Result(
            name,
            Status.FAIL,
            f"{have}; {listed} must be built, but {', '.join(missing)} not found",
            "install them (e.g. apt-get install ninja-build g++; the CUDA toolkit for nvcc), or build the ops "
            f"once on a node that has them: they are kept in {root}",
        )
    return Result(
        name,
        Status.PASS,
        f"{have}; the ranks will build {listed} as they start (the first rank says so, with the "
        f"time each takes; ninja and {compiler} found)",
    )
