"""The dependency rule: inference -> protocols -> transport, never upwards, and transport and
protocols never import torch (or anything else from the model stack). Inside inference/, the client
and the server never import each other, and model/ imports neither (nor the network); weights/
(moving a model's bytes) imports neither role nor torch. In protocols/
only the ``*_io.py`` drivers import trio; the rest is sans-IO."""

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

from shardnet.testing.helpers import REPO_ROOT
from shardnet.testing.imports import import_statements

ROOT = REPO_ROOT / "shardnet"
FORBIDDEN = {
    "transport": ("torch", "transformers", "safetensors", "tokenizers", "numpy",
                  "shardnet.inference", "shardnet.protocols"),
    "protocols": ("torch", "transformers", "safetensors", "tokenizers", "shardnet.inference"),
    # the requester and the compute peer meet only on the wire and in the activation router
    "inference/client": ("shardnet.inference.server",),
    "inference/server": ("shardnet.inference.client",),
    # what a model is does not depend on who runs it, nor on the network
    "inference/model": ("shardnet.inference.client", "shardnet.inference.server", "shardnet.transport",
                        "shardnet.inference.weights"),
    # moving a model's bytes is used by both roles and needs no model stack
    "inference/weights": ("shardnet.inference.client", "shardnet.inference.server", "torch", "transformers"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path``, relative ones resolved. ``from a import b``
    yields both ``a`` and ``a.b``: b may be a module (``from .. import server``)."""
    package = "shardnet." + ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for line, mod, names in import_statements(path, package):
        out.append((line, mod))
        out += [(line, f"{mod}.{n}") for n in names or () if n != "*"]
    return out


def forbidden_imports(path: Path, forbidden) -> list[str]:
    """One line per import statement of ``path`` that names a module under any of ``forbidden``."""
    bad: dict[int, str] = {}
    for lineno, mod in imported_modules(path):
        if lineno not in bad and any(mod == f or mod.startswith(f + ".") for f in forbidden):
            bad[lineno] = f"{path.relative_to(ROOT.parent)}:{lineno} imports {mod}"
    return [bad[n] for n in sorted(bad)]


def violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        bad += forbidden_imports(path, FORBIDDEN[layer])
    return bad


def test_transport_imports_nothing_above_it():
    assert violations("transport") == []


def test_protocols_import_no_model_code():
    assert violations("protocols") == []


def test_the_checker_catches_a_violation(tmp_path, monkeypatch):
    # The rule above must be able to fail: plant a file that breaks it.
    fake = tmp_path / "shardnet"
    (fake / "transport").mkdir(parents=True)
    (fake / "transport" / "bad.py").write_text("import torch\nfrom ..inference import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    found = violations("transport")
    assert len(found) == 2, found


def test_importing_the_overlay_loads_no_torch():
    code = ("import sys, shardnet.transport, shardnet.protocols, shardnet.protocols.echo; "
            "bad = [m for m in ('torch', 'transformers', 'shardnet.inference') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_client_never_imports_the_server():
    assert violations("inference/client") == []


def test_the_server_never_imports_the_client():
    assert violations("inference/server") == []


def test_the_model_imports_neither_client_server_nor_network():
    assert violations("inference/model") == []


def test_the_checker_catches_client_server_and_model_violations(tmp_path, monkeypatch):
    fake = tmp_path / "shardnet"
    for layer in ("client", "server", "model"):
        (fake / "inference" / layer).mkdir(parents=True)
    (fake / "inference" / "client" / "bad.py").write_text(
        "from ..server.compute_peer import join_swarm\nfrom .. import server\nfrom . import routing\n")
    (fake / "inference" / "server" / "bad.py").write_text(
        "def f():\n    from shardnet.inference.client import session\n")
    (fake / "inference" / "model" / "bad.py").write_text(
        "from shardnet.transport.errors import ShardnetError\nfrom ..client import decode\n"
        "import shardnet.inference.server\nfrom shardnet.protocols import activation\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert len(violations("inference/client")) == 2, violations("inference/client")
    assert len(violations("inference/server")) == 1, violations("inference/server")
    assert len(violations("inference/model")) == 3, violations("inference/model")


def trio_outside_io_modules() -> list[str]:
    """protocols/ is sans-IO; its trio drivers are the ``*_io.py`` modules."""
    bad = []
    for path in sorted((ROOT / "protocols").rglob("*.py")):
        if not path.stem.endswith("_io"):
            bad += forbidden_imports(path, ("trio",))
    return bad


def test_protocols_import_trio_only_in_io_modules():
    assert trio_outside_io_modules() == []


def test_the_checker_catches_trio_outside_io_modules(tmp_path, monkeypatch):
    fake = tmp_path / "shardnet"
    (fake / "protocols").mkdir(parents=True)
    (fake / "protocols" / "codec.py").write_text("import trio\nfrom trio import testing\n")
    (fake / "protocols" / "codec_io.py").write_text("import trio\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    found = trio_outside_io_modules()
    assert len(found) == 2 and all("codec.py" in f for f in found), found


def modules_loaded_by(statement: str, watched: tuple[str, ...], path: Path | None = None) -> list[str]:
    """Which of ``watched`` a fresh interpreter has loaded after ``statement`` (``path``: first on sys.path)."""
    code = (f"import sys; {statement}; "
            f"print(' '.join(m for m in {watched!r} if m in sys.modules))")
    env = None
    if path is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


HEAVY = ("libp2p", "trio", "torch", "transformers", "shardnet.transport", "shardnet.inference")


def sans_io_protocol_modules(root: Path) -> list[str]:
    """Every module of ``root``/protocols but its ``*_io.py`` drivers (those run on trio and libp2p)."""
    return sorted(f"shardnet.protocols.{p.stem}" for p in (root / "protocols").glob("*.py")
                  if not p.stem.endswith("_io") and p.stem != "__init__")


def test_importing_the_protocols_loads_no_libp2p_trio_or_torch():
    # Each sans-IO protocol module, not only the package: block_claim, receipts and receipt_gossip
    # sign and verify with py-libp2p's keys and peer IDs, imported inside those functions, so a
    # user of their types, tables and codecs pays for no network stack until it signs or verifies.
    modules = sans_io_protocol_modules(ROOT)
    assert {"shardnet.protocols.block_claim", "shardnet.protocols.receipts",
            "shardnet.protocols.receipt_gossip"} <= set(modules), modules
    assert modules_loaded_by("import " + ", ".join(modules), HEAVY) == []
    # shardnet/__init__ resolves open_node & co. lazily
    assert modules_loaded_by("import shardnet", HEAVY) == []


def test_the_import_check_sees_what_a_module_loads(tmp_path):
    (tmp_path / "heavy_pkg").mkdir()
    (tmp_path / "heavy_pkg" / "__init__.py").write_text("import trio\n")
    assert modules_loaded_by("import heavy_pkg", HEAVY, tmp_path) == ["trio"]


def test_the_package_root_still_exports_the_overlay():
    code = ("import shardnet, shardnet.transport as t, shardnet.errors as e; "
            "assert (shardnet.Node, shardnet.NodeConfig, shardnet.Stream, shardnet.open_node) == "
            "(t.Node, t.NodeConfig, t.Stream, t.open_node); "
            "assert shardnet.ShardnetError is e.ShardnetError is t.ShardnetError; "
            "from shardnet import open_node, Node, NodeConfig, Stream, ShardnetError; "
            "assert set(shardnet.__all__) <= set(dir(shardnet)); print(shardnet.__version__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "0.1.0", r.stdout + r.stderr


# py-libp2p's private attributes are read only in shardnet/transport/compat/ -----------------------
# An attribute whose name starts with "_" (not a dunder), on anything but ``self``/``cls``, that
# py-libp2p itself defines (``self._x = ``, ``def _x``, a private module name) and shardnet's own
# code (outside compat/) does not: shardnet's objects may use private names between their own
# modules, and those never collide with an upstream one unless shardnet defines it too, which is
# the rule's blind spot (a reach-in to such a name passes). getattr/setattr/hasattr with a literal
# name count as attribute accesses.
COMPAT = ROOT / "transport" / "compat"
_ATTR_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(files) -> set[str]:
    names: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if _private(n)}


def _private_accesses(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_CALLS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            out.append((node.lineno, node.args[1].value))
    return out


@functools.cache
def _libp2p_private_names() -> frozenset[str]:
    import libp2p

    return frozenset(_defined_private_names(Path(libp2p.__file__).parent.rglob("*.py")))


def upstream_private_reach_ins() -> list[str]:
    ours = [p for p in sorted(ROOT.rglob("*.py")) if COMPAT not in p.parents]
    upstream = _libp2p_private_names() - _defined_private_names(ours)
    return [f"{p.relative_to(ROOT.parent)}:{line} uses py-libp2p's private {name}"
            for p in ours for line, name in _private_accesses(p) if name in upstream]


def test_only_compat_touches_libp2p_private_attributes(tmp_path, monkeypatch):
    assert upstream_private_reach_ins() == []
    # the rule must be able to fail: plant reach-ins (one in compat/, which may)
    fake = tmp_path / "shardnet"
    (fake / "transport" / "compat").mkdir(parents=True)
    (fake / "transport" / "bad.py").write_text(
        "def f(swarm, conn):\n"
        "    swarm._negative_peer_cache.evict('x')\n"
        "    return getattr(conn, '_connection_type', None)\n")
    (fake / "transport" / "compat" / "swarm.py").write_text("def g(swarm):\n    swarm._negative_peer_cache.evict('x')\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    monkeypatch.setattr(sys.modules[__name__], "COMPAT", fake / "transport" / "compat")
    found = upstream_private_reach_ins()
    assert len(found) == 2 and all("bad.py" in f for f in found), found
