"""Multi-rank runs without paying a process start-up per rank: ranks forked from a warm server process.

`run_ranks` takes what `support.torchrun.run_torchrun` takes and returns what it returns (a CompletedProcess with
returncode, stdout and stderr of all ranks; plus `exitcodes`, each rank's own status). Use it wherever the
launcher is not what a test is about; a test of the launcher, of what a fresh rank imports or prints, or of
signals sent through torchrun keeps the real launch (support/torchrun.py). `train` is support.torchrun.train's
counterpart; `while_running` acts on a run's ranks while they run (e.g. signals one when its output says so). How
a rank is set up and ends: support/rank_server.py; tests/e2e/test_rank_pool.py holds the pool to
torchrun.

One server per pytest session and import environment, started on first use and ended by the session fixture
`rank_pool` (tests/conftest.py). A forked rank shares the server's imported modules, so their import-time reads of
the environment: variables libraries read at import (HF_*, TORCH*, DS_*, OMP_*, ...) are part of a server's
identity, and a request whose values differ gets a server of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import rank_server
from support.rank_server import CLOSE_TIMEOUT_S, kill_group
from support.torchrun import ENV, REPO, TRAIN_SCRIPT, succeeded

# Read by torch, DeepSpeed, transformers, huggingface_hub, datasets, OpenMP or Python at import or start-up.
IMPORT_TIME_ENV = (
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "ACCELERATE_", "DS_", "DEEPSPEED_",
    "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "OMP_", "OPENBLAS_", "MKL_", "KMP_", "GOMP_", "PYTHON", "LD_", "XDG_",
    "HOME",
)  # fmt: skip
START_TIMEOUT_S = 600  # the imports, and DeepSpeed's ops built if no warm step built them


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
                [sys.executable, "-u", rank_server.__file__],
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
        while_running: Callable[[list[int], Path], None] | None = None,
    ) -> RankRun:
        """The finished run, whatever its exit status (crash tests expect failures): run_torchrun's contract.
        `while_running(pids, stdout_path)`: called in a thread once the ranks are forked (e.g. to signal a rank when
        its output says so); it must return by the time the ranks end, and what it raises is raised here."""
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
            failed: list[BaseException] = []
            watcher = None
            if while_running is not None:

                def watch() -> None:
                    try:
                        while_running(pids, out)
                    except BaseException as e:  # raised in the caller's thread, after the run
                        failed.append(e)

                watcher = threading.Thread(target=watch, daemon=True)
                watcher.start()
            try:
                exitcodes = server.receive(timeout)["exitcodes"]
            except BaseException as e:  # a timeout, or the session interrupted: no rank outlives its run
                for pid in pids:
                    kill_group(pid, signal.SIGKILL)
                with contextlib.suppress(Exception):  # the server's report of the killed ranks
                    server.receive(CLOSE_TIMEOUT_S + 30)
                if isinstance(e, TimeoutError):
                    raise subprocess.TimeoutExpired(
                        [str(script), *args], timeout, _read(out), _read(err)
                    ) from None
                raise
            if watcher is not None:
                watcher.join(5)
                if failed:
                    raise failed[0]
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


POOL = RankPool()


# The finished run, whatever its exit status (crash tests expect failures): run_torchrun's contract.
run_ranks = POOL.run


def killed_in_first_save(crashed: RankRun, rank: int = 0) -> None:
    """A crash test's run: it failed, `rank` was SIGKILLed (the injected fault), and it died in its first save
    after resuming (nothing saved)."""
    assert crashed.returncode != 0, crashed.stdout[-2000:]
    assert crashed.exitcodes[rank] == -signal.SIGKILL, crashed.exitcodes
    assert "Resumed from" in crashed.stdout and "Saved checkpoint" not in crashed.stdout, crashed.stdout[
        -2000:
    ]


def train(args: list[str], cwd: Path = REPO, **kwargs: Any) -> str:
    """A run that must succeed; its stdout and stderr together (support.torchrun.train's contract)."""
    return succeeded(run_ranks(args, cwd=cwd, **kwargs))
