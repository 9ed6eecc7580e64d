"""DeepSpeed's internals the kit steps around where nothing public does the job."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def compile_decorator_replaced(replacement: Callable[[], Any]) -> Iterator[None]:
    """Inside, DeepSpeed's `deepspeed.runtime.compiler.compile()` decorator factory is `replacement`: modules that
    DeepSpeed imports then (its Muon optimizer) decorate their functions with it at import, which would import
    torch.compile's machinery in every rank (launch/startup.py makes it lazy)."""
    from deepspeed.runtime import compiler

    original = compiler.compile
    compiler.compile = replacement
    try:
        yield
    finally:
        compiler.compile = original
