"""The entry of a SageMaker training job (`dskit sagemaker submit` makes the job run it on every instance).

    python -m dskit.sagemaker.entry          # from the kit's source root, inside the job

It reads SageMaker's contract under DSKIT_SM_BASE (default /opt/ml; any dir runs the same contract outside
SageMaker): input/config/resourceconfig.json (hosts, this host, network interface), input/config/
hyperparameters.json (the training flags), input/config/inputdataconfig.json and input/data/<channel>/, with the
training toolkit's SM_HOSTS, SM_CURRENT_HOST, SM_NUM_GPUS, SM_NUM_CPUS, SM_CHANNEL_<NAME> and SM_HPS winning
where they are set (our job replaces the image's entrypoint, so the toolkit does not set them there). Then:

* torchrun on this instance: node rank = this host's index in the host list, the first host the master on a
  fixed port; --model, --dataset and --validation_dataset are the model, train and validation channels,
  --checkpoint_dir is checkpoints/ (SageMaker syncs it with the job's CheckpointConfig S3 URI), the data cache,
  TMPDIR and the Hugging Face caches are on the ML storage volume (the root volume is small);
* SIGTERM (StopTrainingJob, a spot interruption, the max runtime) is turned into SIGUSR1 for every rank on this
  instance: the ranks' save-and-stop path of SLURM's preemption. It is not passed to torchrun, whose own SIGTERM
  handling kills the ranks 30 s later and fails the run;
* after a finished run the first host exports the newest verified checkpoint as a Hugging Face model into
  model/ (SageMaker uploads it as model.tar.gz; a mount point there: staged on the ML volume, moved into it);
  on a failure the reason goes to output/failure: the kit's own `error:` line (a rank's, through
  DSKIT_ERROR_FILE, or the entry's), or for a crash a generic line with the last lines of the ranks' output.

Instances do not share a filesystem: ranks on other hosts leave their checkpoint files in `.staging-<tag>` (only
the first host commits a tag). SageMaker uploads every instance's checkpoints/ to one S3 prefix and downloads the
union to every instance of a restarted job; `merge_host_shards` then moves those files into their committed tag,
and demotes a tag that still lacks a rank's files, so resume never picks a checkpoint that cannot load.

Module level imports the standard library only: with setup `uv` this runs first under the image's Python,
installs the locked environment and re-executes itself in it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from dskit.sagemaker.job_contract import DEFAULT_BASE, OWNED_FLAGS, READABLE_INPUT_MODES
from model_utils import launch_env
from model_utils.errors import ConfigError
from model_utils.launch import preemption
from model_utils.observe import redact, step_line
from model_utils.repo import REPO_ROOT as REPO


class Stopped(Exception):
    """SIGTERM where there is nothing to save: before the ranks started, or during the export."""


class StopState:
    """The job's one SIGTERM handler, installed before anything else runs (the job's bootstrap shell, PID 1, holds
    a stop until this process handles SIGTERM, then hands it on; run as PID 1 itself, the entry would get only the
    signals it handles, and StopTrainingJob's SIGKILL follows 120 s later). Where the
    stop lands decides what it does: before the ranks start and during the export it raises Stopped (nothing to
    save: main exits 143); inside `deferred` (the host-shard merge) it waits for the block's end; while the ranks
    run, `on_stop` (StopForwarder) asks them to save."""

    def __init__(self) -> None:
        self.received_at: float | None = None
        self.moment = "before set-up"
        self.on_stop: Callable[[], None] | None = None
        self._holding = True  # until main can turn Stopped into exit 143

    def install(self) -> None:
        """main's first step: from here a stop raises Stopped (or is forwarded)."""
        signal.signal(signal.SIGTERM, self._handle)
        self._holding = False
        # A SIGTERM that came while the previous image of this process re-executed itself was held blocked across
        # the exec (an unhandled one would be dropped): it lands here, now that the handler is in place.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if self.received_at is not None:
            raise Stopped

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received_at = self.received_at or time.monotonic()
        if self.on_stop is not None:
            self.on_stop()
        elif not self._holding:
            raise Stopped

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A stop inside the block (files moving between dirs) waits for its end."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self.received_at is not None:
            raise Stopped

    def took(self) -> str:
        return f"{time.monotonic() - self.received_at:.1f} s after SIGTERM" if self.received_at else "at once"


