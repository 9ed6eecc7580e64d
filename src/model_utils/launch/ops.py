"""DeepSpeed's JIT-built ops: the environment their builds need (the checkout's extensions dir, a
TORCH_CUDA_ARCH_LIST DeepSpeed can parse, this Python's ninja), and a first build announced with its time (one
rank builds, the others wait on torch's lock). The process group builds its comm ops here before it starts
(launch/distributed.py); the DeepSpeed engine its optimizer's; `make warm` and `dskit doctor` the same.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from model_utils import repo
from model_utils.errors import ConfigError, first_line
from model_utils.observe.log import print0

# --- DeepSpeed's JIT-built ops ------------------------------------------------------------------------------

ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"
EXTENSIONS_DIR_ENV = "TORCH_EXTENSIONS_DIR"

# A token torch accepts and DeepSpeed's op builder can parse after normalising: "9.0", "9.0a", "10.0f+PTX".
_ARCH_TOKEN = re.compile(r"^(\d+)\.(\d+)[a-z]*(\+PTX)?$")


def normalize_cuda_arch_list(raw: str) -> str:
    """TORCH_CUDA_ARCH_LIST in the form DeepSpeed 0.19.8's op builder parses: numeric X.Y[+PTX] tokens.

    Torch accepts arch-specific suffixes ("9.0a", "10.0f"); DeepSpeed's `CUDAOpBuilder.compute_capability_args`
    does `int(part)` on each dot-separated part and fails with "invalid literal for int() with base 10: '0a'".
    The suffix only unlocks arch-specific instructions (wgmma and the like) that DeepSpeed's kernels do not use,
    and plain sm_90 code runs on the same GPUs, so dropping it is safe for DeepSpeed's ops.
    """
    out: list[str] = []
    for token in raw.replace(";", " ").split():
        match = _ARCH_TOKEN.match(token)
        if match is None:
            raise ConfigError(
                f"{ARCH_LIST_ENV}={raw!r} has {token!r}, which DeepSpeed's op builder cannot parse: "
                "use numeric compute capabilities, e.g. 9.0 for H100 or 8.0 for A100"
            )
        major, minor, ptx = match.groups()
        normal = f"{major}.{minor}{ptx or ''}"
        if normal not in out:
            out.append(normal)
    return ";".join(out)


def prepare_jit_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set up the environment before DeepSpeed builds an op (deepspeed.initialize, the Makefile's warm step).

    Keeps the per-checkout extensions dir when nothing set one, and rewrites a TORCH_CUDA_ARCH_LIST that
    DeepSpeed cannot parse. Idempotent.
    """
    environ.setdefault(EXTENSIONS_DIR_ENV, str(repo.EXTENSIONS_DIR))
    use_interpreters_ninja(environ)
    raw = environ.get(ARCH_LIST_ENV)
    if raw is None or not raw.strip():
        return
    normal = normalize_cuda_arch_list(raw)
    if normal.split(";") != raw.replace(";", " ").split():  # separators alone DeepSpeed handles
        environ[ARCH_LIST_ENV] = normal
        print0(
            f"{ARCH_LIST_ENV}={raw!r} -> {normal!r} for DeepSpeed's op builds "
            "(DeepSpeed 0.19.8 cannot parse arch suffixes such as 9.0a)"
        )


def use_interpreters_ninja(environ: MutableMapping[str, str]) -> None:
    """Put the ninja installed beside this Python (the locked environment's) first on PATH. torch runs the
    first `ninja` on PATH, and ninja versions write different build logs: `make warm` (system PATH) and a job
    (.venv/bin first) found different ones, so every fresh job rebuilt the ops `make warm` had built."""
    bin_dir = str(Path(sys.executable).parent)
    if not (Path(bin_dir) / "ninja").is_file():
        return  # no ninja in this environment: whatever PATH finds, for every entry alike
    parts = [p for p in environ.get("PATH", "").split(os.pathsep) if p]
    if parts[:1] != [bin_dir]:
        environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in parts if p != bin_dir)])


