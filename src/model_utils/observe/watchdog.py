"""The hang watchdog: a rank that stops advancing ends the job within --hang_timeout, with its stack in the log
and a line naming it, instead of the others waiting in a collective until gloo's or NCCL's 10-30 minute timeout.

Each rank runs a `Monitor` thread beside its training thread. The training thread only notes its progress (step
and phase: `progress`, a tuple assignment); the thread writes it, with the time it last ran itself, as a small
heartbeat file in a directory of this host's ranks, and reads the other local ranks' files. No heartbeat goes
through another host or through one rank: each host judges its own ranks, so the cost does not grow with the
job. A rank's heartbeat going stale means its whole process stopped (SIGSTOP, a hang holding the GIL, a stuck
kernel call); its progress going stale while its thread still beats means it waits (a collective another rank
never joins) or loops.

The verdict (`judge`): a local rank whose heartbeat is older than --hang_timeout is frozen, whatever its phase;
a rank's own progress older than its phase's allowance (`allowance`: --hang_timeout, or 10 measured steps when
longer, and 4x that for checkpoints, validation, samples and the first step) is a hang. Then every live rank prints its
Python stacks (faulthandler), the lowest live rank of the host has each frozen rank print its training thread's
(`ask_for_stacks`), writes one `error:` line naming the ranks that stopped advancing (frozen,
or behind the others) with their host, phase and step (and that host to DSKIT_HANG_HOSTS_FILE: train.sbatch
requeues the job without it), and the ranks exit with HANG_EXIT, which the launchers pass on (docs/hangs.md).

The collectives' own timeouts are set above every allowance (`collective_timeout_s`), so the watchdog decides.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from model_utils import launch_env, processes, scratch
from model_utils.observe import step_line
from model_utils.observe.log import record_error

HANG_EXIT = 75  # EX_TEMPFAIL: the job may succeed when run again (on other nodes): a launcher's requeue
DUMP_SIGNAL = signal.SIGUSR2  # faulthandler prints the rank's stack on it, even when it holds the GIL
# A step's phases in the order a turn meets them (`judge` orders ranks by step, then phase).
DATA, COMPUTE, DECISION, VALIDATION, CHECKPOINT = "data", "compute", "decision", "validation", "checkpoint"
SAMPLES = "samples"  # generating from --sample_prompts (loop/observers/samples.py)
PHASES = (DATA, COMPUTE, DECISION, VALIDATION, SAMPLES, CHECKPOINT)
LONG_PHASES = (VALIDATION, SAMPLES, CHECKPOINT)
LONG_PHASE_FACTOR = (
    4  # checkpoints, validation, samples and the first step (compilation, warm-up) may take this x longer
)
STEP_TIME_FACTOR = 10  # no step phase is judged stuck before this many median step times
COLLECTIVE_MARGIN_S = 60  # the collectives time out this long after the longest allowance
DUMP_WAIT_S = 2.0  # the host's judge waits this long for the stuck ranks' stacks before its line and exit
GRACE_S = 5.0  # the other ranks wait this long before exiting, so the judge's line is the launcher's reason


def collective_timeout_s(hang_timeout: float) -> float:
    """The process group's (and DeepSpeed's) timeout: above every allowance, so the watchdog names the rank
    before a collective's own timeout ends the job with a traceback from every rank."""
    return LONG_PHASE_FACTOR * hang_timeout + COLLECTIVE_MARGIN_S


