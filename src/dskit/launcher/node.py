"""The node a launch starts its ranks on: what the run's Python sees, how many ranks, with which CUDA toolkit, how
many threads each, and (train.sbatch) over which network. It prints one line for the script to read,

    GPUS RANKS THREADS CUDA_HOME [NETWORK]      e.g. `8 8 12 /usr/local/cuda-12.8 efa`, `0 2 4 - tcp`

and says each choice in the log. The script then sets the ranks' environment from it.

    python3 -m dskit.launcher.node [--efa auto|on|off] PYTHON...

PYTHON is the run's interpreter (words: it may start with an srun into a container image); it is asked first
(`dskit.env.python_env probe`), which stops the launch in one line if it lacks a package the kit needs. Every GPU
of the node, or CPU_RANKS gloo ranks when it has none (or GPUS_PER_NODE is 0); the CUDA toolkit (for DeepSpeed's
JIT ops) from /usr/local/cuda-$CUDA_VERSION (a patch release such as NVIDIA's images export, 13.0.2, finds the
toolkit of its minor release, /usr/local/cuda-13.0, where no cuda-13.0.2 exists), none for CPU ranks; OMP_NUM_THREADS as the caller set it, else the
cores this process may use split between the ranks, at least 1 (torchrun would set 1 and print a banner saying
so). With --efa: EFA only where an EFA device exists; `on` without one is an error, never a silent fall back to
sockets.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dskit.launcher import check, main, say
from model_utils.errors import CommandParser, ConfigError
from model_utils.launch import health_gate

CUDA_ROOT = Path("/usr/local")
EFA_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Node:
    gpus: int  # what the run's torch sees
    ranks: int
    threads: str  # OMP_NUM_THREADS, as the caller may have set it (a list such as 4,2 is OpenMP's too)
    cuda_home: Path | None  # None: CPU ranks


def _count(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name, "")
    if not text.isdigit():
        raise ConfigError(f"{name}={text}: use a whole number (0 or more)")
    return int(text)


def toolkit_home(version: str, root: Path = CUDA_ROOT) -> Path | None:
    """Where the CUDA toolkit of CUDA_VERSION is installed, or None.

    NVIDIA's CUDA images export CUDA_VERSION with the patch release (13.0.2) and install at cuda-13.0, so a patch
    release that has no directory of its own finds the toolkit of its minor release."""
    candidates = [root / f"cuda-{version}"]
    parts = version.split(".")
    if len(parts) == 3:
        candidates.append(root / f"cuda-{parts[0]}.{parts[1]}")
    return next((home for home in candidates if home.is_dir()), None)


def choose(gpus: int, environ: Mapping[str, str], cores: int, cuda_root: Path = CUDA_ROOT) -> Node:
    """The ranks of a node whose torch sees `gpus` GPUs, as the launch settings in `environ` ask."""
    host = socket.gethostname()
    wanted = _count(environ, "GPUS_PER_NODE")
    cuda_home = None
    if gpus > 0 and wanted > 0:
        if gpus != wanted:
            say(f"WARNING: {host} has {gpus} GPUs, the launch values say {wanted}: using all {gpus}")
        version = environ.get("CUDA_VERSION", "")
        cuda_home = toolkit_home(version, cuda_root)
        if cuda_home is None:
            installed = " ".join(sorted(p.name for p in cuda_root.glob("cuda-*"))) or "none"
            raise ConfigError(
                f"CUDA toolkit {version} not found at {cuda_root / f'cuda-{version}'} on {host}: install it there "
                f"or set CUDA_VERSION to an installed one ({installed})"
            )
        patch = "" if cuda_home.name == f"cuda-{version}" else f" (CUDA_VERSION={version}: its minor release)"
        say(f"CUDA toolkit: {cuda_home}{patch}")
        ranks = gpus
        say(f"Ranks per node: {ranks} (GPUs)")
    else:
        ranks = _count(environ, "CPU_RANKS")
        if ranks == 0:
            raise ConfigError(f"{host} has no GPU and CPU_RANKS is 0: set CPU_RANKS or use GPU nodes")
        say(f"Ranks per node: {ranks} (CPU, no GPU on {host})")
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads:
        say(f"Threads per rank: OMP_NUM_THREADS={threads} (from the environment)")
    else:
        threads = str(max(1, cores // ranks))
        say(f"Threads per rank: OMP_NUM_THREADS={threads} ({cores} cores / {ranks} ranks)")
    return Node(gpus, ranks, threads, cuda_home)


def network(mode: str, present: bool) -> str:
    """efa or tcp: what NCCL and gloo go over between the nodes."""
    host = socket.gethostname()
    if mode not in EFA_MODES:
        raise ConfigError(f"EFA={mode}: use {', '.join(EFA_MODES[:-1])} or {EFA_MODES[-1]}")
    if mode == "off":
        say("Network: EFA off (efa=off): NCCL/gloo use sockets (TCP)")
        return "tcp"
    if present:
        say(f"Network: EFA found on {host}: FI_PROVIDER=efa")
        return "efa"
    if mode == "on":
        raise ConfigError(
            f"efa=on but {host} has no EFA device (no {health_gate.INFINIBAND_SYSFS}/*/device/driver -> efa): use EFA-enabled "
            "instances, or EFA=auto / EFA=off to train over TCP sockets"
        )
    say(f"Network: no EFA device on {host}: NCCL/gloo use sockets (TCP)")
    return "tcp"


def probe(python: list[str]) -> int:
    """The GPUs the run's torch sees, once the interpreter has everything the kit needs (its one line if not)."""
    gpus, python_version, torch, torch_cuda, deepspeed = check(
        [*python, "-m", "dskit.env.python_env", "probe"], capture=True
    ).split()
    say(f"Versions: python {python_version}, torch {torch} (CUDA {torch_cuda}), deepspeed {deepspeed}")
    return int(gpus)


def _main(argv: list[str]) -> int:
    parser = CommandParser(prog="python3 -m dskit.launcher.node")
    parser.add_argument("--efa", help="auto, on or off: the network between nodes (train.sbatch)")
    parser.add_argument("python", nargs=argparse.REMAINDER, help="the run's interpreter, as words")
    args = parser.parse_args(argv)
    node = choose(probe(args.python), os.environ, len(os.sched_getaffinity(0)))
    words = [node.gpus, node.ranks, node.threads, node.cuda_home or "-"]
    if args.efa is not None:
        words.append(network(args.efa, bool(health_gate.efa_devices())))
    print(*words)
    return 0


if __name__ == "__main__":
    main(_main)
