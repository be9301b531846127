"""No test or bench helper is defined twice: a top-level function of tests/, bench/ or
shardnet/testing/ is defined in one file, and the others import it (shared ones live in
shardnet/testing/factories.py and shardnet/testing/helpers.py; docs/testing.md, "Shared helpers").

The rule, read from the source with ``ast``: the same top-level function name in two files fails,
except
- ``test_*`` functions and pytest fixtures: pytest looks them up per module, and a fixture such as
  ``swarm`` means "this file's swarm" (it builds it from the file's own spans, usually through a
  shared helper such as ``LocalSwarm``; ``reference``, the file's own prompt continued by
  ``transformers_greedy``, is one fixture in tests/conftest.py);
- ``PER_SCRIPT``: the generic names of what one script does (its entry point, its measurement,
  its report table). Each bench and test double has its own, so the name alone says nothing; but
  two of them with the same body are a copy, and fail.
Methods are not scanned: a class's methods are the class's."""

import ast
from collections import defaultdict

from shardnet.testing.helpers import REPO_ROOT

ROOTS = ("tests", "bench", "shardnet/testing")
#: names every script may define for its own work (the body must still differ)
PER_SCRIPT = frozenset({"main", "main_async", "measure", "report", "table", "row", "run"})


def is_fixture(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def helpers_of(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not n.name.startswith("test_") and not is_fixture(n)]


def duplicates(sources: dict[str, str]) -> dict[str, list[str]]:
    """{helper name: the files defining it} for every name defined in two files against the rule."""
    where: dict[str, dict[str, str]] = defaultdict(dict)  # name -> file -> the body, dumped
    for path, text in sources.items():
        for fn in helpers_of(ast.parse(text)):
            where[fn.name][path] = ast.dump(ast.Module(body=fn.body, type_ignores=[]))
    out = {}
    for name, bodies in where.items():
        if len(bodies) < 2:
            continue
        if name in PER_SCRIPT and len(set(bodies.values())) == len(bodies):
            continue  # each script's own
        out[name] = sorted(bodies)
    return out


def test_no_helper_is_defined_in_two_files():
    sources = {str(p.relative_to(REPO_ROOT)): p.read_text()
               for root in ROOTS for p in sorted((REPO_ROOT / root).rglob("*.py"))}
    assert len(sources) > 100  # the scan finds the files
    found = duplicates(sources)
    assert not found, f"helpers defined in more than one file (share them: shardnet/testing/factories.py): {found}"


def test_a_copied_helper_is_caught_and_per_file_names_are_not():
    echo = "async def echo(stream):\n    await stream.write(await stream.read())\n"
    fixture = "import pytest\n@pytest.fixture\ndef reference():\n    return 1\n"
    sources = {
        "tests/a.py": echo + fixture + "def test_x():\n    pass\ndef main():\n    print('a')\n",
        "tests/b.py": echo + fixture + "def test_x():\n    pass\ndef main():\n    print('b')\n",
        "bench/c.py": "def main():\n    print('a')\n",  # a copy of a.py's main
    }
    assert duplicates(sources) == {"echo": ["tests/a.py", "tests/b.py"],
                                   "main": ["bench/c.py", "tests/a.py", "tests/b.py"]}