# What a first build of each op takes, said before it starts: (op, device type of the ranks) -> time. Measured
# into an empty TORCH_EXTENSIONS_DIR on a 2-core CPU machine: shm comm 1m39s and cpu_adam 2m27s while other jobs
# loaded it (load 7); cpu_adam 50 s idle (docs/speed.md). The GPU builds (nvcc) are not measured here.
BUILD_TIME = {
    ("deepspeed_shm_comm", "cpu"): "about 0.5-2 min",
    ("cpu_adam", "cpu"): "about 1-3 min",
}
DEFAULT_BUILD_TIME = "a few minutes"


def extensions_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where torch's cpp_extension builds and keeps DeepSpeed's JIT ops (prepare_jit_env sets it)."""
    return Path(environ.get(EXTENSIONS_DIR_ENV) or repo.EXTENSIONS_DIR)


FIRST_USE = "first use on this machine"  # build_reason of an op not built yet

# What torch runs as `ninja` while out_of_date has DeepSpeed write an op's build file: torch checks ninja with
# `--version`, which this answers, then builds with it, which it refuses, so nothing is compiled.
_NINJA_STAND_IN = '#!/bin/sh\n[ "$1" = --version ] && exec {ninja} --version\nexit 1\n'
# A name of its own for each dry run: torch numbers a name's builds in a process (`op_v1`, ...) when they differ.
_DRY_RUNS = itertools.count()


def build_reason(builder: Any, root: Path) -> str | None:
    """Why loading `builder`'s op (as DeepSpeed and the ranks do) compiles it, None when the load takes what is
    built: FIRST_USE (no library in the extensions dir `root`: torch's cpp_extension builds op X into ROOT/X/X*.so)
    or its build out of date (out_of_date). An op installed prebuilt (DS_BUILD_OPS) is never built."""
    from deepspeed.git_version_info import installed_ops

    op = builder.name
    if installed_ops.get(op):
        return None
    if not any((root / op).glob(f"{op}*.so")):
        return FIRST_USE
    return out_of_date(builder, root / op)


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def out_of_date(builder: Any, build_dir: Path) -> str | None:
    """Why the next load of `builder`'s op, built in `build_dir`, recompiles it (ninja's first reason), None when
    it loads the library as it is.

    torch's load writes the op's build.ninja anew and runs ninja, which recompiles what changed since the last
    build: a command line (another compiler, ccache installed or gone, other flags) or a newer source. So this
    asks ninja. DeepSpeed's own load of the op, into a scratch dir where a stand-in ninja builds nothing, writes
    the build file the ranks' load would; ninja's dry run of it in `build_dir` (`ninja -n`, which writes nothing)
    says what it would compile. That load goes under another name: torch keeps a record of each name it loaded
    in a process, and the op's own must stay as the ranks' load will find it. The ninja is the one torch runs
    (PATH, after prepare_jit_env)."""
    from model_utils.launch import startup

    ninja = shutil.which("ninja")
    if ninja is None:
        return "ninja is not installed: its build cannot be checked"  # and the load fails: it needs ninja
    op = builder.name
    stand_in_name = f"{op}_dskit_dry_run_{next(_DRY_RUNS)}"
    with tempfile.TemporaryDirectory(prefix="dskit-op-dry-run-") as tmp:
        scratch = Path(tmp)
        stand_in = scratch / "bin" / "ninja"
        stand_in.parent.mkdir()
        stand_in.write_text(_NINJA_STAND_IN.format(ninja=shlex.quote(ninja)))
        stand_in.chmod(0o755)
        scratch_env = {
            "PATH": f"{stand_in.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            EXTENSIONS_DIR_ENV: tmp,
        }
        error: Exception | None = None
        builder.name = stand_in_name
        try:
            with _environ(scratch_env), startup.cpu_info_computed_once(build_dir.parent):
                builder.load(verbose=False)
        # The stand-in's refusal once the build file is written; before it, the load's own failure.
        except Exception as e:
            error = e
        finally:
            builder.name = op
        written = scratch / stand_in_name / "build.ninja"
        if not written.is_file():
            return f"its build cannot be checked: {first_line(error) if error else 'no build file written'}"
        plan = scratch / "build.ninja"
        plan.write_text(written.read_text().replace(stand_in_name, op))
        proc = subprocess.run(
            [ninja, "-n", "-d", "explain", "-C", str(build_dir), "-f", str(plan)],
            capture_output=True,
            text=True,
            check=False,
        )
    output = proc.stdout + proc.stderr
    if proc.returncode == 0 and "ninja: no work to do." in output:
        return None
    reasons = re.findall(r"^ninja (?:explain|error): (.+)$", output, re.MULTILINE)
    return f"out of date since its last build, ninja: {reasons[0] if reasons else output.strip()[-200:]}"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _took(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def build_ops(
    builder_names: Iterable[str], device_type: str, create_builder: Callable[[str], Any] | None = None
) -> None:
    """Build the DeepSpeed ops a run needs that are not built yet or whose build is out of date (build_reason),
    before DeepSpeed loads them itself, each one announced with why, its expected time and followed by its
    result (rank 0's lines: every rank calls load(), the first to take torch's file lock in the op's build dir
    builds it and the others wait on that lock). A build that fails is a ConfigError naming the op. Ops whose
    build holds are left for DeepSpeed to load.

    `create_builder`: builder class name -> DeepSpeed op builder (default: the accelerator's), None or
    DeepSpeed's NotImplementedBuilder where this accelerator has no such op.
    """
    if create_builder is None:
        from model_utils.launch import startup

        startup.import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        create_builder = get_accelerator().create_op_builder
    prepare_jit_env()
    root = extensions_dir()
    for class_name in builder_names:
        builder = create_builder(class_name)
        if builder is None or type(builder).__name__ == "NotImplementedBuilder":
            continue
        why = build_reason(builder, root)
        if why is None:
            continue
        op = builder.name
        expected = BUILD_TIME.get((op, device_type), DEFAULT_BUILD_TIME)
        print0(
            f"{'Building' if why == FIRST_USE else 'Rebuilding'} DeepSpeed op {op} ({why}; {expected} on "
            f"{device_type.upper()}; cached in {_shown(root)}; the other ranks wait for it) ..."
        )
        started = time.monotonic()
        try:
            builder.load(verbose=False)  # torch's compiler lines: only when the build fails (below)
        # A build fails in the compiler, ninja, a missing header or CUDA: any of them is "did not build here".
        except Exception as e:
            took = _took(time.monotonic() - started)
            details = root / op / "build-error.log"
            details.parent.mkdir(parents=True, exist_ok=True)
            details.write_text(f"{type(e).__name__}: {e}\n")
            raise ConfigError(
                f"DeepSpeed op {op} did not build ({took}): {first_line(e)} (full output: {_shown(details)}): "
                "install what it needs (ninja and a C++ compiler; the CUDA toolkit for GPU ops), see "
                "`dskit doctor` and `ds_report`"
            ) from e
        print0(f"Built DeepSpeed op {op} in {_took(time.monotonic() - started)}")


def warm_deepspeed_ops(names: Iterable[str]) -> None:
    """Build (or load from the extensions dir) DeepSpeed's ops once, outside any timed run."""
    from model_utils.launch import startup

    startup.import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name in names:
        if accelerator.create_op_builder(name) is None:
            raise ConfigError(f"DeepSpeed has no op {name!r} for the {accelerator.device_name()} accelerator")
    build_ops(names, "cuda" if accelerator.device_name() == "cuda" else "cpu")
    print(f"DeepSpeed ops ready in {os.environ[EXTENSIONS_DIR_ENV]}")


# The DeepSpeed op builders the process group loads, by the ranks' device type: distributed.py starts it
# with deepspeed.init_distributed under every engine; CPU ranks' shared-memory collectives (build_shm_op in
# deepspeed/comm/torch.py), nothing on GPUs (NCCL).
COMM_OPS: dict[str, tuple[str, ...]] = {"cpu": ("ShareMemCommBuilder",)}


def comm_ops(device_type: str) -> tuple[str, ...]:
    return COMM_OPS.get(device_type, ())
