"""The rank pool's server (support/rank_pool.py starts it as a script): one process that has done a rank's
start-up and forks each run's ranks, set up as torchrun sets up its workers.

Start-up, once: what a training rank imports, in the order src/train_deepspeed.py imports it (DeepSpeed and
transformers through model_utils.launch.startup), plus what ranks import while they run (the model, tokenizers,
both engines, peft); DeepSpeed's CPU ops loaded; py-cpuinfo asked once. Then no thread runs (a process with
threads must not fork; numpy's OpenBLAS is held to one thread by the client) and CUDA is not initialised.

Per run, each rank: a session of its own; torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, ROLE_*, MASTER_ADDR=localhost and a free MASTER_PORT, TORCHELASTIC_*, OMP_NUM_THREADS=1 with several
ranks unless set, and torch's threads to match) over the request's; its cwd and argv; stdout and stderr shared by
all ranks (as torchrun's are), unbuffered as `python -u`. It runs the script as __main__ and exits as the
interpreter does (model_utils.launch.process_exit: non-daemon threads joined, atexit handlers, stdio flushed; the status of SystemExit, or 1 after
printing an uncaught exception) without tearing down the modules it shares with the server. When a rank fails,
the others get SIGTERM and, 30 s later, SIGKILL (torchrun's close).

Protocol on stdin/stdout, JSON lines: {"ready": pid} once; per request (script, args, nproc, cwd, env, stdout and
stderr paths) {"pids": [...]} when the ranks are forked, then {"exitcodes": [...]}. EOF on stdin ends it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any, NoReturn

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "src" / "train_deepspeed.py"
# torchrun's close(): SIGTERM to the remaining workers, SIGKILL after this many seconds.
CLOSE_TIMEOUT_S = 30
POLL_S = 0.02
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
DEFAULT_THREADS = 1  # torch's intra-op threads in a fresh process of this environment (set once imported)


def kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pid, sig)


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
    # resolver.prepare's, with chat templates renderable: the pool serves conversation runs too (what a rank
    # imports by default: tests/e2e/test_lean_rank.py, in processes of its own).
    startup.import_transformers(chat_templates=True)
    for name in RANK_IMPORTS:
        importlib.import_module(name)
    # Start-up work whose result cannot differ between processes on this machine: DeepSpeed's CPU ops loaded
    # (the .so files the Makefile's warm step built), and py-cpuinfo's answer (each rank's CPU Adam asks for it:
    # a Python subprocess, ~1 s; model_utils.launch.startup caches it within a rank).
    import cpuinfo

    from model_utils.launch import ops

    ops.warm_deepspeed_ops(["ShareMemCommBuilder", "CPUAdamBuilder"])
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


def serve() -> None:
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
        if pid == 0:
            _become_rank(req, rank, port, out, err, control)  # never returns
        pids.append(pid)
    os.close(out)
    os.close(err)
    reply({"pids": pids})
    reply({"exitcodes": _wait(pids)})


def _wait(pids: list[int]) -> list[int]:
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
                    kill_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
        elif deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    kill_group(pid, signal.SIGKILL)
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

    from model_utils.launch import process_exit

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
    process_exit.exit_now(status)  # without tearing down the heap it shares with the server


def _exit_status(code: object) -> int:
    """The exit status of SystemExit(code), as the interpreter makes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve()
