"""Two packages, one direction: the runtime a training rank imports (src/model_utils, src/train_deepspeed.py)
never imports the tools a person types (src/dskit), which may import the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import import_graph
from model_utils import LAYERS

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


def _private_uses(path: Path) -> list[str]:
    """Another library's underscore names a module reaches for: an attribute of an imported library module
    (`threading._shutdown`), an import of one (`from x import _y`, `import x._y`), a getattr of one by its name."""
    tree = ast.parse(path.read_text())
    ours = ("model_utils", "dskit", "support")
    public = {"os._exit"}  # underscored, and documented as public
    modules: set[str] = set()  # names bound to another library's modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ours:
                    modules.add((alias.asname or alias.name).split(".")[0])
                if any(part.startswith("_") and not part.startswith("__") for part in alias.name.split(".")):
                    found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ours:
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private or any(p.startswith("_") and not p.startswith("__") for p in node.module.split(".")):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
            modules |= {alias.asname or alias.name for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules and ast.unparse(node) not in public:
                found.append(ast.unparse(node))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and not str(node.args[1].value).startswith("__")
        ):
            found.append(ast.unparse(node))
    return found


def test_only_the_compat_adapters_use_other_libraries_private_parts() -> None:
    """No module outside model_utils/compat (one adapter per library, each use tested there: tests/unit/compat)
    reaches into another library's underscore names: an upgrade breaks the adapter's test, not a run."""
    offenders = {
        str(path.relative_to(SRC)): uses
        for path in sorted(SRC.rglob("*.py"))
        if "compat" not in path.relative_to(SRC).parts and (uses := _private_uses(path))
    }
    assert offenders == {}
    adapters = sorted(p.stem for p in (SRC / "model_utils" / "compat").glob("*_internals.py"))
    documented = (SRC.parent / "docs" / "architecture.md").read_text()
    assert adapters and all(f"compat/{name}.py" in documented for name in adapters), adapters


def test_the_private_use_check_finds_each_kind(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import threading\nimport torch._dynamo\nfrom liger_kernel.transformers import _apply\n"
        "from model_utils import launch\nthreading._shutdown()\ngetattr(config, '_attn')\nlaunch._own()\n"
    )
    assert sorted(_private_uses(module)) == [
        "from liger_kernel.transformers import _apply",
        "getattr(config, '_attn')",
        "import torch._dynamo",
        "threading._shutdown",
    ]


def test_no_runtime_module_imports_from_a_layer_above_its_own() -> None:
    """model_utils.LAYERS, over every import of the runtime: module level, inside functions, under TYPE_CHECKING."""
    _, edges, deferred = import_graph.graph()
    assert import_graph.upward(edges, LAYERS) == []
    runtime = {s: t for s, t in edges.items() if s.startswith("model_utils.")}
    assert sum(len(t) for t in runtime.values()) > 300  # the whole runtime's imports, not a part
    assert sum(len(t) for s, t in deferred.items() if s in runtime) > 20  # the function-level ones too
    parts = {p.stem for p in (SRC / "model_utils").glob("*.py") if p.stem != "__init__"}
    parts |= {p.parent.name for p in (SRC / "model_utils").glob("*/__init__.py")}
    assert parts == {name for layer in LAYERS for name in layer}  # every package and module declared, once


def test_the_layer_check_finds_imports_from_above_deferred_and_type_checking_too(tmp_path: Path) -> None:
    root = tmp_path / "model_utils"
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from model_utils.high import b\n",
        "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from model_utils.high.b import B\n",
        "high/__init__.py": "",
        "high/b.py": "from model_utils.low import a\nclass B: ...\n",
        "stray.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    known = import_graph.modules(tmp_path, ("model_utils",))
    edges = {name: {t for t, _ in import_graph.imports(name, path, known)} for name, path in known.items()}
    assert import_graph.upward(edges, (("low",), ("high",))) == [
        "model_utils.low.a -> model_utils.high.b: layer 1 above 0",
        "model_utils.low.c -> model_utils.high.b: layer 1 above 0",
        "model_utils.stray: in no layer",
    ]


def test_the_architecture_doc_draws_the_declared_layers() -> None:
    """docs/architecture.md's Layers block: one line per layer, top first, its names before two spaces."""
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    block = doc[doc.index("## Layers") :].split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [tuple(line.split("  ")[0].split(", ")) for line in block.splitlines() if line.strip()]
    assert drawn == list(reversed(LAYERS))
