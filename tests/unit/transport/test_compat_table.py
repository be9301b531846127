"""The declared table of py-libp2p patches (shardnet/transport/compat/): every target exists in the
installed py-libp2p, every named test exists, nothing in compat patches outside the table, and
apply() refuses another py-libp2p version with one clear line."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from importlib import metadata
from pathlib import Path

import pytest

from shardnet.errors import ShardnetError
from shardnet.testing.helpers import REPO_ROOT
from shardnet.transport import compat

COMPAT_DIR = REPO_ROOT / "shardnet" / "transport" / "compat"
ALL = compat.PATCHES + compat.SETTINGS


def _assigned_on_self(cls: type) -> set[str]:
    """Attribute names a class's methods assign on ``self`` (instance attributes, which the class
    object itself does not have until a patch turns one into a property)."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def resolve(target: str) -> object:
    """The upstream object a table target names ("module:Qual.name")."""
    module_name, _, qualname = target.partition(":")
    obj: object = importlib.import_module(module_name)
    parts = qualname.split(".") if qualname else []
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif i == len(parts) - 1 and isinstance(obj, type) and part in _assigned_on_self(obj):
            return obj  # an instance attribute of that class
        else:
            raise AttributeError(f"{target}: {part!r} not found")
    return obj


@pytest.mark.parametrize("patch", ALL, ids=lambda p: p.target)
def test_every_target_resolves_in_the_installed_libp2p(patch):
    assert patch.target.split(".")[0].split(":")[0] == "libp2p", patch.target
    resolve(patch.target)


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


@pytest.mark.parametrize("patch", ALL, ids=lambda p: p.target)
def test_every_named_test_exists(patch):
    path, _, name = patch.test.partition("::")
    assert name.startswith("test_") or "::test_" in name, patch.test
    file = REPO_ROOT / path
    assert file.is_file(), f"{patch.target}: no test file {path}"
    assert name.split("[")[0] in _tests_in(file), f"{patch.target}: no test {patch.test}"


def test_entries_are_declared_completely():
    for p in ALL:
        assert p.how in ("wrap", "replace"), p
        assert p.why and "\n" not in p.why, p
    assert all(p.install is not None for p in compat.PATCHES)
    assert all(p.install is None for p in compat.SETTINGS)
    installs = [p.install for p in compat.PATCHES]
    assert len(set(installs)) == len(installs), "one installer per entry"


def _assigns_attributes(fn: ast.FunctionDef) -> bool:
    """Whether a function's own body (not its nested functions) assigns an attribute of
    anything but ``self``: what a patch installer does."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                    return True
        todo.extend(ast.iter_child_nodes(node))
    return False


def test_nothing_in_compat_patches_outside_the_table():
    # The named setters the rest of shardnet calls with a node's values: a setting listed in
    # SETTINGS, and one node's own DHT (not process-wide).
    setters = {("yamux", "set_keepalive_interval"), ("kad", "set_inbound_request_streams")}
    installers = {(p.install.__module__.rsplit(".", 1)[1], p.install.__name__) for p in compat.PATCHES}
    found = set()
    for path in sorted(COMPAT_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and _assigns_attributes(node):
                found.add((path.stem, node.name))
    assert found - setters == installers


def test_a_libp2p_version_mismatch_fails_apply_in_one_clear_line(monkeypatch):
    installed = []
    stub = dataclasses.replace(compat.PATCHES[0], install=lambda: installed.append(1))
    monkeypatch.setattr(compat, "PATCHES", (stub,))
    monkeypatch.setattr(compat, "_applied", False)
    monkeypatch.setattr(metadata, "version", lambda name: "0.9.0" if name == "libp2p" else "?")
    with pytest.raises(ShardnetError) as caught:
        compat.apply()
    message = str(caught.value)
    assert caught.value.code == "unsupported_libp2p"
    assert "\n" not in message
    assert "found 0.9.0" in message and "0.8.1" in message and "process-wide" in message, message
    assert installed == [] and compat._applied is False  # nothing patched; the next call checks again
    with pytest.raises(ShardnetError):
        compat.apply()

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    with pytest.raises(ShardnetError, match="none installed"):
        compat.apply()


def test_apply_installs_each_patch_once_on_the_supported_version(monkeypatch):
    installed = []
    stubs = tuple(dataclasses.replace(p, install=lambda i=i: installed.append(i))
                  for i, p in enumerate(compat.PATCHES[:3]))
    monkeypatch.setattr(compat, "PATCHES", stubs)
    monkeypatch.setattr(compat, "_applied", False)
    monkeypatch.setattr(metadata, "version", lambda name: compat.SUPPORTED_LIBP2P)
    compat.apply()
    compat.apply()
    assert installed == [0, 1, 2]


def test_the_installed_libp2p_is_the_supported_one():
    assert metadata.version("libp2p") == compat.SUPPORTED_LIBP2P
