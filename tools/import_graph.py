"""The import graph of src/: lines per package, files per subpackage, import edges, circles, deferred imports.

    python tools/import_graph.py            # the summary
    python tools/import_graph.py --edges    # every edge, importer -> imported

Reads the source with `ast` only (nothing is imported), so anyone can run it with any Python 3.11+.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGES = ("model_utils", "dskit")


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(src: Path = SRC, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((src / package).rglob("*.py")):
            found[module_name(path, src)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The known module `name` is, or the nearest known package above it."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported module, deferred) for each import of a known module in `path`; deferred = inside a function."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, deferred: bool, in_type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner_deferred = deferred or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target = _resolve(alias.name, known)
                    if target:
                        found.append((target, deferred))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in child.names:
                    target = _resolve(f"{base}.{alias.name}", known) or _resolve(base, known)
                    if target:
                        found.append((target, deferred))
            visit(child, inner_deferred, in_type_checking)

    visit(tree, False, False)
    return [(target, deferred) for target, deferred in found if target != name]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def graph(
    src: Path = SRC, packages: tuple[str, ...] = PACKAGES
) -> tuple[dict[str, Path], dict[str, set[str]], dict[str, set[str]]]:
    """(modules, all edges, deferred edges); imports under `if TYPE_CHECKING:` count (they couple modules too)."""
    known = modules(src, packages)
    edges: dict[str, set[str]] = defaultdict(set)
    deferred: dict[str, set[str]] = defaultdict(set)
    for name, path in known.items():
        for target, is_deferred in imports(name, path, known):
            edges[name].add(target)
            if is_deferred:
                deferred[name].add(target)
    return known, edges, deferred


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(edges) | {t for targets in edges.values() for t in targets}):
        if node not in index:
            connect(node)
    return sorted(found)


def levels(known: dict[str, Path], edges: dict[str, set[str]]) -> int:
    """The longest import chain (modules in it), circles collapsed to one node."""
    depth: dict[str, int] = {}

    def walk(node: str, seen: frozenset[str]) -> int:
        if node in depth:
            return depth[node]
        below = [walk(t, seen | {node}) for t in edges.get(node, ()) if t not in seen]
        depth[node] = 1 + max(below, default=0)
        return depth[node]

    return max((walk(name, frozenset()) for name in known), default=0)


def layer_of(module: str, layers: tuple[tuple[str, ...], ...], package: str = "model_utils") -> int | None:
    """The index in `layers` of the package (or top-level module) `module` belongs to, None when undeclared."""
    part = module.split(".")[1] if module.count(".") else None
    return next((i for i, names in enumerate(layers) if part in names), None)


def upward(
    edges: dict[str, set[str]], layers: tuple[tuple[str, ...], ...], package: str = "model_utils"
) -> list[str]:
    """The imports (`edges`: every one, deferred and TYPE_CHECKING included) of a module of `package` from a layer
    above its own, and its modules in no layer, each as one line."""
    found = []
    for source, targets in sorted(edges.items()):
        if not source.startswith(package + "."):
            continue
        mine = layer_of(source, layers, package)
        if mine is None:
            found.append(f"{source}: in no layer")
            continue
        for target in sorted(targets):
            theirs = layer_of(target, layers, package) if target.startswith(package + ".") else None
            if theirs is not None and theirs > mine:
                found.append(f"{source} -> {target}: layer {theirs} above {mine}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every edge")
    args = parser.parse_args(argv)
    known, edges, deferred = graph()
    if args.edges:
        for source in sorted(edges):
            for target in sorted(edges[source]):
                print(f"{source} -> {target}{'  (deferred)' if target in deferred[source] else ''}")
        return 0
    for package in PACKAGES:
        files = [p for n, p in known.items() if n == package or n.startswith(package + ".")]
        lines = sum(len(p.read_text().splitlines()) for p in files)
        print(f"{package}: {lines} lines in {len(files)} files")
        groups: dict[str, int] = defaultdict(int)
        for n, p in known.items():
            if n.startswith(package + "."):
                rest = p.relative_to(SRC / package).parts
                groups[rest[0] if len(rest) > 1 else "(top level)"] += 1
        for group, count in sorted(groups.items()):
            print(f"  {group}: {count} files")
    internal = sum(len(t) for t in edges.values())
    print(
        f"import edges between modules: {internal} ({sum(len(t) for t in deferred.values())} inside functions)"
    )
    print(f"longest import chain: {levels(known, edges)} modules")
    found = circles(edges)
    print(f"import circles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    return 0


if __name__ == "__main__":
    sys.exit(main())
