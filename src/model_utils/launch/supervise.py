"""torchrun, ending a failed run with one line that says which rank failed, where and why.

    python -m model_utils.launch.supervise [TORCHRUN FLAGS] src/train_deepspeed.py [TRAINING FLAGS]

What the launchers start instead of `python -m torch.distributed.run`, with the same arguments. torchrun runs in
this process, so the ranks stay its children (dskit/launcher/stop.py finds them by their parent). When a
rank fails, torchrun stops the others and reports it as a ChildFailedError traceback whose "Root Cause" block is
buried among the ranks' own tracebacks; this ends the output instead with one line, e.g.

    error: rank 1 (local rank 1, pid 4242) on node7 was killed by SIGKILL (signal 9); torchrun stopped the other ranks

or, for a rank that wrote the kit's own `error:` line (observe/log.py error_line, through DSKIT_ERROR_FILE, which
this sets for its ranks when the caller has not), that line's message:

    error: rank 0 (local rank 0, pid 4242) on node7 exited with status 2: dataset path /x does not exist: fix ...

The exit status stays torchrun's (1 for a failed rank), but for a hang: when the kit's watchdog ended a rank
(observe/watchdog.py, exit status HANG_EXIT), the line is the watchdog's own, naming the rank that stopped
advancing, and the status is HANG_EXIT (75), which a launcher may requeue on (docs/hangs.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from model_utils import launch_env, scratch
from model_utils.observe import step_line, watchdog

LAUNCH = "launch"  # the kind of this launcher's temporary dir (scratch.py)


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "a signal"
        return f"was killed by {name} (signal {-exitcode})"
    return f"exited with status {exitcode}"


def hung(failures: dict[int, Any]) -> bool:
    """Whether the kit's watchdog ended these ranks (some rank exited with its status)."""
    return any(failure.exitcode == watchdog.HANG_EXIT for failure in failures.values())


def summary(failures: dict[int, Any], host: str, message: str | None) -> str:
    """The one line for torchrun's failures ({global rank: ProcessFailure}): the first one (by time; a rank that
    ended by SIGTERM, torchrun's own stop of the others, only when none ended otherwise), how it ended, and the
    message of the kit's error line from this host's ranks if one was written."""

    def stopped(failure: Any) -> bool:
        return failure.exitcode == -signal.SIGTERM

    rank, failure = min(failures.items(), key=lambda item: (stopped(item[1]), item[1].timestamp, item[0]))
    if hung(failures) and message:
        return step_line.error_line(message)  # the watchdog's line names the stuck rank, its host and phase
    line = (
        f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) on {host} {_how(failure.exitcode)}"
    )
    if message:
        line += f": {message}"
    elif failure.exitcode < 0:
        line += "; torchrun stopped the other ranks"
    others = sum(1 for r, f in failures.items() if r != rank and not stopped(f))
    if others:
        line += f" ({others} more rank{'s' if others > 1 else ''} failed after it)"
    return step_line.error_line(line)


def main(argv: list[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    scratch.remove_ended(LAUNCH)  # of this host's launchers that were killed (scratch.py)
    scratch.remove_ended(watchdog.HEARTBEATS)  # of ranks under another launcher whose parent has ended
    launch_dir = scratch.make(LAUNCH)
    os.environ[launch_env.LAUNCH_DIR] = str(launch_dir)  # the ranks' heartbeats go in it
    error_file = Path(os.environ.get(launch_env.ERROR_FILE) or launch_dir / "error")
    os.environ[launch_env.ERROR_FILE] = str(error_file)  # the ranks inherit it
    pointer = launch_dir / "ledger"
    # Rank 0, if on this node, names the run's ledger there.
    os.environ[launch_env.LEDGER_POINTER] = str(pointer)
    status = 1  # until torchrun returns
    try:
        args = torchrun.parse_args(argv)
        if args.log_dir is None:  # torchrun's default, a torchelastic_* dir it never removes
            args.log_dir = str(launch_dir / "torchrun")
        torchrun.run(args)
        status = 0
    except ChildFailedError as failed:
        try:
            written = error_file.read_text().strip() or None
        except OSError:
            written = None
        sys.stdout.flush()
        print(summary(failed.failures, socket.gethostname(), written), file=sys.stderr, flush=True)
        status = watchdog.HANG_EXIT if hung(failed.failures) else 1
    finally:
        _ledger_exit(pointer, status)
        shutil.rmtree(launch_dir, ignore_errors=True)  # every rank has ended by now
    return status


def _ledger_exit(pointer: Path, status: int) -> None:
    """The attempt's end in the run's ledger, after the ranks' teardown (loop/observers/ledger.py)."""
    try:
        ledger = Path(pointer.read_text())
    except OSError:
        ledger = None  # rank 0 is on another node, or no rank got as far as the loop
    if ledger is not None:
        from model_utils.observe.ledger_file import append

        append(ledger, "exit", status=status)


if __name__ == "__main__":
    from model_utils.launch import process_exit

    code = main(sys.argv[1:])
    # Without the interpreter's teardown of torch (~0.6 s on a loaded 2-core machine): torchrun has cleaned up
    # after itself, and the ledger's exit record is then the attempt's end to within the shell's own exit.
    process_exit.exit_now(code)
