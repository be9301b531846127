"""The overlay: identity, libp2p host, discovery (bootstrap, DHT, mDNS), gossipsub.

Never imports torch or shardnet.inference (tests/unit/test_layering.py enforces it).
"""

from .behaviour import Behaviour, NodeBehaviour
from .config import NodeConfig
from .errors import ShardnetError
from .node import Node, default_behaviours, open_node
from .stream import Stream

__all__ = ["Behaviour", "Node", "NodeBehaviour", "NodeConfig", "ShardnetError", "Stream", "default_behaviours",
           "open_node"]
