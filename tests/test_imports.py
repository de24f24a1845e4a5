"""attnkit's modules import each other in one direction: no import circles.

Reads every module under ``src/attnkit`` with :mod:`ast`, follows every
import of another attnkit module (at module level, inside functions, under
``if TYPE_CHECKING:``), then looks for strongly connected components in that
graph. An import moved inside a function still makes a circle: it only
postpones the ImportError to the first call and hides which module is the
lower layer. Lazy imports of optional third-party packages (matplotlib,
transformers) are not attnkit modules and do not count.

Run it alone to print the graph's circles:

    python tests/test_imports.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "attnkit"

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted((SRC / PACKAGE).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Each attnkit module -> the attnkit modules it imports anywhere in its file."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, is_package, node)
                # `from pkg import sub` imports the submodule pkg.sub; otherwise the name comes from pkg.
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles() -> None:
    """Bug: a module imports one that (directly or through others) imports it back."""
    found = [sorted(c) for c in circles(import_graph())]
    assert found == [], f"import circles among attnkit's modules: {found}"


def test_detector_finds_a_circle() -> None:
    """Bug: the detector itself misses circles (so the tests above would pass on anything)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]


if __name__ == "__main__":
    found = circles(import_graph())
    for members in found:
        print(" <-> ".join(sorted(members)))
    print(f"{len(found)} import circle(s)")
    sys.exit(1 if found else 0)
