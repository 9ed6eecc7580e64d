"""No backend branch outside engines/: everything engine-specific is behind the registry (model_utils.engines).

Outside src/model_utils/engines/ nothing may decide on an engine's name (compare with it, test membership in a
collection of names, match on it, pick from a dict keyed by names, choose between names with `a if c else b`)
nor import an engine's module (the registry imports it, lazily). Naming an engine is fine: a default, a value
handed on (the accelerate config's DEEPSPEED -> --backend deepspeed), a config section's key. One allowance:
`"deepspeed" in sys.modules` asks about the DeepSpeed package, not the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

from model_utils import engines

SRC = Path(__file__).resolve().parents[3] / "src"
ENGINES_DIR = SRC / "model_utils" / "engines"
NAMES = frozenset(engines.NAMES)
MODULES = frozenset(engines.engine_module(name) for name in engines.NAMES)


def _names_an_engine(node: ast.AST) -> bool:
    """An engine name as a string literal, or a tuple/list/set/dict display holding one."""
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_an_engine(e) for e in node.elts)
    return False


def _is_sys_modules(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "modules"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _imported_engine_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = node.module or ""
    if base in MODULES:
        return [base]
    return [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]


def findings(source: str, filename: str = "<snippet>") -> list[str]:
    """'file:line: what' for every backend branch and engine-module import in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        what = None
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if not any(map(_is_sys_modules, operands)) and any(map(_names_an_engine, operands)):
                what = "compares with an engine name"
        elif isinstance(node, ast.MatchValue) and _names_an_engine(node.value):
            what = "matches an engine name"
        elif isinstance(node, ast.IfExp) and (_names_an_engine(node.body) or _names_an_engine(node.orelse)):
            what = "chooses between engine names"
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Dict)
            and any(k is not None and _names_an_engine(k) for k in node.value.keys)
        ):
            what = "picks from a dict keyed by engine names"
        elif isinstance(node, ast.Import | ast.ImportFrom) and _imported_engine_modules(node):
            what = (
                f"imports {', '.join(_imported_engine_modules(node))} (use model_utils.engines.engine_class)"
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            what = f"names the module {node.value} (use model_utils.engines.engine_class)"
        if what:
            found.append(f"{filename}:{node.lineno}: {what}")
    return found


def test_no_file_outside_engines_branches_on_a_backend() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if not path.is_relative_to(ENGINES_DIR):
            found += findings(path.read_text(), str(path.relative_to(SRC.parent)))
    assert not found, "backend branches outside engines/ (ask the engine's class instead):\n" + "\n".join(
        found
    )


def test_the_check_walks_the_code_it_guards() -> None:
    walked = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if not p.is_relative_to(ENGINES_DIR)}
    assert {"model_utils/loop/trainer.py", "dskit/export.py", "model_utils/checkpoint/protocol.py"} <= walked
    # Every engine's module is guarded, and its name.
    assert sorted(MODULES) == ["model_utils.engines.deepspeed_engine", "model_utils.engines.fsdp_engine"]
    assert sorted(NAMES) == ["deepspeed", "fsdp"]


# The branches there were before the registry, in their own words (trainer, launch_record, memory_estimate,
# resolver, estimate, doctor, run_yaml, bench, arguments: 15 findings), and the other forms a branch takes.
BRANCHES = {
    'if ds.backend == "fsdp":\n    pass': "compares",
    'if self.backend != "fsdp":\n    pass': "compares",
    'x = cfg.optim.backend == "fsdp"': "compares",
    'p = F if (key, raw, base) == ("backend", "fsdp", D) else base': "compares",
    'if backend in ("deepspeed", "fsdp"):\n    pass': "compares",
    'if "fsdp" != backend:\n    pass': "compares",
    'saved = "fsdp" if is_fsdp_tag(tag_dir) else "deepspeed"': "chooses",
    'match backend:\n    case "fsdp":\n        pass': "matches",
    'per_param = {"fsdp": 12, "deepspeed": 16}[backend]': "picks",
    "from model_utils.engines import fsdp_engine": "imports model_utils.engines.fsdp_engine",
    "from model_utils.engines.deepspeed_engine import DeepSpeedEngine": "imports",
    "import model_utils.engines.fsdp_engine": "imports",
    'importlib.import_module("model_utils.engines.deepspeed_engine")': "names the module",
}


def test_each_kind_of_backend_branch_is_found() -> None:
    for snippet, what in BRANCHES.items():
        found = findings(snippet)
        assert len(found) == 1 and what in found[0], (snippet, found)
    assert findings('\n\nif backend == "fsdp":\n    pass', "src/x.py") == [
        "src/x.py:3: compares with an engine name"
    ]


def test_naming_an_engine_without_deciding_on_it_is_allowed() -> None:
    allowed = (
        'if "deepspeed" in sys.modules:\n    pass',  # the package, not the engine
        'return AccelerateRequest("DEEPSPEED", "deepspeed", precision)',
        'backend: str = "deepspeed"',
        'sections = {"deepspeed": config}',
        'version = importlib.metadata.version("deepspeed")',
        "if backend == engines.DEFAULT:\n    pass",
        'if name == "deepspeed_config":\n    pass',
        "from model_utils.engines import deepspeed_config",
        "from model_utils import engines",
    )
    for snippet in allowed:
        assert findings(snippet) == [], snippet
