"""The interpreter's end without its teardown (launch/process_exit.py) rests on two private functions of the
standard library: an upgrade that removes them fails here, by name."""

from __future__ import annotations

import atexit
import subprocess
import sys
import threading

from model_utils.compat import python_internals

EXIT = """
import atexit, os, threading, time
from model_utils.compat import python_internals
threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
atexit.register(lambda: print("atexit ran", flush=True))
python_internals.join_threads_and_run_atexit()
os._exit(0)
"""


def test_the_private_functions_are_there() -> None:
    for module, name in ((threading, "_shutdown"), (atexit, "_run_exitfuncs")):
        assert callable(getattr(module, name, None)), (
            f"{module.__name__}.{name} is gone in Python {sys.version.split()[0]}: update "
            "src/model_utils/compat/python_internals.py (launch/process_exit.py ends processes through it)"
        )


def test_it_joins_the_threads_then_runs_the_atexit_handlers() -> None:
    out = subprocess.run([sys.executable, "-c", EXIT], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["thread done", "atexit ran"]
    assert python_internals.join_threads_and_run_atexit.__module__ == "model_utils.compat.python_internals"
