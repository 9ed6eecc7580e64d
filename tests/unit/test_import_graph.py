"""tools/import_graph.py, and the rule it keeps: no import circles anywhere in src/."""

from __future__ import annotations

from pathlib import Path

import import_graph


def write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_src_has_no_import_circles() -> None:
    _, edges, _ = import_graph.graph()
    assert import_graph.circles(edges) == []


def test_a_circle_is_found_through_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    src = write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": "def f():\n    from pkg.sub import b\n",
            "pkg/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n",
            "pkg/c.py": "from .sub.a import f\n",
            "pkg/leaf.py": "import pkg.c\n",
        },
    )
    known, edges, deferred = import_graph.graph(src, ("pkg",))
    assert set(known) == {"pkg", "pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.c", "pkg.leaf"}
    assert import_graph.circles(edges) == [["pkg.c", "pkg.sub.a", "pkg.sub.b"]]
    assert deferred["pkg.sub.a"] == {"pkg.sub.b"}
    assert edges["pkg.leaf"] == {"pkg.c"}


def test_a_tree_without_circles_has_none(tmp_path: Path) -> None:
    src = write_package(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n", "pkg/b.py": ""})
    _, edges, _ = import_graph.graph(src, ("pkg",))
    assert edges["pkg.a"] == {"pkg.b"}
    assert import_graph.circles(edges) == []


def test_the_documented_command_reports_the_structure() -> None:
    """`python tools/import_graph.py` (docs/architecture.md), as a person runs it: no circle, every subpackage."""
    import subprocess
    import sys

    repo = Path(import_graph.__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "tools/import_graph.py"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    assert "import circles: 0" in out
    for sub in (
        "config",
        "resolve",
        "model",
        "optim",
        "data",
        "storage",
        "checkpoint",
        "engines",
        "observe",
        "loop",
    ):
        assert f"  {sub}: " in out, sub
    edges = subprocess.run(
        [sys.executable, "tools/import_graph.py", "--edges"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "model_utils.loop.trainer -> model_utils.engines" in edges
