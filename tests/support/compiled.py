"""Whether nn.Module.compile() was applied to a module (its calls then go through the compiled graph): torch keeps
it in a private attribute, which the tests read (the runtime never needs to)."""

from __future__ import annotations

from typing import Any


def compiled_in_place(module: Any) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None
