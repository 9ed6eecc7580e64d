"""A process's end without the interpreter's teardown of its modules.

At exit the interpreter garbage-collects every module it imported: with torch, transformers and DeepSpeed loaded,
~2 CPU-s per process (1.4 of them after the atexit handlers), on every rank and on the launcher's preflight, at
the end of every run. Nothing of the run is left to do then: `exit_now` does what a process's end is observed by
(its non-daemon threads joined, atexit handlers: logging flushed, multiprocessing children joined, temporary
directories removed; stdio flushed), in the interpreter's order, and leaves.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

from model_utils.compat import python_internals


def exit_now(status: int) -> NoReturn:
    python_internals.join_threads_and_run_atexit()  # what Py_FinalizeEx does first
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
