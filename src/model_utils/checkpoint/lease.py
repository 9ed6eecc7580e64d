"""One run per checkpoint dir: a lease file that rank 0 holds for the life of a run.

Two runs writing one checkpoint dir replace or rotate away each other's checkpoints. A run takes
`<checkpoint_dir>/.dskit-lease.json` (host, pid, job, start and heartbeat times) before any rank reads or writes the
dir, renews it from a heartbeat thread, and removes it at exit (done, stopped, or failed with an error).

Only operations that are atomic on NFS, Lustre and FSx are used: a new lease is a temp file hard-linked to the
lease's name (link() fails if the name exists, where O_CREAT|O_EXCL is not atomic on older NFS), a renewal is a
temp file renamed over it, and a takeover first renames the old lease away (only one of two racing takers can).

A launcher takes the lease in its preflight, before any rank starts, so that a second launch is refused there in
one line however close behind the first it comes: held for the launcher's process (the preflight's parent), with
the launch's token (launch_env.LEASE_TOKEN, which the ranks inherit), it is adopted by that launch's rank 0.

A lease held by a live run refuses the launch in one line naming the holder. It is taken over, with one line saying
so, when its holder is gone: its heartbeat is older than STALE_AFTER_S (a killed run, on any host), or it was taken
on this host by a process that no longer exists (a run killed here relaunched at once), or it is held by the same
job restarted (SLURM's requeue: the same SLURM_JOB_ID with a higher SLURM_RESTART_COUNT; SageMaker: the same
TRAINING_JOB_NAME), whose earlier processes are gone by definition.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from model_utils import launch_env, processes
from model_utils.errors import ConfigError
from model_utils.observe.log import print0, warn0
from model_utils.storage import file_manifest

LEASE_FILE = ".dskit-lease.json"
HEARTBEAT_S = 30.0
# A heartbeat this old means the holder is gone: several missed renewals, with room for clock skew between hosts.
STALE_AFTER_S = 4 * HEARTBEAT_S


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: written into the lease file, read back by whoever finds it."""

    token: str  # this holding's own id: a renewal or release touches only a lease that still carries it
    host: str
    pid: int
    slurm_job_id: str | None
    slurm_restart_count: int
    sagemaker_job: str | None
    started: float  # seconds since the epoch
    heartbeat: float

    @classmethod
    def of_this_process(cls, now: float, pid: int | None = None) -> Holder:
        """This process (or `pid`, its launcher's) as the holder, with its launch's token where it has one."""
        env = os.environ
        return cls(
            token=env.get(launch_env.LEASE_TOKEN) or uuid.uuid4().hex,
            host=socket.gethostname(),
            pid=os.getpid() if pid is None else pid,
            slurm_job_id=env.get("SLURM_JOB_ID"),
            slurm_restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
            sagemaker_job=env.get("TRAINING_JOB_NAME"),
            started=now,
            heartbeat=now,
        )

    @classmethod
    def from_json(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(
                token=str(data["token"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                slurm_job_id=data.get("slurm_job_id"),
                slurm_restart_count=int(data.get("slurm_restart_count") or 0),
                sagemaker_job=data.get("sagemaker_job"),
                started=float(data["started"]),
                heartbeat=float(data["heartbeat"]),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    def describe(self) -> str:
        job = (
            f"SLURM job {self.slurm_job_id}"
            if self.slurm_job_id
            else f"SageMaker job {self.sagemaker_job}"
            if self.sagemaker_job
            else "no job id"
        )
        return f"host {self.host}, pid {self.pid}, {job}, since {_clock(self.started)}"


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def why_gone(held: Holder, me: Holder, now: float) -> str | None:
    """Why the run that holds the lease can no longer be running (so `me` may take it over); None: it may be."""
    same_job = me.slurm_job_id is not None and held.slurm_job_id == me.slurm_job_id
    if same_job and me.slurm_restart_count > held.slurm_restart_count:
        return f"SLURM requeued job {me.slurm_job_id} (restart {me.slurm_restart_count})"
    if me.sagemaker_job is not None and held.sagemaker_job == me.sagemaker_job:
        return f"SageMaker restarted training job {me.sagemaker_job}"
    if held.host == me.host and held.pid != me.pid and not processes.running(held.pid):
        return f"its process {held.pid} on this host is gone"
    age = now - held.heartbeat
    if age > STALE_AFTER_S:
        return f"its last heartbeat was {age:.0f} s ago"
    return None


def refusal(path: Path, held: Holder, now: float) -> str:
    stale_at = _clock(held.heartbeat + STALE_AFTER_S)
    return (
        f"checkpoint dir {path.parent} is in use by another run ({held.describe()}, heartbeat "
        f"{max(now - held.heartbeat, 0):.0f} s ago): give this run its own --checkpoint_dir, or stop that run "
        f"(a run that is gone frees the dir at {stale_at}; {path} holds the lease)"
    )


def _read(path: Path) -> Holder | None:
    """The lease's holder; None when there is no lease file. A lease that cannot be parsed (a torn write of an
    older kit, a stray file) counts as stale: its holder is unknown, so nothing can renew it."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    return Holder.from_json(text) or Holder("", "?", 0, None, 0, None, 0.0, 0.0)


def _write_temp(path: Path, holder: Holder) -> Path:
    tmp = path.with_name(f"{path.name}.{holder.host}.{holder.pid}.{uuid.uuid4().hex[:8]}.tmp")
    file_manifest.write_durably(tmp, holder.to_json())
    return tmp


def _link_new(path: Path, holder: Holder) -> bool:
    """Create the lease atomically; False when one exists already."""
    tmp = _write_temp(path, holder)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:
            # NFS may report a failure for a link that was made (a retransmitted request): the link count says.
            if tmp.stat().st_nlink != 2:
                raise
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _move_away(path: Path, held: Holder, me: Holder) -> bool:
    """Remove the lease `held` judged gone; False when another taker got there first (the lease changed)."""
    moved = path.with_name(f"{path.name}.{me.host}.{me.pid}.{me.token[:8]}.taken")
    try:
        os.rename(path, moved)
    except FileNotFoundError:
        return False
    now_moved = _read(moved)
    if now_moved is not None and now_moved.token != held.token:
        # A live lease, taken by another run since it was judged: put it back, unless a third run took the name.
        with contextlib.suppress(FileExistsError):
            os.link(moved, path)
        moved.unlink(missing_ok=True)
        return False
    moved.unlink(missing_ok=True)
    return True


class Lease:
    """A lease held by this process: renewed by a heartbeat thread until released (heartbeat_s None: not renewed,
    the preflight's, which its launch's rank 0 adopts within seconds)."""

    def __init__(self, path: Path, holder: Holder, heartbeat_s: float | None, made_dir: bool = False) -> None:
        self.path, self.holder, self.heartbeat_s = path, holder, heartbeat_s
        self.made_dir = made_dir  # the checkpoint dir did not exist before this lease
        self.lost: str | None = None  # why renewals stopped: another run took the lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if heartbeat_s is not None:
            self._thread = threading.Thread(target=self._beat, name="dskit-lease-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        assert self.heartbeat_s is not None
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.renew()
            except (
                OSError
            ) as e:  # a filesystem hiccup: the next beat tries again, well before the lease is stale
                warn0(f"could not renew the lease {self.path} ({e}): retrying in {self.heartbeat_s:.0f} s")
            if self.lost is not None:
                return

    def renew(self) -> None:
        held = _read(self.path)
        if held is None or held.token != self.holder.token:
            self.lost = held.describe() if held is not None else "nobody (the lease file was removed)"
            warn0(
                f"lost the lease on checkpoint dir {self.path.parent}: it is now held by {self.lost}; this run's "
                "checkpoints may be replaced by that run's"
            )
            return
        self.holder = Holder(**{**asdict(self.holder), "heartbeat": time.time()})
        tmp = _write_temp(self.path, self.holder)
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still this process's. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        held = _read(self.path)
        if held is not None and held.token == self.holder.token:
            self.path.unlink(missing_ok=True)
            # A run refused or stopped before its first save leaves no dir it made behind.
            if self.made_dir:
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()  # only if empty


def acquire(
    checkpoint_dir: Path,
    heartbeat_s: float | None = HEARTBEAT_S,
    now: Callable[[], float] = time.time,
    holder_pid: int | None = None,
) -> Lease:
    """Take the lease on checkpoint_dir (made if missing) for this process (or `holder_pid`), or raise a
    ConfigError naming the run that holds it. A lease with this launch's token (its preflight's) is adopted."""
    path = checkpoint_dir / LEASE_FILE
    made_dir = not checkpoint_dir.exists()
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"checkpoint dir {checkpoint_dir} cannot be made ({e.strerror or e}): pass --checkpoint_dir with a "
            "writable path"
        ) from None
    me = Holder.of_this_process(now(), holder_pid)
    for _ in range(8):  # each retry follows a race lost to another taker
        try:
            if _link_new(path, me):
                return Lease(path, me, heartbeat_s, made_dir)
        except OSError as e:
            raise ConfigError(
                f"checkpoint dir {checkpoint_dir} is not writable ({e.strerror or e}): pass --checkpoint_dir "
                "with a writable path"
            ) from None
        held = _read(path)
        if held is None:
            continue  # released meanwhile
        if held.token == me.token:  # this launch's preflight took it for its ranks: now this process holds it
            os.replace(_write_temp(path, me), path)
            return Lease(path, me, heartbeat_s)
        gone = why_gone(held, me, now())
        if gone is None:
            raise ConfigError(refusal(path, held, now()))
        if _move_away(path, held, me):
            print0(f"Taking over the lease on checkpoint dir {checkpoint_dir} from {held.describe()}: {gone}")
    raise ConfigError(
        f"could not take the lease {path}: other launches keep taking it; launch one run per --checkpoint_dir"
    )


def take_for_launch(checkpoint_dir: Path) -> Lease | None:
    """The launchers' preflight: the lease taken for the launch (held by the preflight's parent, the launcher,
    not renewed) when the launcher gave its token, for the launch's rank 0 to adopt; else only checked free
    (check_free), touching nothing. Release it when the launch stops before its ranks start."""
    if not os.environ.get(launch_env.LEASE_TOKEN):
        check_free(checkpoint_dir)
        return None
    return acquire(checkpoint_dir, heartbeat_s=None, holder_pid=os.getppid())


def check_free(checkpoint_dir: Path, now: float | None = None) -> None:
    """Refuse (ConfigError) when a live run holds checkpoint_dir; touches nothing (the launchers' preflight)."""
    path = checkpoint_dir / LEASE_FILE
    held = _read(path)
    at = time.time() if now is None else now
    if held is not None and why_gone(held, Holder.of_this_process(at), at) is None:
        raise ConfigError(refusal(path, held, at))


@contextlib.contextmanager
def held_on_main(
    checkpoint_dir: str, is_main: bool, decide: Callable[[Callable[[], Any]], Any]
) -> Iterator[None]:
    """The lease held by the main rank while the block runs; every rank gets its refusal. `decide` runs a function
    on the main rank and gives every rank its result or its ConfigError (distributed.decide_on_main)."""
    lease: Lease | None = None

    def take() -> None:
        nonlocal lease
        lease = acquire(Path(checkpoint_dir))

    decide(take)
    try:
        yield
    finally:
        if is_main and lease is not None:
            lease.release()