STOP = StopState()
if __name__ == "__main__":
    # As early as this module allows (`python -m` imported the package, which does not import this module:
    # job_contract.py). The job's bootstrap shell holds a stop until this handler is in (sagemaker.BOOTSTRAP).
    signal.signal(signal.SIGTERM, STOP._handle)

TRAIN_SCRIPT = REPO / "src" / "train_deepspeed.py"
DEFAULT_MASTER_PORT = 29500
CHECKPOINTS = "checkpoints/"
STOPPED_STATUS = 143  # 128 + SIGTERM: saved and stopped, not finished (a restarted job resumes)
PRUNE_EVERY_S = 30.0
GATHER_CHUNK = 64 << 20  # bytes per message when the other hosts send their shards of the final tag
FAILURE_LIMIT = 1024  # bytes of output/failure SageMaker keeps as the job's FailureReason
LOG_TAIL_LINES = 40  # lines of the ranks' output kept for a crash's failure reason
# After a stop, ranks that have not ended by then are ended (the checkpoint protocol survives a kill at any
# point): a host that stopped before its ranks joined leaves the other hosts' ranks waiting for them, and
# SageMaker's SIGKILL 120 s after the SIGTERM would end the job with no line and no exit status of ours.
STOP_GRACE_S = 100.0


def log(message: str) -> None:
    print(f"[dskit-sagemaker] {message}", flush=True)


@dataclass(frozen=True)
class Contract:
    """What SageMaker tells this instance, with every path under one base dir."""

    base: Path
    hosts: list[str]
    current_host: str
    network_interface: str | None
    gpus: int
    cpus: int
    channels: dict[str, Path]
    hyperparameters: dict[str, str]
    input_modes: dict[str, str]  # channel -> TrainingInputMode (inputdataconfig.json)

    @property
    def host_index(self) -> int:
        return self.hosts.index(self.current_host)

    @property
    def checkpoint_dir(self) -> Path:
        return self.base / "checkpoints"

    @property
    def model_dir(self) -> Path:
        return self.base / "model"

    @property
    def output_dir(self) -> Path:
        return self.base / "output"

    @property
    def scratch(self) -> Path:
        # On the ML storage volume (where SageMaker downloads the channels), not the small root volume.
        return self.base / "input" / "dskit"

    @classmethod
    def read(cls, env: dict[str, str]) -> Contract:
        base = Path(env.get(launch_env.SAGEMAKER_BASE) or DEFAULT_BASE)
        config = base / "input" / "config"
        resource = _json_file(config / "resourceconfig.json", required=True)
        hosts = json.loads(env["SM_HOSTS"]) if env.get("SM_HOSTS") else resource.get("hosts")
        current = env.get("SM_CURRENT_HOST") or resource.get("current_host")
        if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
            raise ConfigError(f"{config / 'resourceconfig.json'}: 'hosts' is not a list of host names")
        if current not in hosts:
            raise ConfigError(f"this host {current!r} is not in the job's hosts {hosts}")
        if env.get("SM_HPS"):
            hps = json.loads(env["SM_HPS"])
        else:
            hps = _json_file(config / "hyperparameters.json", required=False)
        input_config = _json_file(config / "inputdataconfig.json", required=False)
        channel_names = set(input_config)
        channel_names |= {k[len("SM_CHANNEL_") :].lower() for k in env if k.startswith("SM_CHANNEL_")}
        channels = {
            name: Path(env.get(f"SM_CHANNEL_{name.upper()}") or base / "input" / "data" / name)
            for name in sorted(channel_names)
        }
        return cls(
            base=base,
            hosts=hosts,
            current_host=current,
            network_interface=env.get("SM_NETWORK_INTERFACE_NAME") or resource.get("network_interface_name"),
            gpus=int(env["SM_NUM_GPUS"]) if env.get("SM_NUM_GPUS") else _cuda_devices(),
            cpus=int(env["SM_NUM_CPUS"]) if env.get("SM_NUM_CPUS") else (os.cpu_count() or 1),
            channels=channels,
            hyperparameters={str(k): str(v) for k, v in hps.items()},
            input_modes={
                str(name): str(spec.get("TrainingInputMode", "File"))
                for name, spec in input_config.items()
                if isinstance(spec, dict)
            },
        )


