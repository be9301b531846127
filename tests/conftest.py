"""Fixtures shared by every layer of tests, and the layer markers.

Tests live by layer: ``unit/<layer>`` (one process, no network: the fast run, ``pytest
tests/unit``), ``integration`` (real py-libp2p hosts in this process), ``system`` (real
processes: swarms, CLIs, the gateway, the NAT lab). Each test gets its directory's marker, so
``-m unit``, ``-m "not system"`` and so on select them too. Helpers are imported from
``shardnet.testing.helpers``; the fixtures here are thin wrappers of them."""

import itertools
import os
from pathlib import Path

import pytest

# The test models are tiny: one torch thread computes them faster than two that hand work to each
# other (and in-process peers, clients and test code share the machine's few cores).
import torch

from shardnet.testing import helpers

torch.set_num_threads(1)

# A test never touches the user's real identity.
os.environ.setdefault("SHARDNET_IDENTITY", "/nonexistent/shardnet-test-identity.key")

TESTS = Path(__file__).resolve().parent
_NAME_FILES = itertools.count()
LAYERS = ("unit", "integration", "system")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.fspath).resolve()
        if not path.is_relative_to(TESTS):  # e.g. interop/ run in the same session
            continue
        parts = path.relative_to(TESTS).parts
        if parts and parts[0] in LAYERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture
def loopback_config():
    """``loopback_config(**kw)``: a NodeConfig on a free loopback port (shardnet.testing.helpers)."""
    return helpers.loopback_config


@pytest.fixture(scope="module")
def reference(request):
    """What single-process transformers generates greedily after the test module's ``PROMPT``:
    ``NEW`` tokens, with the module's ``PENALTIES`` if it has them (``transformers_greedy``), on
    the default model. Every distributed run of that prompt must reproduce it."""
    from shardnet.models import default_model_path

    m = request.module
    return helpers.transformers_greedy(default_model_path(), m.PROMPT, m.NEW, penalties=getattr(m, "PENALTIES", None))


@pytest.fixture(scope="session")
def _model_names_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("model-names")


@pytest.fixture(autouse=True)
def _own_model_names(_model_names_dir, monkeypatch):
    """Each test (and the processes it starts) keeps its model name bindings in a file of its own,
    never the user's ~/.shardnet/model-names.json: a name bound in one test is unknown to the next."""
    monkeypatch.setenv("SHARDNET_MODEL_NAMES", str(_model_names_dir / f"{next(_NAME_FILES)}.json"))
