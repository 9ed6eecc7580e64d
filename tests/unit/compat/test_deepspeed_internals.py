"""DeepSpeed's compile decorator factory, replaced while its Muon module is imported (launch/startup.py): an
upgrade that moves it fails here, by name."""

from __future__ import annotations

from model_utils.compat import deepspeed_internals
from model_utils.launch import startup


def test_the_decorator_factory_is_replaced_inside_and_restored_after() -> None:
    startup.import_deepspeed()
    from deepspeed.runtime import compiler

    assert callable(getattr(compiler, "compile", None)), (
        "deepspeed.runtime.compiler.compile is gone: update src/model_utils/compat/deepspeed_internals.py"
    )
    original = compiler.compile
    marker = object()
    with deepspeed_internals.compile_decorator_replaced(lambda: marker):
        assert compiler.compile() is marker
    assert compiler.compile is original
