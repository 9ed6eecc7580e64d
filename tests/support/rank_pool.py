"""Multi-rank runs without paying a process start-up per rank: ranks forked from a warm server process.

`run_ranks` takes what `support.torchrun.run_torchrun` takes and returns what it returns (a CompletedProcess with
returncode, stdout and stderr of all ranks; plus `exitcodes`, each rank's own status). Use it wherever the
launcher is not what a test is about; a test of the launcher, of what a fresh rank imports or prints, or of
signals sent through torchrun keeps the real launch (support/torchrun.py).

The server (this file run as a script, one per pytest session and import environment, started on first use)
imports what a training rank imports, in the order src/train_deepspeed.py imports it (DeepSpeed and transformers
through model_utils.launch.startup), plus what ranks import while they run (the model, tokenizers, both engines,
peft), loads DeepSpeed's CPU ops and asks py-cpuinfo once; then it starts no thread. Per run it forks N ranks,
each set up as torchrun sets up a worker: a session of its own, torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR=localhost and a free MASTER_PORT, TORCHELASTIC_*,
OMP_NUM_THREADS=1 with several ranks unless set, and torch's threads to match) over the request's, the request's
cwd and argv, stdout and stderr shared by all ranks (as torchrun's are), unbuffered as `python -u`. It runs the
script as __main__ and exits as the interpreter does (non-daemon threads joined, atexit handlers, stdio flushed,
the exit status of SystemExit or 1 after printing an uncaught exception), without tearing down the modules it
shares with the server. When a rank fails the others get SIGTERM and, 30 s later, SIGKILL (torchrun's close).
The returncode is 0 when every rank exited 0 and 1 otherwise (torchrun's). tests/e2e/test_rank_pool.py holds
the pool to torchrun.

What a forked rank shares with the server and a fresh process would not: modules already imported, so their
import-time reads of the environment. Environment variables such libraries read at import (HF_*, TORCH*, DS_*,
OMP_*, ...) are therefore part of the server's identity: a request whose values differ gets another server.
numpy's OpenBLAS runs one thread in every rank (a fresh single rank would start one per core).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO / "src" / "train_deepspeed.py"
# Offline and on CPU, whatever the developer's shell says (as support/torchrun.py's ENV).
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# Read by torch, DeepSpeed, transformers, huggingface_hub, datasets, OpenMP or Python at import or start-up.
IMPORT_TIME_ENV = (
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "ACCELERATE_", "DS_", "DEEPSPEED_",
    "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "OMP_", "OPENBLAS_", "MKL_", "KMP_", "GOMP_", "PYTHON", "LD_", "XDG_",
    "HOME",
)  # fmt: skip
# torchrun's close(): SIGTERM to the remaining workers, SIGKILL after this many seconds.
CLOSE_TIMEOUT_S = 30
POLL_S = 0.02
START_TIMEOUT_S = 600
# What ranks import while they run (models, tokenizers, engines, optimizer ops, LoRA): once here, not per rank.
RANK_IMPORTS = (
    "model_utils.engines.deepspeed_engine",
    "model_utils.engines.fsdp_engine",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.tokenization_utils_tokenizers",
    "deepspeed.runtime.engine",
    "deepspeed.ops.adam",
    "peft",
)
DEFAULT_THREADS = 1  # the server's: torch's intra-op threads in a fresh process (set once imported)


class RankRun(subprocess.CompletedProcess):
    """A finished run: returncode as torchrun's (0 or 1), stdout and stderr of all ranks, and each rank's exit
    status (negative: killed by that signal)."""

    def __init__(self, args: list[str], exitcodes: list[int], stdout: str, stderr: str) -> None:
        super().__init__(args, 0 if all(code == 0 for code in exitcodes) else 1, stdout, stderr)
        self.exitcodes = exitcodes


def import_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)))


@dataclass
class Server:
    """The client's handle on one server process."""

    proc: subprocess.Popen
    log: Path
    _buffer: bytes = field(default=b"")

    @classmethod
    def start(cls, env: dict[str, str], log_dir: Path) -> Server:
        log = log_dir / f"rank-server-{len(list(log_dir.iterdir()))}.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-u", __file__],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        server = cls(proc, log)
        server.receive(START_TIMEOUT_S)  # {"ready": pid} once the imports are done
        return server

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float | None) -> dict[str, Any]:
        """The server's next message; TimeoutError when none comes within `timeout` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                tail = self.log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the rank server exited ({self.proc.wait()}); its log ends:\n{tail}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the server ends at EOF
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RankPool:
    """One server per import environment, started on first use; `close` ends them (the session fixture)."""

    def __init__(self) -> None:
        self._servers: dict[tuple[tuple[str, str], ...], Server] = {}
        self._log_dir: Path | None = None

    def server(self, env: dict[str, str]) -> Server:
        key = import_env(env)
        if key not in self._servers:
            if self._log_dir is None:
                self._log_dir = Path(tempfile.mkdtemp(prefix="rank-pool-"))
            # The request's import-time environment over the default one; the rest is set per rank. OpenBLAS
            # (numpy's) would start its thread pool at import, and a process with threads must not fork: one
            # BLAS thread, as in every rank of a multi-rank run (torchrun's OMP_NUM_THREADS=1).
            # And torch.cuda.is_available() through NVML, which leaves CUDA uninitialised (a forked rank could not
            # use it otherwise); the ranks get the request's environment, so they ask CUDA itself.
            server_env = {k: v for k, v in ENV.items() if not k.startswith(IMPORT_TIME_ENV)}
            server_env.update(OPENBLAS_NUM_THREADS="1", PYTORCH_NVML_BASED_CUDA_CHECK="1")
            self._servers[key] = Server.start({**server_env, **dict(key)}, self._log_dir)
        return self._servers[key]

    def run(
        self,
        args: list[str],
        *,
        script: Path | str = TRAIN_SCRIPT,
        nproc: int = 2,
        cwd: Path = REPO,
        env: dict[str, str] | None = None,
        timeout: int = 600,
    ) -> RankRun:
        env = dict(env or ENV)
        server = self.server(env)
        with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            server.send(
                {
                    "script": str(Path(script).resolve()),
                    "args": [str(a) for a in args],
                    "nproc": nproc,
                    "cwd": str(Path(cwd).resolve()),
                    "env": env,
                    "stdout": str(out),
                    "stderr": str(err),
                }
            )
            pids = server.receive(60)["pids"]
            try:
                exitcodes = server.receive(timeout)["exitcodes"]
            except BaseException as e:  # a timeout, or the session interrupted: no rank outlives its run
                for pid in pids:
                    _kill_group(pid, signal.SIGKILL)
                with contextlib.suppress(Exception):  # the server's report of the killed ranks
                    server.receive(CLOSE_TIMEOUT_S + 30)
                if isinstance(e, TimeoutError):
                    raise subprocess.TimeoutExpired(
                        [str(script), *args], timeout, _read(out), _read(err)
                    ) from None
                raise
            return RankRun([str(script), *map(str, args)], exitcodes, _read(out), _read(err))

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None


def _read(path: Path) -> str:
    return path.read_bytes().decode(errors="replace") if path.exists() else ""


def _kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pid, sig)


POOL = RankPool()


def run_ranks(
    args: list[str],
    *,
    script: Path | str = TRAIN_SCRIPT,
    nproc: int = 2,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout: int = 600,
) -> RankRun:
    """The finished run, whatever its exit status (crash tests expect failures): run_torchrun's contract."""
    return POOL.run(args, script=script, nproc=nproc, cwd=cwd, env=env, timeout=timeout)


