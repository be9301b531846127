import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A test never touches the user's real identity.
os.environ.setdefault("SHARDNET_IDENTITY", "/nonexistent/shardnet-test-identity.key")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def loopback_config():
    from shardnet.transport.config import NodeConfig

    def make(**kw):
        kw.setdefault("listen", ["/ip4/127.0.0.1/tcp/0"])
        kw.setdefault("dial_timeout", 5.0)
        return NodeConfig(**kw)

    return make
