"""A process's end without the interpreter's teardown of its modules.

At exit the interpreter garbage-collects every module it imported: with torch, transformers and DeepSpeed loaded,
~2 CPU-s per process (1.4 of them after the atexit handlers), on every rank and on the launcher's preflight, at
the end of every run. Nothing of the run is left to do then: `exit_now` does what a process's end is observed by
(its non-daemon threads joined, atexit handlers: logging flushed, multiprocessing children joined, temporary
directories removed; stdio flushed), in the interpreter's order, and leaves.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(status: int) -> NoReturn:
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first: join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
