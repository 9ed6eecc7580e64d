"""Tests mirror the code: every runtime module src/model_utils/<sub>/<mod>.py has its unit tests in
tests/unit/<sub>/test_<mod>.py (a top-level one, src/model_utils/<mod>.py, in tests/unit/test_<mod>.py)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "src" / "model_utils"
UNIT = REPO / "tests" / "unit"


def mirrored_test(module: Path) -> Path:
    """Where the unit tests of a runtime module live."""
    relative = module.relative_to(RUNTIME)
    return UNIT / relative.parent / f"test_{relative.stem}.py"


def runtime_modules() -> list[Path]:
    return sorted(p for p in RUNTIME.rglob("*.py") if p.name != "__init__.py")


def test_mirrored_test_path() -> None:
    assert mirrored_test(RUNTIME / "checkpoint" / "protocol.py") == UNIT / "checkpoint" / "test_protocol.py"
    assert mirrored_test(RUNTIME / "errors.py") == UNIT / "test_errors.py"


def test_every_runtime_module_has_its_test_file() -> None:
    modules = runtime_modules()
    assert len(modules) > 40  # the subpackages' modules, not only the top level
    missing = [str(mirrored_test(m).relative_to(REPO)) for m in modules if not mirrored_test(m).is_file()]
    assert not missing, "runtime modules without their unit test file; add: " + ", ".join(missing)