def allowance(hang_timeout: float, phase: str, step_median: float | None) -> float:
    """Seconds a rank may stay in `phase` without advancing: --hang_timeout, scaled up for slow steps (never
    past the long phases'), and LONG_PHASE_FACTOR x it for checkpoints, validation, samples and before a step was
    measured."""
    longest = LONG_PHASE_FACTOR * hang_timeout
    if phase in LONG_PHASES or step_median is None:
        return longest
    return min(max(hang_timeout, STEP_TIME_FACTOR * step_median), longest)


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat file: where it is, since when, and when its watchdog thread last ran."""

    rank: int
    host: str
    pid: int
    step: int
    phase: str
    progress_at: float  # wall clock (time.time: the ranks of a host compare them)
    alive_at: float

    def position(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)

    def where(self) -> str:
        return f"{self.phase} of step {self.step}"

    def who(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) on {self.host}"


@dataclass(frozen=True)
class Verdict:
    """A hang seen from one rank: the local ranks that stopped advancing (frozen or behind), the others."""

    judge: Beat  # the rank that saw it
    frozen: tuple[Beat, ...]  # no heartbeat for --hang_timeout: the process itself stopped
    behind: tuple[Beat, ...]  # alive, but at an earlier phase or step than the most advanced local rank
    waiting: tuple[Beat, ...]  # alive, at the most advanced position: waiting for the stuck ones
    now: float
    hang_timeout: float

    @property
    def stuck(self) -> tuple[Beat, ...]:
        return self.frozen + self.behind

    def describe(self) -> str:
        """The one line for the log and the launcher (without the `error: ` prefix)."""
        parts = []
        for beat in self.frozen:
            parts.append(
                f"{beat.who()} stopped advancing in {beat.where()}: no heartbeat for "
                f"{self.now - beat.alive_at:.0f} s (the process is frozen)"
            )
        for beat in self.behind:
            parts.append(
                f"{beat.who()} stopped advancing in {beat.where()} for {self.now - beat.progress_at:.0f} s"
            )
        waiting = ", ".join(str(b.rank) for b in self.waiting)
        if parts:
            line = "hang: " + "; ".join(parts)
            if waiting:
                line += f"; ranks {waiting} wait for it in {self.waiting[0].where()}"
        else:
            slowest = max(self.now - b.progress_at for b in self.waiting)
            line = (
                f"hang: no rank on {self.judge.host} advanced for {slowest:.0f} s (ranks {waiting} wait in "
                f"{self.waiting[0].where()}): the rank that stopped is on another host, whose log names it"
            )
        return (
            f"{line} (--hang_timeout {self.hang_timeout:g} s; their stacks are above; exit status {HANG_EXIT}: "
            "requeue or restart, docs/hangs.md)"
        )


def judge(
    me: Beat, beats: list[Beat], now: float, hang_timeout: float, step_median: float | None
) -> Verdict | None:
    """A hang seen from `me` among this host's `beats` (`me` included), or None. A rank on another host that
    stopped stalls these ranks' progress in a collective: `me` then names no local rank."""
    frozen = tuple(b for b in beats if b.rank != me.rank and now - b.alive_at > hang_timeout)
    stalled = now - me.progress_at > allowance(hang_timeout, me.phase, step_median)
    if not frozen and not stalled:
        return None
    alive = [b for b in beats if b not in frozen]
    ahead = max(b.position() for b in alive)
    behind = tuple(b for b in alive if b.position() < ahead)
    waiting = tuple(b for b in alive if b.position() == ahead)
    return Verdict(me, frozen, behind, waiting, now, hang_timeout)


HEARTBEATS = "watchdog"  # the kind of this host's heartbeat dirs (scratch.py)


def heartbeat_dir() -> Path:
    """This host's ranks' heartbeat directory for this launch, by launch and torchrun restart (a restarted worker
    never reads the files of the ones it replaced): in the kit's launcher's temporary dir, removed with it; under
    another launcher (accelerate's), in the temp dir, named after the ranks' common parent (the next kit launch on
    the host removes it once that parent has ended). DSKIT_WATCHDOG_DIR chooses another."""
    given = os.environ.get(launch_env.WATCHDOG_DIR)
    if given:
        return Path(given)
    launch = f"{os.environ.get('MASTER_PORT', '0')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    launcher_dir = os.environ.get(launch_env.LAUNCH_DIR)
    if launcher_dir:
        return Path(launcher_dir) / f"{HEARTBEATS}-{launch}"
    return Path(tempfile.gettempdir()) / f"{scratch.prefix(HEARTBEATS, os.getppid())}{launch}"


