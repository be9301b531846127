"""The client package's own import rules: no part of ``inference/client/`` imports client.py
(the ``Client`` is the package's entry point, not a hub its parts read settings from: they get a
``RequestContext``), only the public surface built on top of it (hf_model.py, the synchronous
Hugging Face style client); and the package's modules import each other without a cycle.
Every import counts, those under ``if TYPE_CHECKING:`` and inside functions included."""

import ast
from pathlib import Path

from shardnet.testing.helpers import REPO_ROOT

PACKAGE = "shardnet.inference.client"
ENTRY = f"{PACKAGE}.client"
#: modules built on ``Client`` (users of it, as an application is), not parts of it
BUILT_ON_CLIENT = {f"{PACKAGE}.hf_model"}


def package_imports(root: Path) -> dict[str, set[str]]:
    """For each module of the package under ``root``: the modules of the package it imports."""
    modules = {f"{PACKAGE}.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = PACKAGE if node.level == 1 else (node.module or "")
                if node.level == 1 and node.module:
                    base = f"{PACKAGE}.{node.module}"
                found |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_part_of_the_client_imports_client_py():
    graph = package_imports(REPO_ROOT / "shardnet" / "inference" / "client")
    assert ENTRY in graph
    assert sorted(m for m, deps in graph.items() if ENTRY in deps and m not in BUILT_ON_CLIENT) == []


def test_the_client_package_has_no_import_cycle():
    assert cycle(package_imports(REPO_ROOT / "shardnet" / "inference" / "client")) is None


def test_the_checks_catch_a_cycle_and_an_import_of_client_py(tmp_path):
    (tmp_path / "client.py").write_text("from shardnet.inference.client.session import open_session\n")
    (tmp_path / "session.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .client import Client\n")
    (tmp_path / "decode.py").write_text("def f():\n    from shardnet.inference.client import session\n")
    graph = package_imports(tmp_path)
    assert graph[f"{PACKAGE}.session"] == {ENTRY} and graph[f"{PACKAGE}.decode"] == {f"{PACKAGE}.session"}
    assert cycle(graph) == [ENTRY, f"{PACKAGE}.session", ENTRY]
