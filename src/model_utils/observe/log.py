"""Rank-0 logging: one helper, so no module needs `if rank == 0` for output.

On a terminal, rank 0 also keeps a progress bar on the last line. Log lines never contain it: when stdout is a
pipe (the launchers tee it into logs/), the bar goes straight to the terminal the launcher names in DSKIT_TTY.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from model_utils import launch_env
from model_utils.observe import redact, step_line


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _terminal() -> TextIO | None:
    """Where the bar is drawn: stdout when it is a terminal, else the launcher's terminal, else nowhere."""
    if sys.stdout.isatty():
        return sys.stdout
    path = os.environ.get(launch_env.TTY)
    if path:
        try:
            stream = open(path, "w")  # noqa: SIM115 (kept open for the life of the process)
        except OSError:
            return None
        if stream.isatty():
            return stream
        stream.close()
    return None


class _ProgressBar:
    def __init__(self) -> None:
        self.stream: TextIO | None = None
        self.opened = False
        self.shown = False

    def terminal(self) -> TextIO | None:
        if not self.opened:
            self.stream, self.opened = _terminal(), True
        return self.stream

    def clear(self) -> None:
        # Not redrawn here: a line teed through a pipe may still be on its way; the next step redraws.
        if self.shown and self.stream is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False

    def draw(self, text: str) -> None:
        stream = self.terminal()
        if stream is None:
            return
        stream.write(f"\r\033[K{text}")
        stream.flush()
        self.shown = True


_bar = _ProgressBar()


def print0(message: str) -> None:
    """Print a timestamped line from global rank 0 only (flushed: logs are tailed live), secrets redacted."""
    if _rank() == 0:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        _bar.clear()
        print(f"{stamp} | {redact.text(message)}", flush=True)


def warn0(message: str) -> None:
    print0(f"WARNING: {message}")


def error_line(message: str) -> None:
    """The single line a user sees for a mistake; printed by rank 0 only so N ranks do not repeat it. Every rank
    records it in DSKIT_ERROR_FILE when that is set (the first line on a host wins): a host whose ranks do not
    include rank 0 has its reason too. Secrets redacted (a URI's password, a token flag's value)."""
    message = redact.text(message)
    if _rank() == 0:
        print(step_line.error_line(message), file=sys.stderr, flush=True)
    record_error(message)


def record_error(message: str) -> None:
    """The message into DSKIT_ERROR_FILE when that is set, unless a line came first."""
    if path := os.environ.get(launch_env.ERROR_FILE):
        try:
            with open(path, "x") as f:
                f.write(message + "\n")
        except OSError:
            pass  # written already (first wins), or unwritable: the line is in the log


# How long a rank other than 0 waits after an error every rank raised (let_rank0_print).
LINGER_S = 10.0


def let_rank0_print() -> None:
    """After an error every rank raises alike (a flag, a config), which rank 0 alone prints: a rank that ended
    first would have the launcher end rank 0 (torchrun's close: SIGTERM to the others) before its line is out.
    So the other ranks wait, until the launcher ends them once rank 0 has ended, or LINGER_S."""
    if _rank() != 0:
        time.sleep(LINGER_S)


def progress_shown() -> bool:
    """Whether progress0 draws anything here (rank 0 with a terminal): callers skip composing a bar no one sees."""
    return _rank() == 0 and _bar.terminal() is not None


def progress0(step: int, total: int, detail: str, width: int = 30) -> None:
    """Redraw the progress bar on rank 0's terminal, if any: `[#####.....] 40/100 (40%) <detail>`."""
    if _rank() != 0:
        return
    total = max(total, 1)
    done = min(width, width * step // total)
    _bar.draw(f"[{'#' * done}{'.' * (width - done)}] {step}/{total} ({100 * step // total}%) {detail}")


def end_progress0() -> None:
    if _rank() == 0:
        _bar.clear()
