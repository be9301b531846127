import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from foreign import JsPeer, js_available  # noqa: E402


@pytest.fixture
def js(tmp_path):
    why = js_available()
    if why:
        pytest.fail(f"js-libp2p peer unavailable: {why}")  # never skipped silently
    peer = JsPeer(tmp_path)
    yield peer
    peer.stop()


@pytest.fixture
def node_config():
    from shardnet.transport.config import NodeConfig

    def make(**kw):
        kw.setdefault("listen", ["/ip4/127.0.0.1/tcp/0"])
        kw.setdefault("dial_timeout", 10.0)
        return NodeConfig(**kw)

    return make


@pytest.fixture
def js_relay(tmp_path):
    why = js_available()
    if why:
        pytest.fail(f"js-libp2p peer unavailable: {why}")
    peer = JsPeer(tmp_path, "js-relay", relay=True)
    yield peer
    peer.stop()


@pytest.fixture
async def go(tmp_path):
    """A go-libp2p daemon (p2pd) with pubsub and a DHT server."""
    from p2pd import P2pd, p2pd_available

    why = p2pd_available()
    if why:
        pytest.fail(f"go-libp2p daemon unavailable: {why}")
    d = P2pd(tmp_path, "go", "-pubsub", "-dhtServer")
    try:
        yield await d.start()
    finally:
        d.stop()
