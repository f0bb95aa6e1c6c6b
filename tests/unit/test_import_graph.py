"""The import graph of `agent/`: no cycle, and serving code never imports the instruments.

Every import counts, the ones inside functions too (they run when the function does), except
those under `if TYPE_CHECKING:` (never run). Importing `a.b.c` runs `a/__init__` and
`a/b/__init__` first, so a module depends on the packages above each module it imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"
INSTRUMENTS = "agent.engine.instruments"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in AGENT.rglob("*.py"):
        parts = list(path.relative_to(AGENT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _with_parents(name: str, mods: dict[str, Path]) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in mods}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    deps |= _with_parents(alias.name, mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                deps |= _with_parents(base, mods)
                for alias in node.names:  # `from pkg import module`
                    if f"{base}.{alias.name}" in mods:
                        deps |= _with_parents(f"{base}.{alias.name}", mods)
        deps.discard(mod)
        # A module's own packages run before it: an import of them is no edge of its own.
        graph[mod] = {d for d in deps if not mod.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_agent() -> None:
    assert _cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_serving_code_never_imports_the_instruments() -> None:
    graph = import_graph()
    serving = [m for m in graph if not m.startswith(INSTRUMENTS)]
    assert serving and INSTRUMENTS in {m.rsplit(".", 1)[0] for m in graph if m.startswith(INSTRUMENTS + ".")}
    offenders = {m: sorted(d for d in graph[m] if d.startswith(INSTRUMENTS)) for m in serving}
    assert {m: d for m, d in offenders.items() if d} == {}
