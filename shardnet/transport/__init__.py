"""The overlay: identity, libp2p host, discovery (bootstrap, DHT, mDNS), gossipsub.

Never imports torch or shardnet.inference (tests/test_layering.py enforces it).
"""

from .config import NodeConfig
from .errors import ShardnetError
from .node import Node, open_node
from .stream import Stream

__all__ = ["Node", "NodeConfig", "ShardnetError", "Stream", "open_node"]
