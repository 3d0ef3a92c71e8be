"""No import cycle in the guard package: module-level and function-level imports alike.

The graph is built from the source (the AST of every module under guard/), not by importing it:
an import inside a function is an edge too, since a lazy import that only works because it runs
later is a cycle waiting for someone to move it to the top. Imports under ``if TYPE_CHECKING:``
are left out (they never run). Importing ``guard.a.b`` runs ``guard/a/__init__.py`` first, so it
is an edge to the package as well, except from a module inside that package (its __init__ has
already begun: ``guard/lab/__init__.py`` importing ``guard.lab.lab``, which imports
``guard.lab.etcd``, is no cycle).

The checker is run on synthetic graphs too, so that a checker that finds nothing cannot pass here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "guard"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports_of(child)
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _targets(importer: str, name: str, modules: dict[str, Path]) -> set[str]:
    """``guard.a.b`` -> {guard.a.b, guard.a}: the module and the packages whose __init__ runs first,
    known modules only, without the importer's own packages (already being imported when it runs).
    The root package is left out: every module would depend on it."""
    parts = name.split(".")
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    parents = {".".join(parts[:i]) for i in range(2, len(parts))} - own
    return ({name} | parents) & modules.keys()


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its body)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from guard.http import binding` imports the submodule guard.http.binding;
                # `from guard.lab import Lab` a name of guard/lab/__init__.py.
                targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] == PACKAGE:
                    graph[name] |= _targets(name, target, modules)
        graph[name].discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph is acyclic (iterative depth-first search)."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    for start in sorted(graph):
        if colour[start] != white:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = grey
        while stack:
            node, children = stack[-1]
            for child in children:
                if colour.get(child, black) == grey:
                    return path[path.index(child):] + [child]
                if colour.get(child, black) == white:
                    colour[child] = grey
                    stack.append((child, iter(sorted(graph[child]))))
                    path.append(child)
                    break
            else:
                colour[node] = black
                stack.pop()
                path.pop()
    return None


def test_the_guard_package_has_no_import_cycle() -> None:
    graph = import_graph()
    # The graph is really built: the serving path's known edges are in it.
    assert "guard.engine.checker" in graph["guard.engine.wiring"], graph["guard.engine.wiring"]
    assert {"guard.http.filter", "guard.http.binding", "guard.http.probes"} <= graph["guard.http.app"]
    # A function-level import counts, and importing guard.http.app runs guard/http/__init__.py first.
    assert {"guard.http", "guard.http.app"} <= graph["guard.serving.server"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize(("graph", "cycle"), [
    pytest.param({"a": {"b"}, "b": {"c"}, "c": set()}, None, id="chain"),
    pytest.param({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, None, id="diamond"),
    pytest.param({"a": {"a"}}, ["a", "a"], id="self-loop"),
    pytest.param({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"], id="two"),
    pytest.param({"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}, ["b", "c", "d", "b"], id="behind-a-tail"),
    pytest.param({"x": set(), "a": {"x", "b"}, "b": {"x", "a"}}, ["a", "b", "a"], id="next-to-a-leaf"),
])
def test_find_cycle_on_synthetic_graphs(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


def test_a_lazy_import_back_is_a_cycle(tmp_path: Path) -> None:
    """What guard/http looked like before issue 16: the app imports its routes inside the factory,
    a route imports the app at the top. Function-level imports, relative imports and the package's
    __init__ all count; an import under TYPE_CHECKING does not."""
    pkg = tmp_path / PACKAGE / "http"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text("def create_app():\n    from guard.http import filter\n    return filter\n")
    (pkg / "filter.py").write_text("from .app import create_app\n")
    (tmp_path / PACKAGE / "serving").mkdir()
    (tmp_path / PACKAGE / "serving" / "server.py").write_text("def load():\n    from guard.http.app import create_app\n")
    graph = import_graph(tmp_path)
    assert graph["guard.http.app"] == {"guard.http.filter"}
    assert graph["guard.http.filter"] == {"guard.http.app"}
    assert graph["guard.serving.server"] == {"guard.http", "guard.http.app"}
    assert find_cycle(graph) == ["guard.http.app", "guard.http.filter", "guard.http.app"]

    (pkg / "filter.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from guard.http.app import create_app\n")
    assert find_cycle(import_graph(tmp_path)) is None
