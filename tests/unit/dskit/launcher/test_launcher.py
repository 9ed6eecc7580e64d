"""launcher/__init__.py: the launchers' steps run under the host's python3, before the run's environment exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
MODULES = sorted(p.stem for p in (REPO / "src" / "dskit" / "launcher").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_each_step_imports_the_standard_library_and_the_kit_only(module: str) -> None:
    code = (
        f"import json, sys; sys.path.insert(0, {str(REPO / 'src')!r}); import dskit.launcher.{module}; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    # -I: no PYTHONPATH, no user site: what a bare python3 would find
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    imported = set(json.loads(proc.stdout)) - set(sys.stdlib_module_names) - {"__main__"}
    assert imported <= {"dskit", "model_utils", "_distutils_hack"}, imported
