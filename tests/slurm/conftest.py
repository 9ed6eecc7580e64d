"""Timings the SLURM tests measure, printed at the end of the run (they are part of what these tests report)."""

from __future__ import annotations

import pytest

TIMINGS: list[tuple[str, float]] = []


@pytest.fixture(scope="session")
def timing():
    def record(what: str, seconds: float) -> None:
        TIMINGS.append((what, seconds))

    return record


def pytest_terminal_summary(terminalreporter) -> None:
    if TIMINGS:
        terminalreporter.section("SLURM timings")
        for what, seconds in TIMINGS:
            terminalreporter.write_line(f"{what}: {seconds:.1f} s")