def _json_file(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ConfigError(
                f"{path} not found: this runs inside a SageMaker training job (or set "
                f"{launch_env.SAGEMAKER_BASE} to a dir holding SageMaker's input/config tree)"
            )
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def training_args(contract: Contract) -> list[str]:
    """The training flags: the hyperparameters (--config first), then what the contract fixes."""
    hps = dict(contract.hyperparameters)
    for name in hps:
        if name in OWNED_FLAGS:
            raise ConfigError(f"hyperparameter {name} is set by the job ({OWNED_FLAGS[name]}): remove it")
    for name in ("model", "train"):
        if name not in contract.channels:
            raise ConfigError(
                f"the job has no {name} channel: submit it with channels.{name} in the values file"
            )
    for name, mode in sorted(contract.input_modes.items()):
        if mode not in READABLE_INPUT_MODES:
            raise ConfigError(
                f"channel {name} is in {mode} input mode, which the kit cannot read (it reads files): submit the "
                f"job with input_mode {' or '.join(READABLE_INPUT_MODES)} in the values file"
            )
    args: list[str] = []
    if "config" in hps:
        args += ["--config", hps.pop("config")]
    for name, value in hps.items():
        args += [f"--{name}", value]
    args += ["--model", str(contract.channels["model"]), "--dataset", str(contract.channels["train"])]
    if "validation" in contract.channels:
        args += ["--validation_dataset", str(contract.channels["validation"])]
    args += ["--checkpoint_dir", str(contract.checkpoint_dir)]
    args += ["--data_cache_dir", str(contract.scratch / "data-cache")]
    return args


def rank_environment(contract: Contract, nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    scratch = contract.scratch
    # Caches and temp files on the big volume unless the job's environment names other places.
    for name, path in (
        ("TMPDIR", scratch / "tmp"),
        ("HF_HOME", scratch / "hf"),
        ("TORCH_EXTENSIONS_DIR", scratch / "torch_extensions"),
        ("TRITON_CACHE_DIR", scratch / "triton"),
    ):
        env.setdefault(name, str(path))
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    if contract.gpus == 0:
        env["DS_ACCELERATOR"] = "cpu"
    elif contract.network_interface and len(contract.hosts) > 1:
        env.setdefault("NCCL_SOCKET_IFNAME", contract.network_interface)
    env.setdefault("OMP_NUM_THREADS", str(max(1, contract.cpus // nproc)))
    # The metrics file lands next to this (output/data/ is uploaded as output.tar.gz); the trainer says why it
    # stopped early in the stop-reason file.
    env[launch_env.LOG_FILE] = str(contract.output_dir / "data" / f"train-{contract.current_host}.log")
    env[launch_env.STOP_REASON_FILE] = str(scratch / "stop_reason")
    env[launch_env.ERROR_FILE] = str(scratch / "error")
    return env


def check_writable(paths: list[Path]) -> None:
    """Every dir the job writes, before anything runs: a non-root image user cannot write some of SageMaker's."""
    for path in paths:
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ConfigError(
                f"{path} is not writable by uid {os.getuid()} ({e.strerror or e}): run the image as root or "
                f"make {path} writable for its user"
            ) from None


# --- checkpoints across instances -------------------------------------------------------------------------


def _tag_step(name: str) -> int | None:
    from model_utils.checkpoint.protocol import tag_step

    return tag_step(name)


def merge_host_shards(checkpoint_dir: Path) -> list[str]:
    """Move other hosts' files of committed tags (left in `.staging-<tag>`) into the tag; demote committed tags
    that still lack a rank's files (renamed `.incomplete-<tag>`, which no resume picks). Returns what it did."""
    from model_utils.checkpoint import launch_record
    from model_utils.checkpoint.protocol import STAGING_PREFIX
    from model_utils.storage import file_manifest

    done: list[str] = []
    if not checkpoint_dir.is_dir():
        return done
    for staging in sorted(checkpoint_dir.glob(f"{STAGING_PREFIX}*")):
        tag_dir = checkpoint_dir / staging.name[len(STAGING_PREFIX) :]
        if not (tag_dir / file_manifest.MANIFEST).is_file():
            continue  # not committed: the first host's rank 0 removes it when it saves that tag again
        moved = 0
        for item in staging.iterdir():
            if not (tag_dir / item.name).exists():
                os.replace(item, tag_dir / item.name)
                moved += 1
        shutil.rmtree(staging)
        done.append(f"merged {moved} files of other hosts into {tag_dir.name}")
    for tag_dir in sorted(checkpoint_dir.iterdir()):
        if _tag_step(tag_dir.name) is None or not (tag_dir / file_manifest.MANIFEST).is_file():
            continue
        world = launch_record.saved_world_size(tag_dir)
        missing = [r for r in range(world or 0) if not (tag_dir / f"rng_state_rank{r}.pt").is_file()]
        if missing:
            # Renamed first, so no resume picks it even if the delete is cut short.
            os.replace(tag_dir, checkpoint_dir / f"{INCOMPLETE_PREFIX}{tag_dir.name}")
            done.append(
                f"{tag_dir.name} lacks the files of ranks {missing} (not synced from their host): deleted"
            )
    # Deleted, not kept: checkpoints/ is synced to S3 and restored to every instance at each restart.
    for demoted in sorted(checkpoint_dir.glob(f"{INCOMPLETE_PREFIX}*")):
        shutil.rmtree(demoted)
    return done


INCOMPLETE_PREFIX = ".incomplete-"


def prune_staging(checkpoint_dir: Path, keep: int) -> None:
    """On hosts other than the first: drop the staging dirs of all but the newest keep + 1 saves (the first
    host's rotation deletes the tags they belong to; nothing here would ever delete them)."""
    from model_utils.checkpoint.protocol import STAGING_PREFIX

    staged = [p for p in checkpoint_dir.glob(f"{STAGING_PREFIX}*") if p.is_dir()]
    staged.sort(key=lambda p: _tag_step(p.name[len(STAGING_PREFIX) :]) or 0, reverse=True)
    for old in staged[keep + 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def gather_final_shards(contract: Contract, port: int) -> str:
    """After a finished run, every host at once: the other hosts send their ranks' files of the final tag (the
    first host's newest verified one) to the first host, over a gloo group of one process per host on `port`,
    so that the export (and the S3 copy of that tag) has every rank's shard. Returns what it did."""
    import datetime

    import torch
    import torch.distributed as dist

    from model_utils.checkpoint.protocol import STAGING_PREFIX, newest_verified

    index, hosts = contract.host_index, contract.hosts
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{hosts[0]}:{port}",
        rank=index,
        world_size=len(hosts),
        timeout=datetime.timedelta(minutes=30),
    )
    try:
        tag: list[str | None] = [None]
        if index == 0:
            target = newest_verified(contract.checkpoint_dir)
            tag[0] = target.tag if target is not None else None
        dist.broadcast_object_list(tag, src=0)
        if tag[0] is None:
            return "no verified checkpoint to gather"
        tag_dir = contract.checkpoint_dir / tag[0]
        received = 0
        for sender in range(1, len(hosts)):
            if index == sender:
                staging = contract.checkpoint_dir / f"{STAGING_PREFIX}{tag[0]}"
                files = sorted(p for p in staging.iterdir() if p.is_file()) if staging.is_dir() else []
                dist.send_object_list([[(p.name, p.stat().st_size) for p in files]], dst=0)
                for path in files:
                    with path.open("rb") as f:
                        while chunk := f.read(GATHER_CHUNK):
                            dist.send(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), dst=0)
            elif index == 0:
                listing: list[list[tuple[str, int]] | None] = [None]
                dist.recv_object_list(listing, src=sender)
                for name, size in listing[0] or []:
                    part = tag_dir / f".{name}.part"
                    with part.open("wb") as f:
                        left = size
                        while left:
                            buf = torch.empty(min(GATHER_CHUNK, left), dtype=torch.uint8)
                            dist.recv(buf, src=sender)
                            f.write(buf.numpy().tobytes())
                            left -= buf.numel()
                    os.replace(part, tag_dir / name)
                    received += 1
        dist.barrier()
        return f"gathered {received} files of other hosts into {tag[0]}" if index == 0 else f"sent {tag[0]}"
    finally:
        dist.destroy_process_group()


def _keep_checkpoints(hps: dict[str, str]) -> int:
    import dataclasses

    from model_utils.config.arguments import CheckpointArgs

    default = next(f.default for f in dataclasses.fields(CheckpointArgs) if f.name == "keep_checkpoints")
    text = hps.get("keep_checkpoints")
    return int(text) if text and text.isdigit() else int(default)  # type: ignore[arg-type]


# --- signals ----------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The processes whose parent is pid (torchrun's ranks)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


class StopForwarder:
    """SIGTERM to this process -> SIGUSR1 to every rank of this instance's torchrun (never to torchrun), once the
    rank handles it (before that, USR1 would kill it: it is sent again each second until it does)."""

    def __init__(self) -> None:
        self.torchrun: subprocess.Popen | None = None
        self.signalled: set[int] = set()
        STOP.on_stop = self._handle

    @property
    def received_at(self) -> float | None:
        return STOP.received_at

    def _handle(self) -> None:
        log("SIGTERM: asking the ranks to save a checkpoint and stop")
        self.signalled.clear()  # a second SIGTERM signals every rank again
        self.forward()

    def overdue(self, grace_s: float) -> bool:
        """Whether the ranks have had grace_s since the stop and still run."""
        return (
            self.received_at is not None
            and self.torchrun is not None
            and self.torchrun.poll() is None
            and time.monotonic() - self.received_at > grace_s
        )

    def forward(self) -> None:
        """Signal the ranks not signalled yet (called again while torchrun is still starting them)."""
        if self.received_at is None or self.torchrun is None or self.torchrun.poll() is not None:
            return
        for pid in set(_children(self.torchrun.pid)) - self.signalled:
            if not preemption.catches(pid, signal.SIGUSR1):
                continue  # still starting
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            self.signalled.add(pid)

    def restore(self) -> None:
        STOP.on_stop = None


# --- the run ----------------------------------------------------------------------------------------------


def _ensure_environment(contract: Contract, argv: list[str]) -> None:
    """setup uv: install the locked environment (not the dev group) and re-execute in it; image: use this one."""
    setup = os.environ.get(launch_env.SAGEMAKER_SETUP, "image")
    if setup == "image":
        return
    if setup != "uv":
        raise ConfigError(f"{launch_env.SAGEMAKER_SETUP}={setup!r}: use uv or image")
    venv_python = REPO / ".venv" / "bin" / "python"
    if Path(sys.prefix).resolve() == (REPO / ".venv").resolve():
        return
    uv = ["uv"] if shutil.which("uv") else [sys.executable, "-m", "uv"]
    if subprocess.run([*uv, "--version"], capture_output=True).returncode != 0:
        log("uv not found: installing it with pip")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "uv"], check=True)
        uv = [sys.executable, "-m", "uv"]
    env = {**os.environ, "UV_CACHE_DIR": str(contract.scratch / "uv-cache")}
    env.setdefault("TMPDIR", str(contract.scratch / "tmp"))
    Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    log("installing the locked environment (uv sync --frozen --no-dev)")
    # A stop during the sync raises Stopped here (subprocess.run kills uv on the way out).
    subprocess.run([*uv, "sync", "--frozen", "--no-dev", "--compile-bytecode"], cwd=REPO, env=env, check=True)
    # Held blocked across the exec (a blocked signal stays pending, where the new image's default action would
    # kill it, or drop it as PID 1): the new image's STOP.install takes it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.execv(venv_python, [str(venv_python), "-m", "dskit.sagemaker.entry", *argv])


def _fail(contract: Contract, message: str) -> None:
    """SageMaker shows output/failure (its first FAILURE_LIMIT bytes) as the job's FailureReason."""
    try:
        contract.output_dir.mkdir(parents=True, exist_ok=True)
        (contract.output_dir / "failure").write_bytes(redact.text(message).encode()[:FAILURE_LIMIT])
    except OSError:
        pass


def failure_reason(message: str | None, status: int, host: str, tail: list[str]) -> str:
    """The kit's own error line when a rank wrote one (its message: `message`); else (a crash) a generic line and
    the log's last lines, as many as fit in FAILURE_LIMIT bytes."""
    if message and message.strip():
        return step_line.error_line(message.strip())
    head = f"torchrun exited with status {status} on {host} (a crash, no error line from the kit); log tail:"
    lines: list[str] = []
    room = FAILURE_LIMIT - len(head.encode()) - 1
    for line in reversed(tail):
        room -= len(line.encode()) + 1
        if room < 0:
            break
        lines.insert(0, line)
    return "\n".join([head, *lines])


class OutputTail:
    """Copies torchrun's output to this process's stdout (the job's log) and keeps its last lines."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._thread = threading.Thread(target=self._copy, args=(proc,), daemon=True)
        self._thread.start()

    def _copy(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            sys.stdout.buffer.write(raw)
            sys.stdout.buffer.flush()
            self.lines.append(raw.decode(errors="replace").rstrip("\r\n"))

    def last(self) -> list[str]:
        self._thread.join(timeout=5.0)  # torchrun exited: what is left in the pipe
        return list(self.lines)


def run(contract: Contract) -> int:
    index, hosts = contract.host_index, contract.hosts
    nproc = contract.gpus or int(os.environ.get(launch_env.SAGEMAKER_CPU_RANKS, "1"))
    port = int(os.environ.get(launch_env.SAGEMAKER_MASTER_PORT, DEFAULT_MASTER_PORT))
    check_writable(
        [contract.checkpoint_dir, contract.model_dir, contract.output_dir / "data", contract.scratch]
    )
    args = training_args(contract)
    # The merge's imports (torch: seconds) outside the block a stop waits for: only its file moves are held.
    from model_utils.checkpoint import launch_record, protocol  # noqa: F401
    from model_utils.storage import file_manifest  # noqa: F401

    with STOP.deferred():
        for line in merge_host_shards(contract.checkpoint_dir):
            log(line)
    env = rank_environment(contract, nproc)
    Path(env[launch_env.STOP_REASON_FILE]).unlink(missing_ok=True)
    error_file = Path(env[launch_env.ERROR_FILE])
    error_file.unlink(missing_ok=True)
    stop = StopForwarder()
    log(
        f"host {contract.current_host} ({index + 1} of {len(hosts)}), master {hosts[0]}:{port}, "
        f"{nproc} ranks ({'GPUs' if contract.gpus else 'CPU'})"
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}", f"--node_rank={index}",
        f"--nproc_per_node={nproc}", f"--master_addr={hosts[0]}", f"--master_port={port}",
        str(TRAIN_SCRIPT), *args,
    ]  # fmt: skip
    if STOP.received_at is not None:
        stop.restore()
        raise Stopped
    STOP.moment = "while the ranks start"
    try:
        # Its own session: a signal to this process group (a terminal's Ctrl-C, say) does not reach torchrun.
        stop.torchrun = subprocess.Popen(
            cmd, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        output = OutputTail(stop.torchrun)
        keep = _keep_checkpoints(contract.hyperparameters)
        last_prune = time.monotonic()
        grace_s = float(os.environ.get(launch_env.SAGEMAKER_STOP_GRACE, STOP_GRACE_S))
        while stop.torchrun.poll() is None:
            try:
                stop.torchrun.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                stop.forward()
            if stop.overdue(grace_s):
                os.killpg(stop.torchrun.pid, signal.SIGKILL)
                stop.torchrun.wait()
                log(
                    f"the ranks did not stop within {grace_s:.0f} s of SIGTERM (waiting for a host that had "
                    f"stopped already?): ended them; {contract.checkpoint_dir} keeps its newest verified checkpoint"
                )
                return STOPPED_STATUS
            if index > 0 and time.monotonic() - last_prune > PRUNE_EVERY_S:
                prune_staging(contract.checkpoint_dir, keep)
                last_prune = time.monotonic()
        status = stop.torchrun.returncode
    finally:
        stop.restore()  # from here a stop raises Stopped again: the ranks are gone, nothing left to save
        STOP.moment = "after the ranks ended"
        if stop.torchrun is not None and stop.torchrun.poll() is None:  # this process failed: take them along
            os.killpg(stop.torchrun.pid, signal.SIGKILL)
    reason_file = Path(env[launch_env.STOP_REASON_FILE])
    stopped = stop.received_at is not None or reason_file.is_file()
    if status != 0:
        message = error_file.read_text() if error_file.is_file() else None
        _fail(contract, failure_reason(message, status, contract.current_host, output.last()))
        log(f"torchrun exited with status {status}")
        return status
    if stopped:
        took = f" {time.monotonic() - stop.received_at:.1f} s after SIGTERM" if stop.received_at else ""
        log(
            f"stopped early{took}: checkpoint saved in {contract.checkpoint_dir}; a restarted job resumes there"
        )
        return STOPPED_STATUS
    STOP.moment = "during the export"
    if len(hosts) > 1:
        log(gather_final_shards(contract, port + 1))
    if index == 0:
        from dskit import export

        # Staged on the ML storage volume (scratch), then moved into model/ (a mount point on SageMaker).
        started = time.monotonic()
        out = export.export(
            contract.checkpoint_dir, contract.model_dir, staging_dir=contract.scratch / "export", replace=True
        )
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        log(
            f"exported the newest verified checkpoint to {out} in {time.monotonic() - started:.1f} s "
            f"({size / 1e6:.1f} MB, staged in {contract.scratch / 'export'})"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    from model_utils.launch import startup

    startup.fewer_full_collections()  # before the imports of a training job (launch/startup.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv:
        print(__doc__)
        return 0 if argv[0] in ("-h", "--help") else 2
    contract = None
    try:
        STOP.install()
        # The attempt's paid time in the run's ledger starts here (kept across the re-execution after uv sync).
        os.environ.setdefault(launch_env.LAUNCHED_AT, f"{time.time():.3f}")
        contract = Contract.read(dict(os.environ))
        STOP.moment = "during set-up"
        _ensure_environment(contract, argv)
        return run(contract)
    except Stopped:
        return _stopped()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if contract is not None:
            _fail(contract, f"error: {e}")
        return 2
    except Exception as e:
        if STOP.received_at is not None:
            # The other host's entry stopped first (the final gather's connection closed, say): a stop, not a failure.
            return _stopped()
        if contract is not None:  # a crash of the entry itself: its traceback follows in the log
            _fail(contract, f"the dskit entry crashed on {contract.current_host}: {type(e).__name__}: {e}")
        raise
    finally:
        STOP.on_stop = _exiting  # the status is decided: a stop now must not raise on the way out


def _exiting() -> None:
    pass


def _stopped() -> int:
    """A stop where no rank runs: one line, exit 143, and no output/failure (a stop is not a failure)."""
    outcome = {
        "during the export": "the run finished and its final checkpoint is saved; a restarted job starts from it",
        "after the ranks ended": f"checkpoints as the ranks left them in {CHECKPOINTS}",
    }.get(STOP.moment, f"the ranks were not started, nothing in {CHECKPOINTS} was touched")
    log(f"SIGTERM {STOP.moment}: stopped {STOP.took()}: {outcome}")
    return STOPPED_STATUS


if __name__ == "__main__":
    sys.exit(main())
