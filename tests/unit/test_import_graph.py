"""The package's imports form no circle: no module reaches itself through the `agent.*` modules
it imports, counting every import in the file (module level, inside functions, and those only
read by type checkers under TYPE_CHECKING). A circle is what made a part need its whole owner;
a part is given the narrow port it needs instead (agent/realtime/event_rate.py is such a cut)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in (ROOT / "agent").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("agent"):
            for alias in node.names:  # `from agent.realtime import session` names a module
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else str(node.module))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("agent"))
    return {m for m in found if m in modules and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_finder_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_round_a_circle() -> None:
    modules = _modules()
    assert "agent.realtime.session" in modules and len(modules) > 100
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "agent.realtime.session" in graph["agent.realtime.client_events"]  # (its type is read)
    assert _circles(graph) == []
