"""DeepSpeed's start-up without the work dskit never uses: a compile deferred to the first call. The fresh-process
checks (no MLflow import, one CPU probe per process, nothing a rank does not use): tests/e2e/test_startup.py."""

from __future__ import annotations

import pytest


def test_lazy_compile_compiles_on_the_first_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from model_utils.launch import startup

    calls = []

    def fake_compile(fn, **options):
        calls.append(options)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    square = startup._lazy_compile(lambda x: x * x)
    with_options = startup._lazy_compile(dynamic=False)(lambda x: x + 1)
    assert calls == []  # decorating compiles nothing
    assert square(3) == ("compiled", 9) and square(4) == ("compiled", 16)
    assert with_options(1) == ("compiled", 2)
    assert calls == [{}, {"dynamic": False}]  # once per function, with its options
