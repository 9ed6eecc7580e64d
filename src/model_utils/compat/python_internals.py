"""The interpreter's own end, without its module teardown (launch/process_exit.py): what Py_FinalizeEx does first,
which the standard library runs through two private functions and no public one."""

from __future__ import annotations

import atexit
import threading


def join_threads_and_run_atexit() -> None:
    """Join the non-daemon threads, then run the atexit handlers, as the interpreter's exit does."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