def train(args: list[str], cwd: Path = REPO, **kwargs: Any) -> str:
    """A run that must succeed; its stdout and stderr together (support.torchrun.train's contract)."""
    proc = run_ranks(args, cwd=cwd, **kwargs)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


# --- the server -----------------------------------------------------------------------------------------


def _warm_imports() -> None:
    """What a training rank imports before its first step, in the order a rank of src/train_deepspeed.py does."""
    import functools
    import importlib
    import threading

    sys.path[0] = str(TRAIN_SCRIPT.parent)  # a rank's sys.path[0]: its script's dir
    for name in (  # the script's imports, then main()'s
        "model_utils.config.arguments",
        "model_utils.errors",
        "model_utils.observe.log",
        "model_utils.launch.distributed",
        "model_utils.loop.trainer",
        "model_utils.resolve.resolver",
    ):
        importlib.import_module(name)
    from model_utils.launch import startup

    startup.import_deepspeed()  # distributed.init_distributed's import
    startup.import_transformers()  # resolver.prepare's
    for name in RANK_IMPORTS:
        importlib.import_module(name)
    # Start-up work whose result cannot differ between processes on this machine: DeepSpeed's CPU ops loaded
    # (the .so files the Makefile's warm step built), and py-cpuinfo's answer (each rank's CPU Adam asks for it:
    # a Python subprocess, ~1 s; model_utils.launch.startup caches it within a rank).
    import cpuinfo

    from model_utils.model import kernels

    kernels.warm_deepspeed_ops(["ShareMemCommBuilder", "CPUAdamBuilder"])
    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info()
    import torch

    # A fresh process's torch RNG (its fixed default seed), whatever the imports drew.
    torch.default_generator.set_state(torch.Generator().get_state())
    global DEFAULT_THREADS
    DEFAULT_THREADS = torch.get_num_threads()  # a fresh process's, in this environment
    if torch.cuda.is_initialized():
        raise RuntimeError("the rank server initialised CUDA: a forked rank could not use it")
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["main"]
    if threading.active_count() != 1 or len(threads) != 1:
        raise RuntimeError(f"the rank server started threads before forking ({len(threads)} tasks)")


