"""No import cycles in shardnet/ or bench/. The graph is read from the source (``ast``): every
``import`` and ``from ... import`` statement counts, those under ``if TYPE_CHECKING:`` and inside
functions too, since a cycle that only a lazy or type-only import closes is still two modules that
each need the other. An edge goes from the importing module to the module it names; for
``from pkg import name`` to ``pkg.name`` when that is a module, else to ``pkg`` (whose
``__init__`` runs). Importing ``a.b.c`` also runs ``a`` and ``a.b``: those implicit edges are not
counted (every package's ``__init__`` importing its own submodules would be a cycle)."""

import sys
from pathlib import Path

from shardnet.testing.helpers import REPO_ROOT
from shardnet.testing.imports import import_statements

PACKAGES = ("shardnet", "bench")

#: Cycles another change is removing (issue 34: the client's modules import client.py's types);
#: each entry is one cycle's modules, which must then be exactly a strongly connected component.
KNOWN_CYCLES_IN_PROGRESS: tuple[frozenset[str], ...] = ()


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module of ``modules``) for every import statement of ``name`` (the file ``path``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(mod: str) -> str | None:
        """``mod`` or its nearest parent that is one of ours (``import a.b.c`` names a.b.c)."""
        while mod and mod not in modules:
            mod = mod.rpartition(".")[0]
        return mod or None

    out = []
    for line, mod, names in import_statements(path, package):
        if names is None:
            out.append((line, known(mod)))
        else:
            out += [(line, f"{mod}.{n}" if f"{mod}.{n}" in modules else known(mod)) for n in names]
    return [(line, m) for line, m in out if m is not None and m != name]


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it}."""
    modules = modules_of(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for line, mod in imports_of(name, path, modules):
            edges.setdefault(mod, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found, key=sorted)


def describe(graph: dict[str, dict[str, int]], component: frozenset[str], root: Path) -> str:
    """The component's modules and the imports between them (file:line), one per line."""
    modules = modules_of(root)
    edges = [f"    {modules[a].relative_to(root)}:{line} imports {b}"
             for a in sorted(component) for b, line in sorted(graph[a].items()) if b in component]
    return "cycle among " + ", ".join(sorted(component)) + "\n" + "\n".join(edges)


def unexpected_cycles(root: Path) -> list[str]:
    graph = import_graph(root)
    return [describe(graph, c, root) for c in cycles(graph) if c not in KNOWN_CYCLES_IN_PROGRESS]


def test_no_import_cycles_in_shardnet_or_bench():
    found = unexpected_cycles(REPO_ROOT)
    assert not found, "\n".join(found)


def test_the_known_cycles_still_exist():
    # an entry that no longer matches a cycle (removed, or grown) must leave the list
    graph = import_graph(REPO_ROOT)
    assert set(KNOWN_CYCLES_IN_PROGRESS) <= set(cycles(graph)), cycles(graph)


def test_the_checker_finds_cycles_of_every_kind_of_import(tmp_path):
    pkg = tmp_path / "shardnet"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")  # package -> submodule: no cycle
    (pkg / "sub" / "a.py").write_text("import shardnet.sub.b\nA = 1\n")
    (pkg / "sub" / "b.py").write_text(  # closed only by a type-only import
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shardnet.sub.a import A\n")
    (pkg / "c.py").write_text("def f():\n    from . import d\n")  # closed only by a lazy import
    (pkg / "d.py").write_text("from .c import f\n")
    (pkg / "e.py").write_text("from shardnet.sub import A\n")  # names the package: no cycle with sub.a
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "x.py").write_text("from bench import y\n")
    (tmp_path / "bench" / "y.py").write_text("from .x import *\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [frozenset({"bench.x", "bench.y"}), frozenset({"shardnet.c", "shardnet.d"}),
                             frozenset({"shardnet.sub.a", "shardnet.sub.b"})]
    assert graph["shardnet.e"] == {"shardnet.sub": 1} and graph["shardnet.sub"] == {"shardnet.sub.a": 1}
    assert len(unexpected_cycles(tmp_path)) == 3
    assert "shardnet/sub/b.py:3 imports shardnet.sub.a" in describe(graph, cycles(graph)[2], tmp_path)
