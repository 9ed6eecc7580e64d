"""Liger's private parts the kit uses where nothing public does the job."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


def apply_to_instance(model: Any, **kernels: bool) -> None:
    """Liger's kernels on one model instance (its public apply_liger_kernel_to_<type> patch a model type's module
    for every model built afterwards, and need the type named): `_apply_liger_kernel_to_instance`."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, **kernels)


@contextlib.contextmanager
def patches_undone(model: Any) -> Iterator[None]:
    """Undo, on exit, what Liger's instance patch changes in the model's modeling module (RoPE is a module-level
    function, the norm and MLP classes are swapped): for a throwaway model (the micro-batch probe) built in a
    process that later builds a plain one (dskit bench's reference). Liger has no undo of its own."""
    module = sys.modules[type(model).__module__]
    saved = dict(vars(module))
    try:
        yield
    finally:
        for name in set(vars(module)) - set(saved):
            delattr(module, name)
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)