def _serve() -> None:
    # The control channel on private fds; fds 0 and 1 point elsewhere so that nothing printed can corrupt it.
    control_in, control_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    _warm_imports()
    # What the imports allocated stays as it is: no rank's garbage collector walks (and so copies) it.
    gc.collect()
    gc.freeze()
    reader: IO[bytes] = os.fdopen(control_in, "rb")
    writer: IO[bytes] = os.fdopen(control_out, "wb")

    def reply(message: dict[str, Any]) -> None:
        writer.write(json.dumps(message).encode() + b"\n")
        writer.flush()

    reply({"ready": os.getpid()})
    for line in reader:
        _run(json.loads(line), reply, (reader, writer))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))  # free on every address, as torchrun's standalone rendezvous picks it
        return sock.getsockname()[1]


def _run(req: dict[str, Any], reply: Any, control: tuple[IO[bytes], IO[bytes]]) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    out, err = os.open(req["stdout"], flags, 0o644), os.open(req["stderr"], flags, 0o644)
    port = _free_port()
    pids = []
    for rank in range(req["nproc"]):
        pid = os.fork()
        if (
            pid == 0
        ):  # never returns: the rank ends through SystemExit or an uncaught exception, as a script does
            _become_rank(req, rank, port, out, err, control)
        pids.append(pid)
    os.close(out)
    os.close(err)
    reply({"pids": pids})
    reply({"exitcodes": _wait(pids)})


def _wait(pids: list[int]) -> list[int | None]:
    """Each rank's exit status; once one fails, torchrun's close() for the others."""
    codes: dict[int, int] = {}
    deadline = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        if deadline is None and any(code != 0 for code in codes.values()):
            for pid in pids:
                if pid not in codes:
                    _kill_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
        elif deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    _kill_group(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(POLL_S)
    return [codes[pid] for pid in pids]


def _become_rank(
    req: dict[str, Any], rank: int, port: int, out: int, err: int, control: tuple[IO[bytes], IO[bytes]]
) -> NoReturn:
    import io
    import random
    import runpy

    import numpy as np
    import torch

    os.setsid()  # torchrun starts each worker in a session of its own
    for stream in control:
        stream.close()  # this process's copies only (through the file objects: no fd closed twice later)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    # `python -u`: unbuffered binary layer, text written through at once.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    nproc = req["nproc"]
    env = dict(req["env"])
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default for several workers
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
        ROLE_NAME="default", MASTER_ADDR="localhost", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=f"rank-pool-{port}",
        TORCHELASTIC_USE_AGENT_STORE="False", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
    )  # fmt: skip
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", DEFAULT_THREADS)))
    random.seed()  # a fresh process's unseeded generators differ from run to run
    np.random.seed()
    os.chdir(req["cwd"])
    script = req["script"]
    sys.argv = [script, *req["args"]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports an uncaught exception
        status = 1
    _exit(status)


def _exit_status(code: object) -> int:
    """The exit status of SystemExit(code), as the interpreter makes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(status: int) -> NoReturn:
    """The interpreter's exit without its teardown of every module: what a rank observes of its end (its
    non-daemon threads joined, atexit handlers, logging flushed, stdio flushed) happens; freeing the heap it
    shares with the server (seconds of copy-on-write per rank, and nothing a test can see) does not."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    _serve()
