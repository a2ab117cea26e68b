"""The project's import graph, read from the source with `ast` (type-only imports under
`if TYPE_CHECKING:` count like any other): its circles (strongly connected components of more
than one module), its upward edges (a floor importing a floor above it: scripts/bench/tools ->
server -> engine -> models -> kernels), the folders' `__init__` docstrings, and every import
between rooms against the table of allowed ones (tools/rooms.py).

    python -m tools.import_graph    # from the checkout's root; exits 1 on a circle or upward edge
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from tools.rooms import violations

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "engine", "models", "kernels")  # top floor first
FLOOR = {name: i for i, name in enumerate(PACKAGES)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _imported(tree: ast.AST, here: str, is_package: bool) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + is_package]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            yield stem
            yield from (f"{stem}.{alias.name}" for alias in node.names)


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a `from package import name` whose name is a
    submodule is an edge to that submodule; to the package otherwise)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = {
            t
            for t in _imported(tree, name, path.name == "__init__.py")
            if t in modules and t != name
        }
        edges[name] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module. A package's
    `__init__` re-exporting its own submodules is not a circle: the package is the room itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def inside(a: str, b: str) -> bool:
        return b.startswith(a + ".")

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if inside(v, w):  # a package importing its own submodules
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if FLOOR[b.split(".")[0]] < FLOOR[a.split(".")[0]]
    )


def undocumented_rooms(modules: dict[str, Path]) -> list[str]:
    return sorted(
        name
        for name, path in modules.items()
        if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text()))
    )


def main() -> int:
    modules = project_modules()
    edges = graph(modules)
    found, up, bare = circles(edges), upward(edges), undocumented_rooms(modules)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    off_table = violations(edges, packages)
    n_edges = sum(len(t) for t in edges.values())
    print(f"{len(modules)} modules, {n_edges} import edges (type-only included)")
    print(f"circles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    print(f"upward imports: {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")
    print(f"rooms without a docstring: {len(bare)} {' '.join(bare)}")
    print(f"imports the room table does not allow (tools/rooms.py): {len(off_table)}")
    for a, b in off_table:
        print(f"  {a} -> {b}")
    return 1 if found or up or bare or off_table else 0


if __name__ == "__main__":
    raise SystemExit(main())
