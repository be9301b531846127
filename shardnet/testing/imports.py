"""Import statements read from source (no module is imported): what the layering and import-graph
tests check."""

from __future__ import annotations

import ast
from pathlib import Path


def import_statements(path: Path, package: str) -> list[tuple[int, str, list[str] | None]]:
    """(line, module, names) for every import in the file ``path`` of ``package``, type-only and
    function-local ones included, relative ones resolved: ``import a.b`` gives ``("a.b", None)``,
    ``from a import b, c`` gives ``("a", ["b", "c"])`` (b and c may be modules or names)."""
    out: list[tuple[int, str, list[str] | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod, [a.name for a in node.names]))
    return out
