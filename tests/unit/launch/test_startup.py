"""DeepSpeed's start-up without the work dskit never uses: a compile deferred to the first call; the entry points'
collector setting. The fresh-process checks (no MLflow import, one CPU probe per process, nothing a rank does not use): tests/e2e/test_startup.py."""

from __future__ import annotations

import gc

import pytest

from model_utils.launch import startup


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


def _full_collections_while_building(objects: int) -> int:
    """Full collections while `objects` long-lived containers are made (as imports make modules' objects)."""
    full = 0

    def count(phase: str, info: dict) -> None:
        nonlocal full
        full += phase == "start" and info["generation"] == 2

    gc.collect()
    gc.callbacks.append(count)
    try:
        kept = [[i] for i in range(objects)]  # lists stay tracked (a dict of ints is untracked)
    finally:
        gc.callbacks.remove(count)
    assert len(kept) == objects
    return full


def test_an_entry_point_makes_full_collections_rare() -> None:
    """A process building as many long-lived objects as the kit's imports make: CPython's defaults walk them all
    in several full collections, the entry points' setting in none."""
    threshold = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # CPython's defaults
        assert _full_collections_while_building(400_000) >= 3
        startup.fewer_full_collections()
        assert gc.get_threshold()[:2] == (700, 10)  # the young generations as they were
        assert _full_collections_while_building(400_000) == 0
    finally:
        gc.set_threshold(*threshold)
