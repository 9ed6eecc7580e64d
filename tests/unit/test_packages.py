"""Two packages, one direction: the runtime a training rank imports (src/model_utils, src/train_deepspeed.py)
never imports the tools a person types (src/dskit), which may import the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def imported_packages(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_runtime_never_imports_the_tools() -> None:
    runtime = [SRC / "train_deepspeed.py", *sorted((SRC / "model_utils").rglob("*.py"))]
    offenders = [str(p.relative_to(SRC)) for p in runtime if "dskit" in imported_packages(p)]
    assert offenders == []
    assert len(runtime) > 40  # every subpackage's modules, not only the top level


def test_the_tools_use_the_runtime() -> None:
    tools = sorted((SRC / "dskit").rglob("*.py"))
    assert any("model_utils" in imported_packages(p) for p in tools)
    assert not (SRC / "model_utils" / "cli.py").exists()  # the commands live in the tools package
