"""The dependency rule: inference -> protocols -> transport, never upwards, and transport and
protocols never import torch (or anything else from the model stack)."""

import ast
import subprocess
import sys
from pathlib import Path

from shardnet.testing.helpers import REPO_ROOT

ROOT = REPO_ROOT / "shardnet"
FORBIDDEN = {
    "transport": ("torch", "transformers", "safetensors", "tokenizers", "numpy",
                  "shardnet.inference", "shardnet.protocols"),
    "protocols": ("torch", "transformers", "safetensors", "tokenizers", "shardnet.inference"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = "shardnet." + ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
    return out


def violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for lineno, mod in imported_modules(path):
            for f in FORBIDDEN[layer]:
                if mod == f or mod.startswith(f + "."):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{lineno} imports {mod}")
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