class Monitor:
    """One rank's watchdog thread (see the module docstring). `dump_extra` adds what the device can tell on a
    hang (the NCCL flight recorder); `exit` ends the process (os._exit: the training thread is stuck)."""

    def __init__(
        self,
        rank: int,
        hang_timeout: float,
        directory: Path | None = None,
        dump_extra: Callable[[], str | None] | None = None,
        exit: Callable[[int], object] = os._exit,
        clock: Callable[[], float] = time.time,
        dump_wait_s: float = DUMP_WAIT_S,
        grace_s: float = GRACE_S,
    ) -> None:
        self.rank, self.hang_timeout = rank, hang_timeout
        self.directory = directory or heartbeat_dir()
        self.dump_extra, self.exit, self.clock = dump_extra, exit, clock
        self.dump_wait_s, self.grace_s = dump_wait_s, grace_s
        self.interval = min(5.0, max(0.1, hang_timeout / 10))
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._progress = (0, DATA, clock())  # (step, phase, since): one assignment, read whole by the thread
        self._step_times: deque[float] = deque(maxlen=64)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.verdict: Verdict | None = None

    @property
    def file(self) -> Path:
        return self.directory / f"rank-{self.rank}.json"

    def progress(self, step: int, phase: str) -> None:
        """The training thread entered `phase` of `step`: its only cost per step phase. A long phase is written
        at once too (rare): a rank frozen in its first second still shows the other ranks where it stopped."""
        self._progress = (step, phase, self.clock())
        if phase in LONG_PHASES and self._thread is not None and not self._stopped.is_set():
            self.beat()

    def step_took(self, seconds: float) -> None:
        self._step_times.append(seconds)

    def step_median(self) -> float | None:
        times = list(self._step_times)
        return statistics.median(times) if times else None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        listen_for_stacks()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="dskit-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Idempotent: the thread ends, the heartbeat file goes (an ended rank is no hang)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._thread is not None:
            faulthandler.unregister(DUMP_SIGNAL)
        self._thread = None
        self.file.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other ranks of the host still beat there
            self.directory.rmdir()  # the last rank of the host to stop removes it

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.check()

    def beat(self) -> Beat:
        step, phase, since = self._progress
        me = Beat(self.rank, self.host, self.pid, step, phase, since, self.clock())
        temporary = self.file.with_suffix(f".{threading.get_ident()}.tmp")  # the thread's, or the loop's
        temporary.write_text(json.dumps(asdict(me)))
        os.replace(temporary, self.file)  # a reader sees a whole heartbeat or the previous one
        return me

    def beats(self) -> list[Beat]:
        """This host's live ranks' heartbeats (a file of an earlier launch's dead rank is left out)."""
        found = []
        for path in self.directory.glob("rank-*.json"):
            try:
                beat = Beat(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # removed meanwhile
            if processes.running(beat.pid):
                found.append(beat)
        return found

    def check(self) -> Verdict | None:
        """One round of the thread: beat, read the others, and end the rank on a hang."""
        me = self.beat()
        beats = [b for b in self.beats() if b.rank != self.rank] + [me]
        verdict = judge(me, beats, self.clock(), self.hang_timeout, self.step_median())
        if verdict is not None and not self._stopped.is_set():
            self.verdict = verdict
            self._stopped.set()  # one verdict: the thread's rounds end here
            self._end(verdict)
        return verdict

    def _end(self, verdict: Verdict) -> None:
        """Stacks, the host's one line (from its lowest live rank), exit HANG_EXIT."""
        live = [b.rank for b in verdict.behind + verdict.waiting]
        leads = self.rank == min(live)
        sys.stdout.flush()
        _say(
            f"watchdog: rank {self.rank} (pid {self.pid}) on {self.host} in {verdict.judge.where()}: its stacks"
        )
        faulthandler.dump_traceback(file=_stacks_file(), all_threads=True)
        if self.dump_extra is not None:
            try:
                said = self.dump_extra()
            except Exception as err:  # what the device tells is extra: the verdict still comes
                said = f"the collective trace could not be written: {err}"
            if said:
                _say(f"watchdog: rank {self.rank}: {said}")
        if not leads:
            time.sleep(self.grace_s)  # the host's line comes first, and names the launcher's reason
            self._leave(())
            return
        for beat in verdict.frozen:
            _say(f"watchdog: {beat.who()}, frozen in {beat.where()}: its stacks")
            ask_for_stacks(beat.pid)
            time.sleep(self.dump_wait_s)
        _say(step_line.error_line(verdict.describe()))
        # Each host's judge names its own stuck ranks' hosts.
        launch_env.name_bad_hosts([b.host for b in verdict.stuck], "a rank stopped advancing (hang)")
        record_error(verdict.describe())
        self._leave(verdict.frozen)

    def _leave(self, frozen: tuple[Beat, ...]) -> None:
        """Exit HANG_EXIT, leaving no heartbeat behind (this rank's, and those of the frozen ranks it ends)."""
        for beat in frozen:
            # Their stacks are out. Continued, a frozen rank would wait in the collective it froze before (a
            # save's barrier) and, taking SIGTERM as a stop request, hold the job for the launcher's 30-s close.
            with contextlib.suppress(OSError):
                os.kill(beat.pid, signal.SIGKILL)
        for path in [self.file, *(self.directory / f"rank-{b.rank}.json" for b in frozen)]:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the others' files are theirs to remove
            self.directory.rmdir()
        self.exit(HANG_EXIT)


def listen_for_stacks() -> None:
    """Print this process's training thread's stack on DUMP_SIGNAL (`ask_for_stacks`). Its own thread only: the
    handler reads the stacks without the GIL, and another thread's, changing meanwhile, can crash the process
    (measured: SIGSEGV in about half of the tries with a second thread running Python)."""
    faulthandler.register(DUMP_SIGNAL, file=_stacks_file(), all_threads=False, chain=False)


def ask_for_stacks(pid: int) -> None:
    """Have a frozen rank print its training thread's stack. It cannot print it while stopped: DUMP_SIGNAL waits
    for the SIGCONT that follows. The signal goes to the main thread (the training thread, whose thread id is the
    process's), so the handler runs there before its Python goes on, and its stack is where it froze; sent to the
    process, any thread may take it while the main thread runs on."""
    with contextlib.suppress(OSError):  # ended meanwhile
        _signal_main_thread(pid, DUMP_SIGNAL)
        os.kill(pid, signal.SIGCONT)


def _signal_main_thread(pid: int, sig: int) -> None:
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)  # Linux (glibc 2.30+)
    if tgkill is None:
        os.kill(pid, sig)  # elsewhere: whichever thread takes it prints its own stack
    elif tgkill(pid, pid, sig) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _stacks_file() -> TextIO:
    """Where faulthandler writes: stderr's file descriptor (the process's own, when sys.stderr has none, e.g. a
    test's capture)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__ or sys.stderr
    return sys.stderr


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
