"""The import graph of `moeflow` has no cycle, counting every import a module can run.

An edge A -> B is any of these in A's source:
    * an `import` / `from ... import` anywhere in the file: module level, inside a function
      (run at call time), under `if TYPE_CHECKING:`; relative imports resolved;
    * a lazy export: a string in the dict a package hands to `moeflow._lazy.lazy_exports`
      (imported when the attribute is first read);
    * `importlib.import_module("moeflow....")` with a literal name.
B is the longest `moeflow.*` prefix of the imported name that is a module or a package (a
package counts as its `__init__`); `from P import N` is an import of `P.N` when that is a
module, else of `P`. The parent packages Python initialises on the way are not edges: a
package's `__init__` importing its own submodules is the ordinary layout, not a cycle.

A cycle hidden behind a function-level import still fails: it works only in the import
orders someone happened to try, and it hides which module is the lower one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "moeflow"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _dict_literals(tree: ast.Module) -> dict[str, ast.Dict]:
    """Module-level `NAME = {...}` / `NAME: T = {...}` dict literals, by name."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            out.update({t.id: node.value for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict) and isinstance(node.target, ast.Name):
            out[node.target.id] = node.value
    return out


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _imported_names(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(imported dotted name, line, how) for every import in the module's source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    dicts = _dict_literals(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno, "import") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in modules else mod, node.lineno, "from-import"))
        elif isinstance(node, ast.Call) and node.args:
            fn, first = _call_name(node), node.args[0]
            if fn == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.append((first.value, node.lineno, "import_module"))
            elif fn == "lazy_exports" and len(node.args) >= 3 and isinstance(node.args[2], ast.Name):
                exports = dicts.get(node.args[2].id)
                assert exports is not None, f"{path}:{node.lineno}: lazy_exports of {node.args[2].id}: no dict literal"
                out.extend((v.value, node.lineno, "lazy export") for v in exports.values
                           if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return out


def import_graph() -> dict[str, dict[str, tuple[int, str]]]:
    """module -> {imported moeflow module: (line of the first such import, how)}."""
    modules = _modules()
    graph: dict[str, dict[str, tuple[int, str]]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line, how in _imported_names(name, path, modules):
            if target != "moeflow" and not target.startswith("moeflow."):
                continue
            while target not in modules:  # moeflow.x.y.attr -> moeflow.x.y
                target = target.rpartition(".")[0]
            if target != name:
                edges.setdefault(target, (line, how))
    return graph


def find_cycle(graph: dict[str, dict[str, tuple[int, str]]], within: set[str] | None = None) -> list[str] | None:
    """One cycle [a, b, ..., a] of the graph (among the nodes `within`), or None. Iterative DFS."""
    nodes = set(graph) if within is None else within
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def succ(v: str):
        return iter(sorted(w for w in graph.get(v, {}) if w in nodes))

    for root in sorted(nodes):
        if root in state:
            continue
        path, stack = [root], [succ(root)]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(succ(nxt))
    return None


def find_cycles(graph: dict[str, dict[str, tuple[int, str]]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (strongly connected component)."""
    reach: dict[str, set[str]] = {}
    for root in graph:  # the graph is small: plain reachability sets
        seen, todo = set(), [root]
        while todo:
            for w in graph.get(todo.pop(), {}):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        reach[root] = seen
    groups = {frozenset(w for w in reach[v] if v in reach.get(w, ())) for v in graph if v in reach[v]}
    return [find_cycle(graph, set(g)) for g in sorted(groups, key=sorted)]


def _describe(graph: dict[str, dict[str, tuple[int, str]]], cycle: list[str]) -> str:
    modules = _modules()
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        line, how = graph[a][b]
        lines.append(f"  {modules[a].relative_to(PKG.parent)}:{line} {how} {b}")
    return "\n".join(lines)


def test_graph_sees_every_kind_of_import():
    """The parser finds the edges this test relies on (a silent miss would pass any tree)."""
    g = import_graph()
    assert g["moeflow"]["moeflow.layer"][1] == "lazy export"  # moeflow/__init__.py's _EXPORTS
    assert g["moeflow.routing.select"]["moeflow.routing.gpu"][1] == "import_module"
    assert "moeflow.hf.patch" in g["moeflow.hf"]  # a package's __init__, relative import
    assert len(g) == len(_modules())


def test_find_cycle_reports_the_cycle():
    g = {"a": {"b": (1, "import")}, "b": {"c": (2, "import")}, "c": {"a": (3, "from-import")}, "d": {}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": (1, "import")}, "b": {}}) is None
    g["d"] = {"e": (4, "import")}
    g["e"] = {"d": (5, "lazy export")}
    assert find_cycles(g) == [["a", "b", "c", "a"], ["d", "e", "d"]]


def test_no_import_cycle():
    g = import_graph()
    cycles = find_cycles(g)
    assert not cycles, (f"{len(cycles)} import cycle(s), counting function-level and lazy imports:\n"
                        + "\n".join(_describe(g, c) for c in cycles))
