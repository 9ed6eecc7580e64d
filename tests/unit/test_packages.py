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
