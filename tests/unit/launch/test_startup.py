"""DeepSpeed's start-up without the work dskit never uses: a compile deferred to the first call; the entry points'
collector setting; the CPU probed once per host and boot. The fresh-process checks (no MLflow import, one CPU
probe per host, nothing a rank does not use): tests/e2e/test_startup.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model_utils.launch import startup
from model_utils.repo import REPO_ROOT


def test_lazy_compile_compiles_on_the_first_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

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


# A fresh process (as an entry point starts one: few objects yet) builds as many long-lived objects as the kit's
# imports make, with CPython's default thresholds, then with the entry points' setting.
FULL_COLLECTIONS = """
import gc, sys
from model_utils.launch import startup

def full_collections_while_building(objects):
    full = 0
    def count(phase, info):
        nonlocal full
        full += phase == "start" and info["generation"] == 2
    gc.collect()
    gc.callbacks.append(count)
    kept = [[i] for i in range(objects)]  # lists stay tracked (a dict of ints is untracked)
    gc.callbacks.remove(count)
    return full

gc.set_threshold(700, 10, 10)  # CPython's defaults
default = full_collections_while_building(400_000)
startup.fewer_full_collections()
print(default, full_collections_while_building(400_000), *gc.get_threshold()[:2])
"""


def test_an_entry_point_makes_full_collections_rare() -> None:
    """CPython's defaults walk the objects in several full collections, the entry points' setting in none, the
    young generations as they were."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", FULL_COLLECTIONS], env=env, capture_output=True, text=True, check=True
    ).stdout
    default, ours, young, middle = map(int, out.split())
    assert default >= 3, out
    assert ours == 0, out
    assert (young, middle) == (700, 10)


def test_the_cpu_is_probed_once_per_host_and_boot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first process of a boot probes and leaves the answer in the cache dir; later ones read it. Another boot
    (or another host of a shared filesystem: its own boot id) probes again. A damaged file, no cache dir or no
    boot id: it probes, never fails."""
    probes: list[int] = []

    def probe() -> dict[str, Any]:
        probes.append(1)
        return {"vendor_id_raw": "AuthenticAMD", "flags": ["avx2"], "probe": len(probes)}

    boot = tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    monkeypatch.setattr(startup, "BOOT_ID", boot)
    cache = tmp_path / "extensions"
    first = startup.host_cpu_info(probe, cache)
    assert first["probe"] == 1 and startup.host_cpu_info(probe, cache) == first and len(probes) == 1
    assert [p.name for p in cache.iterdir()] == ["dskit-cpuinfo-boot-a.json"]  # no partial file left
    boot.write_text("boot-b\n")
    assert startup.host_cpu_info(probe, cache)["probe"] == 2
    (cache / "dskit-cpuinfo-boot-b.json").write_text('{"vendor_id_raw": "Auth')  # cut short
    assert startup.host_cpu_info(probe, cache)["probe"] == 3
    assert startup.host_cpu_info(probe, cache)["probe"] == 3  # rewritten whole
    assert startup.host_cpu_info(probe, None)["probe"] == 4
    monkeypatch.setattr(startup, "BOOT_ID", tmp_path / "no-such-file")
    assert startup.host_cpu_info(probe, cache)["probe"] == 5


def test_inside_the_context_every_call_answers_from_one_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cpuinfo

    probes: list[int] = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: probes.append(1) or {"arch": "X86_64"})
    original = cpuinfo.get_cpu_info
    with startup.cpu_info_computed_once(tmp_path):
        assert [cpuinfo.get_cpu_info()["arch"] for _ in range(3)] == ["X86_64"] * 3
    assert cpuinfo.get_cpu_info is original and len(probes) == 1
