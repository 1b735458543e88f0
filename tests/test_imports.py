"""The package's modules import each other without a cycle, function-level imports included (a cycle held
open by an import inside a function is still a cycle: neither module can be read without the other)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "genspec"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the genspec modules it imports anywhere in its text (``from genspec.x import y`` counts as
    genspec.x.y when that is a module, else genspec.x)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        wanted = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    wanted.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                wanted.update(alias.name for alias in node.names)
        # a package's __init__ runs before its modules: importing genspec.x.y also imports genspec and genspec.x,
        # but those edges are the package faces' and not what a cycle between two modules is made of
        graph[name] = {m for m in wanted if m in modules and m != name and m != "genspec"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a list of modules (first = last), or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_back():
    graph = _imports()
    assert len(graph) > 50 and graph["genspec.engine"]  # the package was read
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))
